"""Layouts: how a checkpoint's tensors become our parameters and back, as numpy functions.

A `Layout` converts the arrays of one rule (see `mapping.Rule`) in both directions:
`to_ours(theirs, cfg)` and `to_theirs(ours, cfg)`, each a list of arrays to a list of
arrays. They are transposes, reshapes, splits and concatenations: views where numpy allows,
so converting costs no copies and no compilation, and a round trip gives back the same
tensors bit for bit.

Dimensions as in STYLE.md: N query heads, K key/value heads, H head dim, D model width, F
MLP width. Layouts are written for torch's `nn.Linear`, which stores a weight [out, in];
GPT-2's `Conv1D` stores [in, out], its transpose (`conv1d`).

    linear_to_heads("kv").to_ours([w_KHxD], cfg)      -> [kernel_DKH]
    FUSED_QKV.to_ours([w_(N+2K)HxD], cfg)             -> [query_DNH, key_DKH, value_DKH]
    conv1d(FUSED_QKV).to_ours([w_Dx(N+2K)H], cfg)     -> the same three kernels
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from models.config import TransformerConfig

Convert = Callable[[list, TransformerConfig], list]


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the tensors of a rule relate: `to_ours(theirs, cfg)` and `to_theirs(ours, cfg)`,
    each mapping a list of arrays to a list of arrays."""

    to_ours: Convert
    to_theirs: Convert


def one(to_ours, to_theirs) -> Layout:
    """A layout of one tensor to one parameter, from two functions of (array, cfg)."""
    return Layout(lambda xs, cfg: [to_ours(xs[0], cfg)], lambda xs, cfg: [to_theirs(xs[0], cfg)])


SAME = one(lambda x, cfg: x, lambda x, cfg: x)
TRANSPOSE = one(lambda x, cfg: x.T, lambda x, cfg: x.T)          # Linear [out, in] <-> [in, out]


def conv1d(layout: Layout) -> Layout:
    """`layout` for weights stored transposed, as GPT-2's `Conv1D` stores them ([in, out]
    where `nn.Linear` has [out, in])."""
    return Layout(lambda xs, cfg: layout.to_ours([x.T for x in xs], cfg),
                  lambda xs, cfg: [x.T for x in layout.to_theirs(xs, cfg)])


def _heads(cfg: TransformerConfig, which: str) -> int:
    return cfg.num_heads if which == "q" else cfg.num_kv_heads


def linear_to_heads(which: str) -> Layout:
    """A q/k/v `nn.Linear` [heads*H, D] <-> a DenseGeneral kernel [D, heads, H]; `which` is
    "q" (N heads) or "kv" (K heads)."""
    return one(
        lambda w, cfg: w.T.reshape(w.shape[1], _heads(cfg, which), cfg.head_dim),
        lambda k, cfg: k.reshape(k.shape[0], -1).T)


def bias_to_heads(which: str) -> Layout:
    """A q/k/v bias [heads*H] <-> [heads, H]."""
    return one(lambda b, cfg: b.reshape(_heads(cfg, which), cfg.head_dim),
               lambda b, cfg: b.reshape(-1))


LINEAR_FROM_HEADS = one(                  # the output `nn.Linear` [D, N*H] <-> [N, H, D]
    lambda w, cfg: w.T.reshape(cfg.num_heads, cfg.head_dim, w.shape[0]),
    lambda k, cfg: k.reshape(-1, k.shape[-1]).T)


def _qkv_split(x, cfg: TransformerConfig) -> list:
    """x [(N+2K)*H, ...] -> q [N*H, ...], k [K*H, ...], v [K*H, ...] (views)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return list(np.split(x, [q, q + kv], axis=0))


FUSED_QKV = Layout(                       # q, k, v rows of one `nn.Linear` <-> three kernels
    lambda xs, cfg: [w.T.reshape(w.shape[1], _heads(cfg, which), cfg.head_dim)
                     for w, which in zip(_qkv_split(xs[0], cfg), ("q", "kv", "kv"), strict=True)],
    lambda ks, cfg: [np.concatenate([k.reshape(k.shape[0], -1).T for k in ks], axis=0)])
FUSED_QKV_BIAS = Layout(                  # its bias [(N+2K)*H] <-> q [N, H], k and v [K, H]
    lambda xs, cfg: [b.reshape(_heads(cfg, which), cfg.head_dim)
                     for b, which in zip(_qkv_split(xs[0], cfg), ("q", "kv", "kv"), strict=True)],
    lambda bs, cfg: [np.concatenate([b.reshape(-1) for b in bs])])
FUSED_GATE_UP = Layout(                   # gate then up rows of one `nn.Linear` [2F, D]
    lambda xs, cfg: [w.T for w in np.split(xs[0], 2, axis=0)],        # <-> two [D, F]
    lambda ks, cfg: [np.concatenate([k.T for k in ks], axis=0)])
FUSED_GATE_UP_BIAS = Layout(              # its bias [2F] <-> two [F]
    lambda xs, cfg: list(np.split(xs[0], 2)),
    lambda bs, cfg: [np.concatenate(bs)])
