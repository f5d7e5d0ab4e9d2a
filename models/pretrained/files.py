"""The files of a model directory: config.json, safetensors weights (one file, or shards
named by `model.safetensors.index.json`), written whole or not at all.

Loading is not executing: only JSON and safetensors are read. A directory with pickled
weights alone (`pytorch_model.bin`) is refused with a message saying how to convert it, and
a shard index naming a file outside the directory is refused.
"""

from __future__ import annotations

import contextlib
import json
import os

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, which safetensors reads into)
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from models.atomic import read_json
from models.errors import UserError

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "tf_model.h5",
           "flax_model.msgpack")


class Weights(contextlib.AbstractContextManager):
    """The tensors of a model directory, read one at a time as numpy arrays (in the dtype
    they are stored in: bfloat16 and float16 included). Reads use `pread`, not a memory
    map, so pages of tensors already converted do not stay in the process's memory.

        with Weights(directory) as w:
            w.keys()                 # every tensor name, across shards
            w.shape(name), w.read(name), w.read_rows(name, 1)
    """

    def __init__(self, directory: str):
        self.directory = directory
        self._stack = contextlib.ExitStack()
        self._files: dict[str, object] = {}
        self._where: dict[str, str] = {}
        try:
            self._open_all()
        except BaseException:
            self._stack.close()              # the shards opened before the failing one
            raise

    def _open_all(self) -> None:
        directory = self.directory
        index = os.path.join(directory, INDEX)
        if os.path.exists(index):
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise UserError(f"{index} has no weight_map")
            for key, name in weight_map.items():
                self._where[key] = self._checked_shard(name, index)
            for name in sorted(set(self._where.values())):
                self._open(name)
        elif os.path.exists(os.path.join(directory, WEIGHTS)):
            handle = self._open(WEIGHTS)
            self._where = dict.fromkeys(handle.keys(), WEIGHTS)
        else:
            pickled = [p for p in PICKLES if os.path.exists(os.path.join(directory, p))]
            if pickled:
                raise UserError(
                    f"{directory} has weights only as {pickled[0]}, which loading would have to "
                    "unpickle (running code from the file); this project reads safetensors "
                    "only. Convert them once, where you trust the file: "
                    "transformers.AutoModel.from_pretrained(dir).save_pretrained(dir, "
                    "safe_serialization=True)")
            raise FileNotFoundError(f"no {WEIGHTS} or {INDEX} in {directory}")

    def _checked_shard(self, name: str, index: str) -> str:
        if (not isinstance(name, str) or os.path.isabs(name) or os.sep in name
                or "/" in name or name in ("", ".", "..")):
            raise UserError(f"{index} names shard file {name!r}, which is not a file name "
                             f"inside {self.directory}; refusing to read outside the directory")
        return name

    def _open(self, name: str):
        path = os.path.join(self.directory, name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"weights file {path} is missing")
        try:
            handle = self._stack.enter_context(
                safe_open(path, framework="numpy", backend="pread"))
        except Exception as e:          # safetensors raises its own error types
            raise UserError(f"{path} is not a readable safetensors file: {e}") from None
        self._files[name] = handle
        return handle

    def keys(self) -> set[str]:
        return set(self._where)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._files[self._where[key]].get_slice(key).get_shape())

    def read(self, key: str) -> np.ndarray:
        return self._files[self._where[key]].get_tensor(key)

    def read_rows(self, key: str, stop: int) -> np.ndarray:
        """The first `stop` rows of a tensor, reading only those."""
        return self._files[self._where[key]].get_slice(key)[:stop]

    def __exit__(self, *exc):
        self._stack.close()
        return None


def write_weights(directory: str, tensors, max_shard_bytes: int) -> None:
    """Writes (name, array) pairs as safetensors in `directory`: one `model.safetensors`,
    or shards of at most `max_shard_bytes` with an index when they do not fit one. Only
    one shard's tensors are held at a time."""
    shards: list[str] = []
    weight_map: dict[str, str] = {}
    pending: dict[str, np.ndarray] = {}
    size = total = 0

    def flush():
        nonlocal pending, size
        if pending:
            name = f"shard-{len(shards):05d}.tmp"
            path = os.path.join(directory, name)
            try:
                save_file(pending, path, metadata={"format": "pt"})
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
            except OSError:
                raise
            except Exception as e:    # safetensors' own error type (a full disk, say)
                raise OSError(f"cannot write {path}: {e}") from e
            shards.append(name)
            weight_map.update(dict.fromkeys(pending, name))
        pending, size = {}, 0

    for name, array in tensors:
        array = np.ascontiguousarray(array)
        nbytes = array.nbytes
        if pending and size + nbytes > max_shard_bytes:
            flush()
        pending[name] = array
        size, total = size + nbytes, total + nbytes
    flush()
    if len(shards) == 1:
        os.rename(os.path.join(directory, shards[0]), os.path.join(directory, WEIGHTS))
        return
    final = {s: f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
             for i, s in enumerate(shards)}
    for s, f in final.items():
        os.rename(os.path.join(directory, s), os.path.join(directory, f))
    write_json(os.path.join(directory, INDEX), {
        "metadata": {"total_size": total},
        "weight_map": {k: final[v] for k, v in sorted(weight_map.items())}})


def write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
