"""What a checkpoint holds is finite when written and unchanged when read.

Before a save, `first_non_finite(tree)` looks for NaN or Inf on device (one jitted reduction
over the tree, one flag per array; only a bad flag's path is looked up on the host). After
orbax has finished a step, `write_manifest(step_dir)` records the size and sha256 of every
file in it, in `step_dir/integrity.json`, written last and atomically; on restore,
`check_manifest(step_dir)` reads every file again and names the first that differs.

    integrity.json = {"format": 1, "algorithm": "sha256",
                      "files": {"params/ocdbt.process_0/d/0c66...": {"size": 103999,
                                                                    "sha256": "9f2c..."}, ...}}

Files in the step directory that the manifest does not list are ignored: whatever orbax
reads is reached through listed files (its own manifests and metadata), so nothing unlisted
can change what is restored.
"""

from __future__ import annotations

import hashlib
import json
import os

import jax
import jax.numpy as jnp

from train.workdir import write_text

MANIFEST = "integrity.json"
_FORMAT = 1
_CHUNK = 1 << 20


def path_name(path) -> str:
    """'params/decoder/layer_0/mlp/up/kernel' for a JAX key path."""
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


@jax.jit
def _finite_flags(leaves: list[jax.Array]) -> jax.Array:
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])


def first_non_finite(tree) -> str | None:
    """The path of the first floating-point array of `tree` holding a NaN or an Inf, or None.

    Each array is checked where it lives: on this process's first device (one replica of a
    replicated array, identical to the others), so no collective runs and every process
    decides alone and alike. The only transfer to the host is one bool per array.
    """
    named = [(path, x) for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
             if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    if not named:
        return None
    leaves = [x.addressable_data(0) if isinstance(x, jax.Array) else jnp.asarray(x)
              for _, x in named]
    device = next(iter(leaves[0].devices()))
    flags = jax.device_get(_finite_flags([jax.device_put(x, device) for x in leaves]))
    if flags.all():
        return None
    return path_name(named[int(flags.argmin())][0])


def _digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(step_dir: str) -> list[str]:
    out = []
    for root, _, names in os.walk(step_dir):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), step_dir)
            if rel != MANIFEST and not os.path.basename(rel).startswith(f".{MANIFEST}.tmp-"):
                out.append(rel)
    return sorted(out)


def write_manifest(step_dir: str) -> None:
    """Writes `step_dir/integrity.json` for the files there now (call it last)."""
    files = {rel: {"size": os.path.getsize(os.path.join(step_dir, rel)),
                   "sha256": _digest(os.path.join(step_dir, rel))}
             for rel in _files(step_dir)}
    write_text(os.path.join(step_dir, MANIFEST),
               json.dumps({"format": _FORMAT, "algorithm": "sha256", "files": files},
                          indent=1) + "\n")


def has_manifest(step_dir: str) -> bool:
    return os.path.exists(os.path.join(step_dir, MANIFEST))


def check_manifest(step_dir: str) -> str | None:
    """None when every file listed in `step_dir`'s manifest is there with its size and
    digest; otherwise what is wrong, naming the file (relative to `step_dir`)."""
    try:
        with open(os.path.join(step_dir, MANIFEST)) as f:
            manifest = json.load(f)
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its {MANIFEST} cannot be read ({type(e).__name__})"
    for rel, want in files.items():
        path = os.path.join(step_dir, rel)
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
