"""Multi-head latent attention (DeepSeek-V2/V3): keys and values from one compressed latent.

Each token's keys and values of all N heads come from a latent c [r] (`kv_lora_rank`)
and one rotated key part k_rope [d_r] (`qk_rope_head_dim`) that every head shares:

    kv_a(x) = [c', k']    c = norm(c')    k_rope = rope(k')
    key of head n   = [c W_uk[n], k_rope]         (W_uk [r, N, d_n]: "kv_b"'s first d_n)
    value of head n = c W_uv[n]                   (W_uv [r, N, d_v]: its last d_v)
    query of head n = [q_nope[n], rope(q_rope[n])]    from x, or from norm(x q_a) q_b

so the cache holds [c, k_rope] per token and layer (`kv_lora_rank + qk_rope_head_dim`
numbers, one "head", in the key leaf; the value leaf is empty: `config.cache_shape`).
The forward pass (training, a prefill) expands the latent to every head's keys and values
and attends as usual (head widths d_n + d_r and d_v). A decoding step attends over the
latent itself, absorbing W_uk into the queries and W_uv after the attention:

    q_n . k_n(s) = (q_nope[n] W_uk[n]^T) . c(s) + q_rope[n] . k_rope(s)
    sum_s p(s) v_n(s) = (sum_s p(s) c(s)) W_uv[n]

one attention of N query heads over one key head of width r + d_r whose values are the
key's first r numbers: the step reads r + d_r numbers per cached token instead of
N (2 d_n + d_r + d_v) numbers. Both give the same numbers (to float rounding). The
logits' scale is `head_dim` (= d_n + d_r)^-1/2 in both (`query_pre_attn_scalar`
carries YaRN's mscale, as the checkpoint's loader sets it).

Parameters (under "self_attention"): "query" [D, N, d_n + d_r], or "query_a" [D, r_q]
(`q_lora_rank`), "query_a_norm" [r_q] and "query_b" [r_q, N, d_n + d_r]; "kv_a" [D,
r + d_r]; "kv_a_norm" [r]; "kv_b_kernel" [r, N, d_n + d_v]; "out" [N, d_v, D].
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from models.attention import _attend, _attend_new, layer_kind
from models.axes import named, stacked_projection_init
from models.cache import KVCache
from models.config import TransformerConfig
from models.layers import make_norm
from models.masks import MaskSpec
from models.projection import Projection
from models.quant import Quantized, param_or_stored
from models.rope import apply_rope


def _projection(cfg: TransformerConfig, features, name: str, in_axes, out_axes,
                bias: bool) -> Projection:
    return Projection.make(cfg, features, name, in_axes=in_axes, out_axes=out_axes, bias=bias)


class LatentSelfAttention(nn.Module):
    """Causal self-attention through a compressed latent (see the module docstring); the
    call and its results are `models.attention.SelfAttention`'s: with `read_only` (a
    decoding step) the new token's cache entry comes back as (latent [B, T, 1, r + d_r],
    an empty value [B, T, 1, 0]) for the caller to commit."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x_BTD: Float[Array, "B T D"], *, spec: MaskSpec,
                 positions_BT: Int[Array, "B T"], cache: KVCache | None, layer,
                 deterministic: bool, bias=None, read_only: bool = False, kind=None):
        cfg, det = self.config, deterministic
        n, r, d_r = cfg.num_heads, cfg.kv_lora_rank, cfg.rope_dim
        d_n = cfg.head_dim - d_r
        spec, rope = layer_kind(cfg, spec, kind, positions_BT)
        heads = (n, cfg.head_dim)
        if cfg.q_lora_rank is None:
            q_BTNH = _projection(cfg, heads, "query", ("embed",), ("heads", "head_dim"),
                                 False)(x_BTD, det)
        else:
            c_q = _projection(cfg, cfg.q_lora_rank, "query_a", ("embed",), ("latent",),
                              cfg.use_bias)(x_BTD, det)
            c_q = make_norm(cfg, "query_a_norm", axis="latent")(c_q)
            q_BTNH = _projection(cfg, heads, "query_b", ("latent",), ("heads", "head_dim"),
                                 False)(c_q, det)
        kv_a = _projection(cfg, r + d_r, "kv_a", ("embed",), ("latent",),
                           cfg.use_bias)(x_BTD, det)
        c_BTr = make_norm(cfg, "kv_a_norm", axis="latent")(kv_a[..., :r])
        q_nope, q_rope = q_BTNH[..., :d_n], q_BTNH[..., d_n:]
        k_rope = kv_a[..., None, r:]                                        # [B, T, 1, d_r]
        q_rope = apply_rope(q_rope, positions_BT, *rope, interleaved=cfg.rope_interleaved)
        k_rope = apply_rope(k_rope, positions_BT, *rope, interleaved=cfg.rope_interleaved)
        latent_BT1L = jnp.concatenate([c_BTr[:, :, None, :].astype(k_rope.dtype), k_rope],
                                      axis=-1)
        empty_BT10 = latent_BT1L[..., :0]
        kv_b = param_or_stored(
            self, "kv_b_kernel",
            named(stacked_projection_init(0, (1, 2), ()), "latent", "heads", "head_dim"),
            (r, n, d_n + cfg.value_dim), cfg.param_dtype)
        if isinstance(kv_b, Quantized):
            kv_b = kv_b.dequantize(cfg.dtype or jnp.float32)
        kv_b = kv_b.astype(cfg.dtype)
        w_uk, w_uv = kv_b[..., :d_n], kv_b[..., d_n:]
        out_proj = _projection(cfg, cfg.d_model, "out", ("heads", "head_dim"), ("embed",),
                               cfg.use_bias)
        if read_only:                       # attend over the latent: W_uk, W_uv absorbed
            q_lat = jnp.einsum("BTNh,rNh->BTNr", q_nope, w_uk)
            q_BTNL = jnp.concatenate([q_lat, q_rope.astype(q_lat.dtype)], axis=-1)
            cached, _ = cache.read(layer)
            own, _ = cache.as_cached(latent_BT1L, empty_BT10)
            o_BTNr = _attend_new(self, q_BTNL, (cached, cached[..., :r]), (own, own[..., :r]),
                                 positions_BT=positions_BT, spec=spec, bias=None)
            out_BTNV = jnp.einsum("BTNr,rNv->BTNv", o_BTNr, w_uv)
            return out_proj(out_BTNV, det), (latent_BT1L, empty_BT10)
        if cache is None:
            latent_BS1L = latent_BT1L
        else:
            cache = cache.write(layer, latent_BT1L, empty_BT10, positions_BT)
            latent_BS1L, _ = cache.read(layer)
        kv_BSNX = jnp.einsum("BSr,rNx->BSNx", latent_BS1L[:, :, 0, :r], kv_b)
        k_rope_BS1 = latent_BS1L[..., r:]
        k_BSNH = jnp.concatenate(
            [kv_BSNX[..., :d_n],
             jnp.broadcast_to(k_rope_BS1, (*kv_BSNX.shape[:3], d_r)).astype(kv_BSNX.dtype)],
            axis=-1)
        q_BTNH = jnp.concatenate([q_nope, q_rope.astype(q_nope.dtype)], axis=-1)
        out_BTNV = _attend(self, q_BTNH, k_BSNH, kv_BSNX[..., d_n:], spec,
                           deterministic=deterministic)
        return out_proj(out_BTNV, det), cache
