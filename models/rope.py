"""Rotary position embedding: the frequencies of every scaling, and the rotation.

`rope_frequencies(dim, theta, scaling)` is float32[dim/2], computed in numpy as
transformers computes its `inv_freq` (float32 powers of the base); `rope_tables(cfg,
positions_BT)` gives a layer the frequencies of one call (LongRoPE's depend on the
sequence length, per row) and the factor on cos/sin; `apply_rope` rotates the first
2 * h channels of each head in the rotate-half form and passes the rest (partial rotary).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from models.config import Llama3RopeScaling, TransformerConfig
from models.rope_scaling import (
    DynamicRopeScaling,
    LinearRopeScaling,
    LongRopeScaling,
    YarnRopeScaling,
)


def _exponents(dim: int) -> np.ndarray:
    return np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)


def _default(dim: int, theta: float) -> np.ndarray:
    return (1.0 / np.float32(theta) ** _exponents(dim)).astype(np.float32)


def rope_frequencies(head_dim: int, theta: float, scaling=None, *,
                     long: bool = False) -> np.ndarray:
    """float32[dim/2] angular frequencies of the rotary pairs of `head_dim` rotated
    channels: theta ** (-2i / dim), then scaled.

        Llama 3    wavelength 2 pi / f  > original / low_freq_factor   ->  f / factor
                                        < original / high_freq_factor  ->  f
                                        in between: (1 - s) f / factor + s f,
                                        s = (original / wavelength - low) / (high - low)
        linear     f / factor
        dynamic    f (the scaling starts past original_max_len, which no config reaches)
        yarn       f_interp (1 - e) + f e, e = 1 - ramp(i; low, high) over the correction
                   dims of beta_fast and beta_slow rotations in original_max_len
        longrope   f / short_factor[i], or f / long_factor[i] with `long`
    """
    inv_freq_h = _default(head_dim, theta)
    if scaling is None or isinstance(scaling, DynamicRopeScaling):
        return inv_freq_h
    if isinstance(scaling, LinearRopeScaling):
        return (inv_freq_h / np.float32(scaling.factor)).astype(np.float32)
    if isinstance(scaling, Llama3RopeScaling):
        return _llama3(inv_freq_h, scaling)
    if isinstance(scaling, YarnRopeScaling):
        return _yarn(head_dim, theta, scaling)
    if isinstance(scaling, LongRopeScaling):
        factors = np.asarray(scaling.long_factor if long else scaling.short_factor, np.float32)
        return (1.0 / (factors * np.float32(theta) ** _exponents(head_dim))).astype(np.float32)
    raise TypeError(f"unknown RoPE scaling {scaling!r}")


def _llama3(inv_freq_h: np.ndarray, scaling: Llama3RopeScaling) -> np.ndarray:
    wavelength = 2 * np.pi / inv_freq_h
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    with np.errstate(divide="ignore", invalid="ignore"):  # high == low: no band (Llama 4)
        smooth = (scaling.original_max_len / wavelength - low) / (high - low)
        interpolated = (1 - smooth) * inv_freq_h / scaling.factor + smooth * inv_freq_h
    scaled = np.where(wavelength > scaling.original_max_len / low,
                      inv_freq_h / scaling.factor, inv_freq_h)
    medium = (wavelength >= scaling.original_max_len / high) & (
        wavelength <= scaling.original_max_len / low)
    return np.where(medium, interpolated, scaled).astype(np.float32)


def _yarn(dim: int, theta: float, s: YarnRopeScaling) -> np.ndarray:
    def correction_dim(rotations):
        return (dim * math.log(s.original_max_len / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001                                  # as transformers: no zero width
    ramp_h = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation_h = (1 - ramp_h).astype(np.float32)
    powers = np.float32(theta) ** _exponents(dim)
    extrapolated, interpolated = 1.0 / powers, 1.0 / (np.float32(s.factor) * powers)
    return (interpolated * (1 - extrapolation_h)
            + extrapolated * extrapolation_h).astype(np.float32)


def attention_factor(scaling) -> float:
    """The factor on cos and sin (YaRN's and LongRoPE's; 1 for the others)."""
    return scaling.scale() if isinstance(scaling, (YarnRopeScaling, LongRopeScaling)) else 1.0


def rope_tables(cfg: TransformerConfig, positions_BT: Int[Array, "B T"]):
    """(inv_freq, factor) for one call of a layer: float32[h] or, with LongRoPE,
    float32[B, h] (row b's long factors when its largest position + 1 exceeds
    original_max_len; see `LongRopeScaling`), and the factor on cos/sin."""
    s, dim = cfg.rope_scaling, cfg.rope_dim
    scale = attention_factor(s)
    if not isinstance(s, LongRopeScaling):
        return jnp.asarray(rope_frequencies(dim, cfg.rope_theta, s)), scale
    short_h = rope_frequencies(dim, cfg.rope_theta, s)
    long_h = rope_frequencies(dim, cfg.rope_theta, s, long=True)
    long_B = jnp.max(positions_BT, axis=1) + 1 > s.original_max_len
    return jnp.where(long_B[:, None], long_h[None, :], short_h[None, :]), scale


def apply_rope(x_BTNH: Float[Array, "B T N H"], positions_BT: Int[Array, "B T"],
               inv_freq_h: Float[Array, " h"], scale: float = 1.0, *,
               interleaved: bool = False) -> Float[Array, "B T N H"]:
    """Rotary position embedding (rotate-half form over the first 2h channels), computed
    in float32; `inv_freq_h` is [h] or per row [B, h], and cos/sin are multiplied by
    `scale`.

    Channel i and channel h + i form a pair rotated by angle position * inv_freq_h[i];
    channels from 2h on pass unchanged (partial rotary: h < H/2). `interleaved`: channels
    2i and 2i + 1 form pair i instead (the complex-number layout of Meta's Llama 4 and
    DeepSeek checkpoints).
    """
    inv_freq = jnp.asarray(inv_freq_h, jnp.float32)
    inv_freq_Bh = inv_freq[None, :] if inv_freq.ndim == 1 else inv_freq
    angle_BTh = positions_BT.astype(jnp.float32)[:, :, None] * inv_freq_Bh[:, None, :]
    sin_BT1h = (jnp.sin(angle_BTh) * scale)[:, :, None, :]
    cos_BT1h = (jnp.cos(angle_BTh) * scale)[:, :, None, :]
    h = inv_freq.shape[-1]
    x = x_BTNH.astype(jnp.float32)
    rest = x[..., 2 * h:]
    if interleaved:
        pairs = x[..., :2 * h].reshape(*x.shape[:-1], h, 2)
        x1, x2 = pairs[..., 0], pairs[..., 1]
        rotated = jnp.stack([x1 * cos_BT1h - x2 * sin_BT1h, x2 * cos_BT1h + x1 * sin_BT1h],
                            axis=-1).reshape(*x.shape[:-1], 2 * h)
        out = jnp.concatenate([rotated, rest], axis=-1)
    else:
        x1, x2 = x[..., :h], x[..., h:2 * h]
        out = jnp.concatenate([x1 * cos_BT1h - x2 * sin_BT1h, x2 * cos_BT1h + x1 * sin_BT1h,
                               rest], axis=-1)
    return out.astype(x_BTNH.dtype)
