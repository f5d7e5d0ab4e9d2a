"""Attention: one pure function under thin projection modules.

`dot_product_attention` is the only place where attention is computed. Its call sites:
encoder self-attention (padding mask), causal self-attention (causal mask, with or without
a cache) and cross-attention (queries from the decoder, keys/values projected once from the
encoder output). Grouped-query attention is native: N query heads share K key/value heads
in groups of G = N / K, so multi-head (K = N) and multi-query (K = 1) are the same code.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from models.axes import named
from models.cache import KVCache
from models.config import Llama3RopeScaling, TransformerConfig
from models.errors import UserError
from models.numerics import MASKED_LOGIT


def dot_product_attention(
    q_BTNH: Float[Array, "B T N H"],
    k_BSKH: Float[Array, "Bk S K H"],
    v_BSKH: Float[Array, "Bk S K H"],
    mask_BTS: Bool[Array, "B T S"] | None = None,
    *,
    bias_BNTS: Float[Array, "B N T S"] | None = None,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
) -> tuple[Float[Array, "B T N H"], Float[Array, "B N T S"]]:
    """softmax(scale * q k^T + bias, masked) v, with the softmax in float32.

    Args:
        q_BTNH: queries.
        k_BSKH, v_BSKH: keys and values with K heads, N % K == 0. Their batch Bk may divide
            B: then B = Bk * W and the W query rows of one key row (beams sharing one encoded
            source) attend to it without the keys being copied.
        mask_BTS: True where a query may see a key; broadcastable to [B, T, S]; None means
            everything is visible. A query row with no visible key returns zeros, not NaN.
        bias_BNTS: added to the logits before masking (T5's relative position bias);
            broadcastable to [B, N, T, S], float32 preferred; None adds nothing.
        scale: the logits' scale; None means 1 / sqrt(H).
        dropout_rate, dropout_rng: dropout on the probabilities (training only).

    Returns:
        out_BTNH in the dtype of v, and probs_BNTS (float32) for inspection.
    """
    B, T, N, H = q_BTNH.shape
    Bk, S, K, Hk = k_BSKH.shape
    if k_BSKH.shape != v_BSKH.shape:
        raise UserError(f"keys {k_BSKH.shape} and values {v_BSKH.shape} differ in shape")
    if H != Hk or N % K or B % Bk:
        raise UserError(
            f"incompatible attention shapes: q {q_BTNH.shape} [B,T,N,H] vs k {k_BSKH.shape} "
            "[Bk,S,K,H] needs equal H, N divisible by K, B divisible by Bk")
    if mask_BTS is not None:
        if mask_BTS.ndim != 3:
            raise UserError(f"mask must be [B, T, S] (rank 3), got shape {mask_BTS.shape}")
        mask_BTS = jnp.broadcast_to(mask_BTS, (B, T, S))
    W, G = B // Bk, N // K
    scale = H ** -0.5 if scale is None else scale
    # Fold the W query rows that share one key row into its time axis.
    q_BQKGH = q_BTNH.reshape(Bk, W * T, K, G, H)
    if scale != 1.0:
        q_BQKGH = q_BQKGH * jnp.asarray(scale, q_BTNH.dtype)
    logits_BKGQS = jnp.einsum(
        "BQKGH,BSKH->BKGQS", q_BQKGH, k_BSKH, preferred_element_type=jnp.float32)
    if bias_BNTS is not None:
        bias_BWKGTS = jnp.broadcast_to(bias_BNTS, (B, N, T, S)).reshape(Bk, W, K, G, T, S)
        bias_BKGQS = bias_BWKGTS.transpose(0, 2, 3, 1, 4, 5).reshape(Bk, K, G, W * T, S)
        logits_BKGQS = logits_BKGQS + bias_BKGQS.astype(jnp.float32)
    if mask_BTS is not None:
        mask_B11QS = mask_BTS.reshape(Bk, 1, 1, W * T, S)
        logits_BKGQS = jnp.where(mask_B11QS, logits_BKGQS, MASKED_LOGIT)
    probs_BKGQS = jax.nn.softmax(logits_BKGQS, axis=-1)
    if mask_BTS is not None:
        probs_BKGQS = jnp.where(mask_B11QS, probs_BKGQS, 0.0)
    if dropout_rate > 0.0 and dropout_rng is not None:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, probs_BKGQS.shape)
        probs_BKGQS = jnp.where(keep, probs_BKGQS / (1.0 - dropout_rate), 0.0)
    out_BQKGH = jnp.einsum("BKGQS,BSKH->BQKGH", probs_BKGQS.astype(v_BSKH.dtype), v_BSKH)
    out_BTNH = out_BQKGH.reshape(B, T, N, H)
    probs_BNTS = probs_BKGQS.reshape(Bk, K * G, W, T, S).transpose(0, 2, 1, 3, 4)
    return out_BTNH, probs_BNTS.reshape(B, N, T, S)


def rope_frequencies(head_dim: int, theta: float,
                     scaling: Llama3RopeScaling | None = None) -> np.ndarray:
    """float32[H/2] angular frequencies of the rotary pairs: theta ** (-2i / H), optionally
    rescaled as Llama 3.1 does (see `Llama3RopeScaling`).

        wavelength 2 pi / f   > original / low_freq_factor   ->  f / factor
                              < original / high_freq_factor  ->  f
                              in between                     ->  (1 - s) f / factor + s f,
                              s = (original / wavelength - low) / (high - low)
    """
    inv_freq_h = (1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    inv_freq_h = inv_freq_h.astype(np.float32)
    if scaling is None:
        return inv_freq_h
    wavelength = 2 * np.pi / inv_freq_h
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    smooth = (scaling.original_max_len / wavelength - low) / (high - low)
    interpolated = (1 - smooth) * inv_freq_h / scaling.factor + smooth * inv_freq_h
    scaled = np.where(wavelength > scaling.original_max_len / low,
                      inv_freq_h / scaling.factor, inv_freq_h)
    medium = (wavelength >= scaling.original_max_len / high) & (
        wavelength <= scaling.original_max_len / low)
    return np.where(medium, interpolated, scaled).astype(np.float32)


def apply_rope(x_BTNH: Float[Array, "B T N H"], positions_BT: Int[Array, "B T"],
               inv_freq_h: Float[Array, " h"]) -> Float[Array, "B T N H"]:
    """Rotary position embedding (rotate-half form), computed in float32.

    Channel i of the first half and channel i of the second half form a pair rotated by
    angle position * inv_freq_h[i] (see `rope_frequencies`).
    """
    angle_BTh = positions_BT.astype(jnp.float32)[:, :, None] * inv_freq_h[None, None, :]
    sin_BT1h, cos_BT1h = jnp.sin(angle_BTh)[:, :, None, :], jnp.cos(angle_BTh)[:, :, None, :]
    x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos_BT1h - x2 * sin_BT1h, x2 * cos_BT1h + x1 * sin_BT1h], axis=-1)
    return out.astype(x_BTNH.dtype)


def _dense_heads(config: TransformerConfig, heads: int, name: str) -> nn.DenseGeneral:
    """A query, key or value projection [D] -> [heads, H] (heads named "heads" for queries,
    "kv_heads" for keys and values)."""
    axis = "heads" if name == "query" else "kv_heads"
    return nn.DenseGeneral(
        (heads, config.head_dim), use_bias=config.use_bias or config.qkv_bias,
        dtype=config.dtype, param_dtype=config.param_dtype,
        kernel_init=named(nn.initializers.xavier_uniform(), "embed", axis, "head_dim"),
        bias_init=named(nn.initializers.zeros, axis, "head_dim"), name=name)


def _dense_out(config: TransformerConfig) -> nn.DenseGeneral:
    return nn.DenseGeneral(
        config.d_model, axis=(-2, -1), use_bias=config.use_bias, dtype=config.dtype,
        param_dtype=config.param_dtype,
        kernel_init=named(nn.initializers.xavier_uniform(), "heads", "head_dim", "embed"),
        bias_init=named(nn.initializers.zeros, "embed"), name="out")


def _attend(module: nn.Module, config, q, k, v, mask, deterministic, bias=None):
    """The attention core plus dropout rng and the sown weights, shared by both modules."""
    rate = 0.0 if deterministic else config.attention_dropout_rate
    rng = module.make_rng("dropout") if rate > 0.0 else None
    out_BTNH, probs_BNTS = dot_product_attention(
        q, k, v, mask, bias_BNTS=bias, scale=None if config.scale_attention else 1.0,
        dropout_rate=rate, dropout_rng=rng)
    # A no-op unless the caller applies with mutable=["intermediates"].
    module.sow("intermediates", "attention_weights", probs_BNTS)
    return out_BTNH


class SelfAttention(nn.Module):
    """Self-attention projections; bidirectional or causal depending on the mask given.

    With a cache, the new keys/values are written into `cache` for `layer` at `positions`
    and the queries attend over all cache slots (the mask hides unwritten ones). `bias_BNTS`
    (relative positions) is added to the logits.
    """

    config: TransformerConfig

    @nn.compact
    def __call__(
        self,
        x_BTD: Float[Array, "B T D"],
        mask_BTS: Bool[Array, "B T S"] | None,
        positions_BT: Int[Array, "B T"],
        cache: KVCache | None,
        layer,
        deterministic: bool,
        bias_BNTS: Float[Array, "B N T S"] | None = None,
    ) -> tuple[Float[Array, "B T D"], KVCache | None]:
        cfg = self.config
        q_BTNH = _dense_heads(cfg, cfg.num_heads, "query")(x_BTD)
        k_BTKH = _dense_heads(cfg, cfg.num_kv_heads, "key")(x_BTD)
        v_BTKH = _dense_heads(cfg, cfg.num_kv_heads, "value")(x_BTD)
        if cfg.positions == "rope":
            inv_freq_h = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
            q_BTNH = apply_rope(q_BTNH, positions_BT, inv_freq_h)
            k_BTKH = apply_rope(k_BTKH, positions_BT, inv_freq_h)
        if cache is None:
            k_BSKH, v_BSKH = k_BTKH, v_BTKH
        else:
            cache = cache.write(layer, k_BTKH, v_BTKH, positions_BT)
            k_BSKH, v_BSKH = cache.read(layer)
        out_BTNH = _attend(self, cfg, q_BTNH, k_BSKH, v_BSKH, mask_BTS, deterministic,
                           bias_BNTS)
        return _dense_out(cfg)(out_BTNH), cache


class CrossAttention(nn.Module):
    """Cross-attention: queries from the decoder over keys/values projected beforehand
    (once per source, by `CrossKVProjection`)."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x_BTD, k_BSKH, v_BSKH, mask_BTS, deterministic: bool):
        cfg = self.config
        q_BTNH = _dense_heads(cfg, cfg.num_heads, "query")(x_BTD)
        out_BTNH = _attend(self, cfg, q_BTNH, k_BSKH, v_BSKH, mask_BTS, deterministic)
        return _dense_out(cfg)(out_BTNH)


class CrossKVProjection(nn.Module):
    """Keys and values of every decoder layer's cross-attention, from the encoder output.

    The kernels are stacked over the L decoder layers, so all layers' keys/values are one
    einsum, computed once per source and then only read (by the forward pass and by every
    decoding step alike). Output layout [L, B, K, S, H], as in `KVCache`.
    """

    config: TransformerConfig
    num_layers: int

    @nn.compact
    def __call__(self, encoded_BSD: Float[Array, "B S D"]) -> tuple[Array, " Array"]:
        """Returns k_LBKSH, v_LBKSH."""
        cfg = self.config
        shape = (self.num_layers, cfg.d_model, cfg.num_kv_heads, cfg.head_dim)
        # Initialise like L separate [D, K*H] projections (fan_in D, fan_out K*H).
        init = nn.initializers.variance_scaling(
            1.0, "fan_avg", "uniform", in_axis=1, out_axis=(2, 3), batch_axis=(0,))
        out = []
        for name in ("key", "value"):
            kernel_LDKH = self.param(
                f"{name}_kernel", named(init, "layers", "embed", "kv_heads", "head_dim"),
                shape, cfg.param_dtype)
            y_LBKSH = jnp.einsum(
                "BSD,LDKH->LBKSH", encoded_BSD.astype(cfg.dtype),
                kernel_LDKH.astype(cfg.dtype))
            if cfg.use_bias or cfg.qkv_bias:
                bias_LKH = self.param(
                    f"{name}_bias", named(nn.initializers.zeros, "layers", "kv_heads", "head_dim"),
                    shape[:1] + shape[2:], cfg.param_dtype)
                y_LBKSH = y_LBKSH + bias_LKH.astype(cfg.dtype)[:, None, :, None, :]
            out.append(y_LBKSH)
        return out[0], out[1]
