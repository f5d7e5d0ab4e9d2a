"""Files and directories written whole or not at all, and manifests that prove them unchanged.

    write_text(path, text)                    # a synced temporary file, renamed over `path`
    with replaced_dir(path) as tmp:           # fill tmp; on success it replaces `path`
        ...
    write_manifest(directory, "integrity.json")        # size and sha256 of every file, last
    check_manifest(directory, "integrity.json")        # None, or what changed, naming the file

A directory is replaced by one atomic exchange of names (Linux `renameat2(RENAME_EXCHANGE)`),
so a crash leaves the old directory or the new one at `path`, never half of one and never
neither; where the exchange is not available, two renames, the old one put back if the
second fails. Temporary names are hidden (`.NAME.tmp-PID-XXXX`) and sit beside the target.
Files are fsynced, and so is the directory the rename happens in. Every OSError names the
path the caller asked for, not a temporary one.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import json
import os
import secrets
import shutil

from models.errors import UserError

MANIFEST_FORMAT = 1
_CHUNK = 1 << 20


def temporary_name(path: str) -> str:
    """A fresh hidden name beside `path`."""
    head, tail = os.path.split(os.path.abspath(path))
    return os.path.join(head, f".{tail}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def _fsync_dir(directory: str) -> None:
    with contextlib.suppress(OSError):        # not every filesystem lets a directory sync
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_text(path: str, text: str) -> None:
    """`path` holds `text`, or its old contents: never half of either.

    Raises:
        OSError: naming `path` (a full disk, no permission, a directory in the way).
    """
    tmp = temporary_name(path)
    try:
        with open(tmp, "x") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(os.path.dirname(os.path.abspath(path)))
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise OSError(e.errno, f"cannot write {path}: {e.strerror or e}", path) from e


def _exchange(a: str, b: str) -> bool:
    """Swaps the names `a` and `b` in one step; False where the system cannot."""
    renameat2 = getattr(_libc(), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, a.encode(), at_fdcwd, b.encode(), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), b)


@contextlib.contextmanager
def replaced_dir(path: str):
    """Yields a fresh directory beside `path`; when the block succeeds it takes `path`'s
    place (see the module docstring), else it is removed and `path` is untouched.

    Raises:
        OSError: naming `path` when it cannot be written or is a file.
    """
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    tmp = temporary_name(path)
    try:
        os.makedirs(parent, exist_ok=True)
        os.mkdir(tmp)                             # the umask's permissions, as any directory
    except OSError as e:
        raise OSError(e.errno, f"cannot write {path}: {e.strerror or e}", path) from e
    try:
        yield tmp
        if os.path.lexists(path) and not os.path.isdir(path):
            raise OSError(errno.ENOTDIR, f"{path} exists and is not a directory", path)
        if not os.path.exists(path):
            os.rename(tmp, path)
        elif _exchange(tmp, path):                # tmp now names the old directory
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            old = temporary_name(path)
            os.rename(path, old)
            try:
                os.rename(tmp, path)
            except OSError:
                os.rename(old, path)
                raise
            shutil.rmtree(old, ignore_errors=True)
        _fsync_dir(parent)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.filename == path:
            raise
        raise OSError(e.errno, f"cannot write {path}: {e.strerror or e}", path) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@functools.cache
def _libc():
    return ctypes.CDLL(None, use_errno=True)


def read_json(path: str) -> dict:
    """A JSON object from `path`; a damaged file is a UserError naming it."""
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} holds {type(data).__name__}, not a JSON object")
    return data


def _digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _listed(directory: str, manifest: str) -> list[str]:
    out = []
    for root, _, names in os.walk(directory):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), directory)
            if rel != manifest and not name.startswith(f".{manifest}.tmp-"):
                out.append(rel)
    return sorted(out)


def write_manifest(directory: str, manifest: str) -> None:
    """Writes `directory/manifest`: the size and sha256 of every file there now (call it
    last, when nothing else will be written).

        {"format": 1, "algorithm": "sha256",
         "files": {"model.safetensors": {"size": 103999, "sha256": "9f2c..."}, ...}}
    """
    files = {rel: {"size": os.path.getsize(os.path.join(directory, rel)),
                   "sha256": _digest(os.path.join(directory, rel))}
             for rel in _listed(directory, manifest)}
    write_text(os.path.join(directory, manifest), json.dumps(
        {"format": MANIFEST_FORMAT, "algorithm": "sha256", "files": files}, indent=1) + "\n")


def check_manifest(directory: str, manifest: str) -> str | None:
    """None when every file `directory/manifest` lists is there with its size and digest;
    otherwise what is wrong, naming the file (relative to `directory`). Files it does not
    list are not read."""
    try:
        with open(os.path.join(directory, manifest)) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its {manifest} cannot be read ({type(e).__name__})"
    for rel, want in files.items():
        path = os.path.join(directory, rel)
        try:
            size = os.path.getsize(path)
            if size != want["size"]:
                return f"{rel} has {size} bytes, its manifest says {want['size']}"
            if _digest(path) != want["sha256"]:
                return f"{rel} differs from its manifest (sha256)"
        except FileNotFoundError:
            return f"{rel} is missing"
        except OSError as e:
            return f"{rel} cannot be read ({e.strerror})"
    return None
