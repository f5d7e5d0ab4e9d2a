"""Logical axis names of every parameter, for sharding a model without touching its code.

Each parameter is made with its axes named (`named`), for example a query kernel
`[D, N, H]` as ("embed", "heads", "head_dim"); `nn.scan` adds "layers" in front of a
scanned stack's parameters. The names ride on flax's `LogicallyPartitioned` boxes, which
the models' `init` removes (`PlainInit`): `model.init(...)["params"]` is plain arrays, as
if the names were not there, and a model used without a mesh is unchanged.

`logical_specs` reads the names back from an abstract initialisation, and rules map them
to the axes of a (data, fsdp, tensor, expert) device mesh (`DEFAULT_RULES`;
`train.sharding` explains what each axis costs):

    specs = logical_specs(model, tokens)      # {"tokens": {"embedding": P("vocab", "embed")}, ...}
    shardings = param_shardings(model, mesh)  # the same tree of NamedShardings

The names used:

    vocab       the vocabulary (embedding rows, output columns)
    embed       the model width D
    heads       query heads N              kv_heads   key/value heads K
    head_dim    each head's width H        mlp        the MLP's hidden width F
    layers      a scanned stack's leading axis
    positions   learned position rows      types      token-type rows
    buckets     relative-position buckets  labels     classifier outputs
    lora        a low-rank adapter's rank (`models.lora`)
    lora_rows   the rows of per-row adapters (`LoraConfig.per_row`: one adapter a row)
    expert      a mixture-of-experts layer's experts (`models.moe`)
    taps, conv_in   an audio front end's kernel width and input channels (`models.audio`)
    latent      latent attention's compressed widths (`models.latent_attention`)
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import meta
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from models.errors import UserError

# The logical axis names parameters use (see the module docstring).
NAMES = ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "layers", "positions",
         "types", "buckets", "labels", "lora", "lora_rows", "expert", "taps", "conv_in",
         "latent")


def _traced_once(init):
    """`init` jitted on its shape and dtype. Flax traces a parameter's initialiser again on
    every `apply`, to check the parameter's shape; shared and jitted, each (initialiser,
    shape, dtype) is traced once per process instead of once per parameter and trace
    (about a third of tracing a decoding call took)."""
    jitted = jax.jit(init, static_argnums=(1, 2))

    def traced_once(key, shape, dtype=jnp.float32):
        return jitted(key, tuple(shape), dtype)
    return traced_once


# The initialisers the models use, shared objects (`named` takes them).
XAVIER_UNIFORM = _traced_once(nn.initializers.xavier_uniform())
ZEROS = _traced_once(nn.initializers.zeros)
ONES = _traced_once(nn.initializers.ones)
# A LoRA adapter's A [in..., r]: uniform in +-1/sqrt(fan in), as PEFT initialises it
# (kaiming-uniform with a = sqrt(5)); its B starts at zero.
LORA_A_INIT = _traced_once(nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform"))
LORA_STACKED_A_INIT = _traced_once(nn.initializers.variance_scaling(   # [L, D, r]
    1 / 3, "fan_in", "uniform", batch_axis=(0,)))


@functools.cache
def normal_init(std: float):
    """A normal initialiser of standard deviation `std`, one shared object per value."""
    return _traced_once(nn.initializers.normal(std))


@functools.cache
def stacked_projection_init(in_axis: int, out_axis: tuple, batch_axis: tuple):
    """Xavier-uniform for a stack of projections: fan in and out over the given axes, the
    batch axes apart (`variance_scaling(1, "fan_avg", "uniform")`)."""
    return _traced_once(nn.initializers.variance_scaling(
        1.0, "fan_avg", "uniform", in_axis=in_axis, out_axis=out_axis, batch_axis=batch_axis))


def named(init, *names: str | None):
    """`init` whose result carries the logical axis `names`, one per dimension."""
    unknown = [n for n in names if n is not None and n not in NAMES]
    if unknown:
        raise UserError(f"logical axis names {unknown} are not among {NAMES}")
    return nn.with_logical_partitioning(init, names)


class PlainInit:
    """A mixin for the top-level models: `init` returns plain arrays, the axis names
    removed (read them with `logical_specs`)."""

    @nn.nowrap
    def init(self, *args, **kwargs):
        return meta.unbox(nn.Module.init(self, *args, **kwargs))


def logical_specs(model: nn.Module, *init_args, method=None):
    """The params' logical axis names, a tree of `PartitionSpec`s shaped like
    `model.init(key, *init_args)["params"]` (traced abstractly: nothing is allocated).

    `init_args` may be arrays or `jax.ShapeDtypeStruct`s, without the key.
    """
    return nn.get_partition_spec(boxed_params(model, *init_args, method=method))


def boxed_params(model: nn.Module, *init_args, method=None):
    """The abstract params still in their axis-name boxes (for deriving the specs of trees
    made from them, such as an optimiser state: `nn.get_partition_spec(tx.init(boxed))`)."""
    return jax.eval_shape(lambda *a: nn.Module.init(model, jax.random.key(0), *a,
                                                     method=method), *init_args)["params"]


AXES = ("data", "fsdp", "tensor")
# The fourth mesh axis, for a mixture of experts: the experts split over it, and so does the
# batch. A mesh without it (the three AXES) reads as if it had it at size 1.
EXPERT_AXIS = "expert"
# Logical axis -> mesh axes. The batch goes over data, fsdp and expert; everything a
# tensor-parallel layer splits goes over tensor; what every parameter has ("embed") goes
# over fsdp; the experts of a mixture-of-experts layer over expert.
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp", EXPERT_AXIS)),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    ("layers", None),
    ("positions", None),
    ("types", None),
    ("buckets", None),
    ("labels", None),
    ("lora", None),
    ("lora_rows", None),
    ("expert", EXPERT_AXIS),
    ("taps", None),
    ("conv_in", None),
    ("latent", None),          # latent attention's compressed width (kv_lora_rank, q_lora_rank)
)


def check_rules(rules) -> dict[str, tuple[str, ...]]:
    """The rules as {logical axis: mesh axes}; unknown names are refused."""
    out = {}
    for rule in rules:
        if len(rule) != 2:
            raise UserError(f"logical_axis_rules entry {rule!r} must be (logical axis, "
                             "mesh axes)")
        name, axes = rule
        if name not in (*NAMES, "batch"):
            raise UserError(f"logical_axis_rules names {name!r}, which is not a logical "
                             f"axis: {('batch', *NAMES)}")
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        bad = [a for a in axes if a not in (*AXES, EXPERT_AXIS)]
        if bad:
            raise UserError(f"logical_axis_rules maps {name!r} to {bad}, not mesh axes "
                             f"{(*AXES, EXPERT_AXIS)}")
        out[name] = axes
    return out


def dim_names(logical: P, ndim: int) -> tuple:
    """One logical name (or None) per dimension; an unnamed array's spec is empty."""
    return tuple(logical) + (None,) * (ndim - len(logical))


def axis_size(mesh: Mesh, axis: str) -> int:
    """The size of a mesh axis; 1 for an axis the mesh lacks (a mesh of the three `AXES`
    has no expert axis)."""
    return mesh.shape.get(axis, 1)


def mesh_spec(logical: P, shape: Sequence[int], mesh: Mesh, rules: dict) -> P:
    """One array's PartitionSpec on `mesh`: each dimension split over its logical axis's
    mesh axes, unless they are size 1, already used by an earlier dimension, or do not
    divide it (then it stays whole)."""
    used: set[str] = set()
    out = []
    for name, size in zip(dim_names(logical, len(shape)), shape, strict=True):
        axes = tuple(a for a in rules.get(name, ()) if axis_size(mesh, a) > 1 and a not in used)
        if size % math.prod(mesh.shape[a] for a in axes):
            axes = ()
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*out)


def shardings(specs, abstract, mesh: Mesh, rules: dict):
    """NamedShardings for a tree of arrays (`abstract`: shapes) from its logical specs."""
    return jax.tree.map(lambda s, a: NamedSharding(mesh, mesh_spec(s, a.shape, mesh, rules)),
                        specs, abstract, is_leaf=lambda x: isinstance(x, P))


def init_args(config) -> tuple[tuple, str | None]:
    """Token arrays (abstract; an audio encoder's features) and the method that initialise
    a model of `config`."""
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    if config.is_encoder_decoder:
        audio = config.audio
        src = tokens if audio is None else jax.ShapeDtypeStruct(
            (1, audio.num_mel_bins, audio.num_frames), jnp.float32)
        return (src, tokens), None
    classify = config.architecture == "encoder_only" and config.num_labels
    return (tokens,), ("classify" if classify else None)


def param_shardings(model: nn.Module, mesh: Mesh, rules=DEFAULT_RULES):
    """The NamedShardings of `model`'s params on `mesh` under `rules` (logical axis ->
    mesh axes)."""
    args, method = init_args(model.config)
    boxed = boxed_params(model, *args, method=method)
    return shardings(nn.get_partition_spec(boxed), meta.unbox(boxed), mesh, check_rules(rules))


# (mesh, rules) while `sharded_activations` is active: what `constrain` pins activations to.
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("sharded_activations", default=None)


@contextlib.contextmanager
def sharded_activations(mesh: Mesh, rules: dict):
    """While tracing inside this context, `constrain` pins activations to `mesh` by `rules`
    (`train.sharding` traces its steps in it). Outside it `constrain` does nothing."""
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def constrain(x, *names: str | None):
    """`x` with its sharding pinned by logical names, one per dimension, inside
    `sharded_activations`; unchanged elsewhere (a model used without a mesh).

    The residual stream is pinned to ("batch", None, None): split over data × fsdp and
    whole along D, so FSDP all-gathers each weight before use instead of moving activations.
    """
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh, mesh_spec(P(*names), x.shape, mesh, rules)))
