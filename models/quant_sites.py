"""`quantize`: a params tree's projection kernels as `models.quant.Quantized` leaves.

Which kernels are projections comes from the model itself: an abstract `init` (nothing is
allocated) records every `Projection`, cross-attention `CrossKVProjection` and `MoeMLP` it
calls, with each kernel's input and output axes, so every family and every layout (looped or
scanned layers) is covered by the same rule and nothing else is touched.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
from flax.core import meta

from models import axes
from models.config import TransformerConfig
from models.errors import UserError
from models.quant import (
    DEFAULT_GROUP,
    Quantized,
    check_group,
    check_scheme,
    is_quantized,
    quantize_kernel,
)


@dataclasses.dataclass(frozen=True)
class Site:
    """One quantizable kernel: its path in the params tree and its input/output axes."""

    path: tuple[str, ...]
    n_in: int
    n_out: int
    transposed: bool = False      # a [V, D] table, stored as the [D, V] head that reads it


def sites(config: TransformerConfig, *, embeddings: bool = False) -> list[Site]:
    """Every projection kernel of a model of `config`, in the order `init` meets them;
    with `embeddings`, the token tables and the untied output head too."""
    from models.attention import CrossKVProjection
    from models.moe import MoeMLP
    from models.projection import Projection
    from models.quant import Dense, Embed
    from models.transformer import build

    found: dict[tuple[str, ...], Site] = {}

    def record(next_fun, args, kwargs, context):
        module = context.module
        if context.method_name == "__call__":
            where = tuple(module.path)
            if isinstance(module, Projection):
                features = module.features
                n_out = 1 if isinstance(features, int) else len(features)
                found[(*where, "kernel")] = Site((*where, "kernel"), len(module.in_axes), n_out)
            elif isinstance(module, CrossKVProjection):
                for name in ("key_kernel", "value_kernel"):
                    found[(*where, name)] = Site((*where, name), 1, 2)
            elif isinstance(module, MoeMLP):
                for name in ("gate_kernel", "up_kernel", "down_kernel"):
                    found[(*where, name)] = Site((*where, name), 1, 1)
            elif embeddings and isinstance(module, Dense):
                found[(*where, "kernel")] = Site((*where, "kernel"), 1, 1)
        if embeddings and isinstance(module, Embed) and context.method_name in (
                "__call__", "attend"):          # [V, D] -> [D, V]: a scale per token
            found[(*module.path, "embedding")] = Site((*module.path, "embedding"), 1, 1,
                                                      transposed=True)
        return next_fun(*args, **kwargs)

    model = build(config.replace(lora=None))
    args, method = axes.init_args(config)
    with nn.intercept_methods(record):
        axes.boxed_params(model, *args, method=method)
    return list(found.values())


def quantize(target, config_or_scheme=None, scheme: str | None = None, *,
             group: int = DEFAULT_GROUP, embeddings: bool = False):
    """A params tree (or a `models.Pretrained`) with every attention, MLP and expert
    projection kernel quantized (`models.quant`); everything else as it was.

        params = models.quantize(params, config, "int8")
        pre = models.quantize(pre, "int4", group=64)

    Args:
        target: a params tree of a model of `config`, or a `Pretrained` (its config used).
        config_or_scheme: the model's config (for a params tree); for a Pretrained, the
            scheme.
        scheme: "int8" (per output channel), "w8a8" (int8's weights, activations
            quantized per token as they arrive, integer products) or "int4" (per output
            channel and `group` inputs).
        group: int4's group size; it must divide every projection's input width.
        embeddings: quantize the token embedding tables (one scale per token; int4 per
            token and group) and an untied output head as well.

    Raises:
        UserError: an unknown scheme; a tree already quantized; a group that does not
            divide a kernel's inputs (naming the kernel); a tree that lacks a kernel the
            model has.
    """
    if dataclasses.is_dataclass(target) and hasattr(target, "params"):   # a Pretrained
        # (known by its fields: models.pretrained imports this module to quantize as it loads)
        if scheme is not None:
            raise UserError("quantize(pretrained, scheme): the config comes from the "
                            "Pretrained, so give the scheme alone")
        scheme = config_or_scheme
        return dataclasses.replace(target, params=quantize_params(
            target.params, target.config, scheme, group=group, embeddings=embeddings))
    if not isinstance(config_or_scheme, TransformerConfig):
        raise UserError("quantize(params, config, scheme): a params tree needs its model's "
                        f"config, got {type(config_or_scheme).__name__}")
    return quantize_params(target, config_or_scheme, scheme, group=group,
                           embeddings=embeddings)


def quantize_params(params, config: TransformerConfig, scheme: str, *,
                    group: int = DEFAULT_GROUP, embeddings: bool = False):
    check_scheme(scheme)
    if is_quantized(params):
        raise UserError("these params are already quantized: quantize the float tree")
    params = meta.unbox(params)
    out = jax.tree_util.tree_map(lambda x: x, dict(params))       # a copy of the nesting
    for site in sites(config, embeddings=embeddings):
        parent = out
        for key in site.path[:-1]:
            if key not in parent:
                raise UserError(f"the params have no {'/'.join(site.path)}, which a model "
                                "of this config has: are they this config's?")
            parent[key] = dict(parent[key])
            parent = parent[key]
        name = site.path[-1]
        if name not in parent:
            raise UserError(f"the params have no {'/'.join(site.path)}, which a model of "
                            "this config has: are they this config's?")
        kernel = parent[name].T if site.transposed else parent[name]
        n_lead = kernel.ndim - site.n_in - site.n_out
        parent[name] = _quantize_jit(kernel, scheme, n_lead, site.n_in, group,
                                     "/".join(site.path))
    return out


def _quantize_jit(kernel, scheme, n_lead, n_in, group, name) -> Quantized:
    if scheme == "int4":         # checked here, outside the jit, so the error names it
        check_group(group, math.prod(kernel.shape[n_lead:n_lead + n_in]), name)
    return _quantize_one(kernel, scheme=scheme, n_lead=n_lead, n_in=n_in, group=group)


@functools.partial(jax.jit, static_argnames=("scheme", "n_lead", "n_in", "group"))
def _quantize_one(kernel, *, scheme, n_lead, n_in, group):
    return quantize_kernel(kernel, scheme, n_lead=n_lead, n_in=n_in, group=group)
