"""Attention implementations behind one call, chosen per call by `TransformerConfig.attention_impl`.

    out_BTNH, probs_BNTS = attend(q_BTNH, k_BSKH, v_BSKH, spec, bias, impl="auto", scale=s)

Every implementation reads the same descriptions: which keys each query sees
(`models.masks.MaskSpec`) and an optional bias (`models.relative.RelativeBias`). None is
handed a materialised [T, S] mask it did not ask for.

    xla      the materialised core (`kernels.xla`): [B, N, T, S] logits and probabilities;
             the only one that returns the probabilities.
    chunked  exact attention over key blocks with an online softmax (`kernels.chunked`),
             in pure JAX on any backend; no [T, S] array in the forward or backward pass.
    cudnn    cuDNN's fused kernel on a GPU (`kernels.cudnn`), where the mask is one it
             expresses; anything else is refused by name.
    auto     the fastest exact choice for the backend, the shapes and the mask: xla when
             the probabilities are asked for or the attention is small (a decoding step,
             short sequences), cudnn on a GPU where it applies (and no log-sum-exp is
             asked for: a cached step's merge, attention sinks), chunked for long ones.

What an implementation cannot compute is refused (`UserError` naming it), never changed.
"""

from __future__ import annotations

import jax.numpy as jnp

from models.errors import UserError
from models.kernels import cudnn
from models.kernels.chunked import chunked_attention
from models.kernels.xla import dot_product_attention, xla_attention
from models.masks import MaskSpec

IMPLEMENTATIONS = ("auto", "xla", "chunked", "cudnn")
# `auto` picks `chunked` over `xla` from this many query-key pairs per row and head
# (`python -m bench.memory` on 2 CPU cores, the gradient step: chunked / xla time 1.0 at
# T 512, 0.91 at 1024, 0.67 at 2048; below 1024 x 1024 the two are alike, and the
# materialised core is the one that returns probabilities).
CHUNKED_FROM = 1024 * 1024


def choose(impl: str, q_BTNH, k_BSKH, spec: MaskSpec, bias=None, *, dropout_rate: float = 0.0,
           with_probs: bool = False, with_lse: bool = False, softcap: float | None = None
           ) -> str:
    """The implementation `attend` runs for `impl` ("auto" resolved).

    Raises:
        UserError: an explicit implementation that cannot compute this attention, naming
            why (chunked and cudnn cannot return probabilities; cudnn's limits).
    """
    if impl not in IMPLEMENTATIONS:
        raise UserError(f"attention_impl={impl!r} must be one of {IMPLEMENTATIONS}")
    T, S = q_BTNH.shape[1], k_BSKH.shape[1]
    if impl == "auto":
        if with_probs:
            return "xla"
        if not with_lse and cudnn.unsupported(q_BTNH, k_BSKH, spec, bias, dropout_rate=dropout_rate,
                                softcap=softcap) is None:
            return "cudnn"
        return "chunked" if T > 1 and T * S >= CHUNKED_FROM else "xla"
    if with_probs and impl != "xla":
        raise UserError(f"attention_impl={impl!r} does not compute the attention "
                        "probabilities that were asked for (mutable 'intermediates'); only "
                        "'xla' does")
    if impl == "cudnn":
        why = cudnn.unsupported(q_BTNH, k_BSKH, spec, bias, dropout_rate=dropout_rate,
                                softcap=softcap)
        if why is not None:
            raise UserError(f"attention_impl='cudnn' cannot compute this attention: {why}; "
                            "use 'chunked' or 'xla'")
    return impl


def attend(q_BTNH, k_BSKH, v_BSKH, spec: MaskSpec, bias=None, *, impl: str = "auto",
           scale: float, dropout_rate: float = 0.0, dropout_rng=None,
           with_probs: bool = False, with_lse: bool = False, block: int = 512,
           softcap: float | None = None):
    """Attention by the implementation `choose` picks: (out_BTNH in v's dtype,
    probs_BNTS float32 from `xla` when `with_probs`, else None, and with `with_lse` the
    log-sum-exp of each query's visible logits lse_BTN, else None; see `merge`). Shapes as
    `dot_product_attention`; `block` is chunked attention's query and key block size;
    `softcap` None, or c: the scaled logits become c * tanh(logits / c) before bias and mask
    (cudnn refuses it)."""
    if impl == "cudnn" and v_BSKH.shape[-1] != k_BSKH.shape[-1]:
        raise UserError(f"attention_impl='cudnn' cannot compute this attention: its values "
                        f"are as wide as its keys, not {v_BSKH.shape[-1]} against "
                        f"{k_BSKH.shape[-1]} (latent attention); use 'chunked' or 'xla'")
    chosen = choose(impl, q_BTNH, k_BSKH, spec, bias, dropout_rate=dropout_rate,
                    with_probs=with_probs, with_lse=with_lse, softcap=softcap)
    if chosen == "xla":
        out, probs, *lse = xla_attention(q_BTNH, k_BSKH, v_BSKH, spec, bias, scale=scale,
                                         dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                                         with_lse=with_lse, softcap=softcap)
        return out, probs if with_probs else None, lse[0] if with_lse else None
    if chosen == "chunked":
        out = chunked_attention(q_BTNH, k_BSKH, v_BSKH, spec, bias, scale=scale,
                                dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                                q_block=block, k_block=block, with_lse=with_lse,
                                softcap=softcap)
        return (out[0], None, out[1]) if with_lse else (out, None, None)
    if with_lse:
        raise UserError("attention_impl='cudnn' cannot merge a decoding step's cache with "
                        "its new tokens (it returns no log-sum-exp here); use 'auto'")
    return cudnn.cudnn_attention(q_BTNH, k_BSKH, v_BSKH, spec, scale=scale), None, None


def merge(*parts):
    """One attention over the union of several key sets, from the attention over each:
    parts of (out_BTNH, lse_BTN) combine as softmax over all their keys would.

        out = sum_i out_i exp(lse_i - lse),   lse = log sum_i exp(lse_i)

    A part whose query sees none of its keys (lse -inf) weighs 0."""
    lse_BTN = parts[0][1]
    for _, other in parts[1:]:
        lse_BTN = jnp.logaddexp(lse_BTN, other)
    out = sum(out_i.astype(jnp.float32) * jnp.exp(lse_i - lse_BTN)[..., None]
              for out_i, lse_i in parts)
    return out.astype(parts[0][0].dtype), lse_BTN


__all__ = ["CHUNKED_FROM", "IMPLEMENTATIONS", "attend", "choose", "chunked_attention",
           "dot_product_attention", "merge", "xla_attention"]
