"""The run directory: one run at a time, found writable before any work, files written whole.

    lock = claim(workdir, jax.process_index())   # before data preparation or compilation
    ...
    write_text(os.path.join(workdir, "summary.json"), text)   # a temporary name, then a rename
    lock.release()                               # or the process ends (kill -9 included)

One run per workdir: every process of a run locks its own file in the workdir, the lead
process `.lock` and process i > 0 `.lock.i` (they share the directory, so each needs its
own). A second run started there while the first is alive fails at once on its own process
0 (or on any process i the first run also has), naming the holder's pid and host. The lock
is `fcntl.flock`: the operating system drops it when its process dies, however it dies, so
no stale lock is ever left to delete. On a filesystem without locks (some network and
bucket mounts) the run warns and goes on unlocked, still probing every path it writes.
Whatever a killed run left half-written (the hidden temporaries of `models.atomic`) is
removed when the next run takes the lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Callable

from models import atomic

#: What the run writes into the workdir itself; each one, if present, must be writable.
RUN_DIRS = ("checkpoints", "tensorboard", "tokenizer", "model", "cache")
RUN_FILES = ("metrics.jsonl", "summary.json")


class WorkdirError(OSError):
    """A path of the run that cannot be written (its message names the path)."""


class WorkdirInUse(WorkdirError):
    """Another live run holds the workdir's lock."""


class Lock:
    """A held workdir lock; `release()` (or the end of the process) frees it."""

    def __init__(self, path: str, fd: int | None):
        self.path, self._fd = path, fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)        # closing the only descriptor drops the flock
            self._fd = None


def _lock_name(process_index: int) -> str:
    return ".lock" if process_index == 0 else f".lock.{process_index}"


def claim(workdir: str, process_index: int = 0) -> Lock:
    """Creates `workdir` if needed, checks that the run can write there, and locks it.

    Raises:
        WorkdirError: naming the path that cannot be made or written (a file in the way, no
            permission, a read-only filesystem).
        WorkdirInUse: naming the workdir and the pid and host of the run holding it.
    """
    try:
        os.makedirs(workdir, exist_ok=True)
    except FileExistsError:
        raise WorkdirError(f"workdir {workdir!r} is not a directory (a file is in the way)"
                           ) from None
    except OSError as e:
        raise WorkdirError(f"cannot create the workdir {workdir!r}: {e.strerror}") from e
    path = os.path.join(workdir, _lock_name(process_index))
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise WorkdirError(f"cannot write in the workdir {workdir!r} ({path}: {e.strerror})"
                           ) from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            os.close(fd)
            raise WorkdirInUse(f"workdir {workdir!r} is in use by another run "
                               f"({_holder(path)}; lock file {path}); wait for it to end or "
                               "use another workdir") from None
        print(f"warning: cannot lock {path} ({e.strerror}); nothing stops a second run in "
              f"{workdir!r}", flush=True)
    lock = Lock(path, fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode())
        if process_index == 0:
            _remove_temporaries(workdir)
        for name in RUN_DIRS:
            check_dir_writable(os.path.join(workdir, name), missing_ok=True)
        for name in RUN_FILES:
            _check_file_writable(os.path.join(workdir, name))
    except OSError as e:
        lock.release()
        if isinstance(e, WorkdirError):
            raise
        raise WorkdirError(f"cannot write in the workdir {workdir!r} ({path}: {e.strerror})"
                           ) from e
    return lock


def _remove_temporaries(workdir: str) -> None:
    """Removes what a killed run left half-written in the workdir (hidden `.NAME.tmp-...`
    files and directories: `models.atomic`'s temporaries). The workdir is locked, so no live
    writer owns them."""
    for name in os.listdir(workdir):
        if name.startswith(".") and ".tmp-" in name:
            path = os.path.join(workdir, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.remove(path)


def _holder(path: str) -> str:
    """'pid 123 on host h', from the lock file the holder wrote."""
    try:
        with open(path) as f:
            info = json.loads(f.read() or "{}")
        return f"pid {info['pid']} on host {info['host']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its pid and host are not known yet"


def check_dir_writable(path: str, *, missing_ok: bool = False) -> None:
    """Creates and removes an empty file in directory `path`.

    Raises:
        WorkdirError: naming `path` when it is not a directory or cannot be written.
    """
    if not os.path.lexists(path):
        if missing_ok:
            return
        raise WorkdirError(f"{path} does not exist")
    if not os.path.isdir(path):
        raise WorkdirError(f"{path} is not a directory (a file is in the way)")
    try:
        fd, probe = tempfile.mkstemp(dir=path, prefix=".write-probe-")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise WorkdirError(f"cannot write in {path}: {e.strerror}") from e


def _check_file_writable(path: str) -> None:
    if not os.path.lexists(path):
        return
    if os.path.isdir(path):
        raise WorkdirError(f"{path} is a directory; the run writes a file there")
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise WorkdirError(f"cannot write {path}: {e.strerror}") from e


def write_text(path: str, text: str) -> None:
    """Writes `path` whole or not at all (`models.atomic.write_text`).

    Raises:
        WorkdirError: naming `path` when it cannot be written.
    """
    try:
        atomic.write_text(path, text)
    except OSError as e:
        raise WorkdirError(str(e)) from e


def write_dir(path: str, fill: Callable[[str], None]) -> None:
    """Makes directory `path` whole or not at all: `fill(tmp)` writes into a temporary
    directory that then takes `path`'s place (`models.atomic.replaced_dir`).

    Raises:
        WorkdirError: naming `path` when it cannot be written.
    """
    try:
        with atomic.replaced_dir(path) as tmp:
            fill(tmp)
    except OSError as e:
        raise WorkdirError(str(e)) from e
