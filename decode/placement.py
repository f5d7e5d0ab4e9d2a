"""Where the KV cache lives when the parameters are sharded: split like the kv heads.

Parameters placed on a device mesh (`jax.device_put(params, models.axes.param_shardings(
model, mesh))`) decode as they are: the jitted computations take them, the compiler
partitions the model over the mesh, and the tokens are the single-device ones. With the
default rules a tensor axis splits the query heads, the kv heads, the MLP width and the
vocabulary, so each device projects keys and values for its own kv heads only; the cache
should hold just those, never all K. `cache_sharding` reads that split off the key/value
kernels (outside jit, where the arrays know their shardings) and `constrain_cache` pins
the cache to it inside the computation:

    key kernel [D, K, H] on P(None, "tensor", None)   ->  cache k, v [L, B, K, S, H] on
                                                          P(None, None, "tensor", None, None)

The cross-attention keys/values [L, Bs, K, Ssrc, H] have the same layout and the same
split. Only the kv-heads axis is split: the batch stays whole, as the parameters imply
nothing about it. Unsharded parameters (or traced ones, inside a caller's own jit) give
None, and `constrain_cache(cache, None)` is the cache unchanged.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from models import KVCache
from models.cache import self_leaves

# Parameters whose dimension -2 is the kv heads: self-attention "key" / "value" kernels
# [(L,) D, K, H] and the encoder-decoder's stacked cross-attention "key_kernel" /
# "value_kernel" [L, D, K, H].
_KV_KERNELS = {("key", "kernel"), ("value", "kernel"), ("key_kernel",), ("value_kernel",)}


def _kv_kernels(params) -> list:
    """The key/value projection kernels among `params` (any nesting).

    Which leaves they are depends on the tree's structure only, so it is found once per
    structure: naming every leaf's path costs about 2 ms for a 6+6-layer model, a
    fixed cost of each decoding call (measured by `bench.step_overhead`)."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    indices = _KERNEL_INDICES.get(treedef)
    if indices is None:
        def name(path, n):   # the last n keys of a leaf's path
            return tuple(getattr(k, "key", None) for k in path[-n:])

        paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        indices = tuple(i for i, path in enumerate(paths)
                        if name(path, 1) in _KV_KERNELS or name(path, 2) in _KV_KERNELS)
        if len(_KERNEL_INDICES) >= 64:      # a bound for a process that loads many models
            _KERNEL_INDICES.clear()
        _KERNEL_INDICES[treedef] = indices
    return [leaves[i] for i in indices]


# A parameter tree's structure -> the indices of its key/value kernels among its leaves.
_KERNEL_INDICES: dict = {}


def cache_sharding(params) -> NamedSharding | None:
    """The sharding of the cache's [L, B, K, S, H] buffers that `params` imply.

    The mesh axes that split the kv-heads dimension of every key/value kernel, on that
    kernel's mesh, applied to the cache's K axis. None when there is nothing to follow:
    no kernel is a concrete array on a `NamedSharding` (unsharded or traced params), the
    kv heads are whole, or the kernels disagree (then placement is left to the compiler).

        key kernel P(None, "tensor", None)  ->  P(None, None, "tensor", None, None)
    """
    kernels = _kv_kernels(params)
    if not kernels or any(isinstance(k, jax.core.Tracer) or not isinstance(k, jax.Array)
                          or not isinstance(k.sharding, NamedSharding) for k in kernels):
        return None
    splits = {(k.sharding.mesh, _dim_axes(k.sharding.spec, k.ndim - 2)) for k in kernels}
    if len(splits) != 1:
        return None
    (mesh, axes), = splits
    if axes is None:
        return None
    return NamedSharding(mesh, P(None, None, axes, None, None))


def _dim_axes(spec: P, dim: int):
    """The mesh axes of `spec` for dimension `dim` (None: whole); a spec may be shorter
    than its array."""
    axes = tuple(spec)[dim] if dim < len(spec) else None
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return None if not axes else axes[0] if len(axes) == 1 else axes


def constrain_cache(cache: KVCache, sharding: NamedSharding | None) -> KVCache:
    """The cache with its self- and cross-attention K/V (and an int8 cache's scales, whose
    kv-heads axis is where K/V have theirs) pinned to `sharding` (a `cache_sharding`
    result); unchanged when it is None. Call it inside jit."""
    if sharding is None:
        return cache

    kv_axes = sharding.spec[2]

    def pin(x):       # the kv-heads axis is third from the end in either layout
        if x is None:
            return None
        spec = P(*([None] * (x.ndim - 3)), kv_axes, None, None)
        return jax.lax.with_sharding_constraint(x, NamedSharding(sharding.mesh, spec))

    def pin_layers(x):
        return None if x is None else jax.tree.map(pin, x)

    return cache.replace(**{n: pin_layers(x) for n, x in self_leaves(cache).items()},
                         cross_k=pin_layers(cache.cross_k), cross_v=pin_layers(cache.cross_v))


def with_cache_sharding(static: dict, params) -> dict:
    """A call's static keywords plus `cache_sharding` when `params` imply one: only sharded
    parameters add the key, so an unsharded call's compilation key stays as it was."""
    sharding = cache_sharding(params)
    return static if sharding is None else {**static, "cache_sharding": sharding}
