"""Directories of `.npy` arrays that are written whole or not at all, and read only when
whole: the token cache under `WORKDIR/cache`.

    save(path, key, {"tokens0.npy": tokens, ...})    # into path.tmp-PID@HOST-XXXX, then renamed
    arrays = load(path, key)                           # memory-mapped, or None: compute again

A directory at `path` only ever appears by a rename of a complete one, its `done` marker
written last (the key it was made for and each file's size). `load` trusts nothing else: no
marker, another key, or a file of another size (damaged since) reads as missing, and the
next `save` replaces it. A writer killed mid-way leaves only its temporary directory, which
no reader looks at and the next `save` or `load` on that host removes once its process is
gone.

    WORKDIR/cache/local_text-train-1f3a9c0b2d4e5f60/                  tokens0.npy offsets0.npy
                                                                     example_ids.npy done
    WORKDIR/cache/local_text-train-1f3a9c0b2d4e5f60.tmp-4242@host-k2j_x/   (pid 4242 writing)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import socket
import tempfile

import numpy as np

from models.errors import UserError

log = logging.getLogger(__name__)
DONE = "done"
_TEMPORARY = re.compile(r"\.tmp-(\d+)@(.*)-[^-]*$")    # after the final name: pid, host


def load(path: str, key: str) -> dict[str, np.ndarray] | None:
    """The arrays saved at `path` for `key` (memory-mapped), or None when there are none to
    trust. Also removes the temporary directories of `path` that dead writers left."""
    _remove_dead_temporaries(path)
    try:
        with open(os.path.join(path, DONE)) as f:
            done = json.load(f)
        files = done["files"]
        if done["key"] != key or any(os.path.getsize(os.path.join(path, name)) != size
                                     for name, size in files.items()):
            raise UserError("made for another key, or a file changed since")
        return {name: np.load(os.path.join(path, name), mmap_mode="r") for name in files}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        if os.path.exists(path):
            log.warning("cache %s is incomplete or stale (%s): computing it again", path, e)
        return None


def save(path: str, key: str, arrays: dict[str, np.ndarray]) -> None:
    """Writes `arrays` (file name -> array) and the `done` marker into a temporary directory
    next to `path`, each file synced, then renames it to `path`. An untrusted directory at
    `path` is replaced; a trusted one (another process was first) is kept.

    Raises:
        OSError: naming the file or directory that could not be written (a full disk, no
            permission); no directory is left at `path` and the temporary one is removed.
    """
    parent = os.path.dirname(path)
    target, tmp = parent, None
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=parent, prefix=f"{os.path.basename(path)}.tmp-"
                                                  f"{os.getpid()}@{socket.gethostname()}-")
        sizes = {}
        for name, array in arrays.items():
            target = os.path.join(tmp, name)
            with open(target, "wb") as f:
                np.save(f, array)
                f.flush()
                os.fsync(f.fileno())
            sizes[name] = os.path.getsize(target)
        target = os.path.join(tmp, DONE)
        with open(target, "w") as f:
            json.dump({"key": key, "files": sizes}, f)
            f.flush()
            os.fsync(f.fileno())
        target = path
        if os.path.exists(path):
            if load(path, key) is not None:
                return                           # another process was first: keep its copy
            shutil.rmtree(path)                  # untrusted: replace it
        try:
            os.rename(tmp, path)
        except OSError:
            if load(path, key) is None:
                raise
            # Another process renamed its copy into place in the meantime.
        tmp = None
    except OSError as e:
        if e.errno is None:
            raise OSError(f"cannot write the cache {target!r}: {e}") from e
        raise OSError(e.errno, f"cannot write the cache: {e.strerror or e}", target) from e
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _remove_dead_temporaries(path: str) -> None:
    """Removes the temporary directories of `path` whose writer, a process of this host, is
    gone. Those of live processes, and of other hosts, stay."""
    parent, base = os.path.split(path)
    with contextlib.suppress(OSError):
        for name in os.listdir(parent):
            m = _TEMPORARY.fullmatch(name[len(base):]) if name.startswith(base) else None
            if m and m.group(2) == socket.gethostname() and not _alive(int(m.group(1))):
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:              # someone else's process
        return True
    return True
