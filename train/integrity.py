"""What a checkpoint holds is finite when written and unchanged when read.

Before a save, `first_non_finite(tree)` looks for NaN or Inf on device (one jitted reduction
over the tree, one flag per array; only a bad flag's path is looked up on the host). After
orbax has finished a step, `models.atomic.write_manifest(step_dir, MANIFEST)` records the
size and sha256 of every file in it, written last and atomically; on restore,
`check_manifest` reads every file again and names the first that differs.

    integrity.json = {"format": 1, "algorithm": "sha256",
                      "files": {"params/ocdbt.process_0/d/0c66...": {"size": 103999,
                                                                    "sha256": "9f2c..."}, ...}}

Files in the step directory that the manifest does not list are ignored: whatever orbax
reads is reached through listed files (its own manifests and metadata), so nothing unlisted
can change what is restored.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MANIFEST = "integrity.json"


def path_name(path) -> str:
    """'params/decoder/layer_0/mlp/up/kernel' for a JAX key path."""
    return jax.tree_util.keystr(path, simple=True, separator="/")


@jax.jit
def _finite_flags(leaves: list[jax.Array]) -> jax.Array:
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])


def first_non_finite(tree) -> str | None:
    """The path of the first floating-point array of `tree` holding a NaN or an Inf, or None.

    Each array is checked where it lives: on this process's first device (one replica of a
    replicated array, identical to the others), so no collective runs and every process
    decides alone and alike. The only transfer to the host is one bool per array. A tree
    with sharded arrays is checked whole, shard by shard, in one jitted reduction that every
    process runs.
    """
    named = [(path, x) for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
             if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    if not named:
        return None
    if any(isinstance(x, jax.Array) and not x.sharding.is_fully_replicated for _, x in named):
        # Sharded arrays (train.sharding): one reduction over all their shards, whose flags
        # come back replicated, so every process decides alike.
        flags = jax.device_get(_finite_flags([x for _, x in named]).addressable_data(0))
        return None if flags.all() else path_name(named[int(flags.argmin())][0])
    leaves = [x.addressable_data(0) if isinstance(x, jax.Array) else jnp.asarray(x)
              for _, x in named]
    device = next(iter(leaves[0].devices()))
    flags = jax.device_get(_finite_flags([jax.device_put(x, device) for x in leaves]))
    if flags.all():
        return None
    return path_name(named[int(flags.argmin())][0])
