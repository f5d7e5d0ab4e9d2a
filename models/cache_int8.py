"""An int8 KV cache: each written key (value) vector stored as int8 with one scale.

`KVCache.create(config, B, S, dtype="int8")` (and `PagedKVCache.create(..., dtype="int8")`)
keeps the self-attention keys and values as int8 and, beside each, a scale per written
token per kv head: `k_scale`, `v_scale` [B, K, S, 1] per layer, the layout of `k` and `v`
with H = 1, so every operation on the cache (a write at rows and slots, a gather of rows,
a beam region, a page) treats them as two more cache leaves. A write quantizes, a read
dequantizes, both inside the jitted computation that reads the cache; nothing else
changes, and a float cache ("auto", the config's dtype) is the cache it always was.

The granularity: symmetric absmax over the head dimension H, one scale per (token, kv
head). A cache written one token at a time can compute it as it writes: each token's key
(value) vector of each head is known whole then and never changes, so its scale needs no
later rescaling (a per-channel scale shared by positions, as KIVI uses for keys, needs a
group of tokens first, and would have to grow as tokens arrive). Its error is bounded by
that vector's own largest entry: |x - dequantize(quantize(x))| <= scale / 2 = max|x| / 254
per element. Keys and values vary in size from token to token and head to head (a
model's first tokens often carry much larger ones), so a scale shared over tokens, heads
or layers would be set by the largest of them and round the small ones coarsely or to
zero. Its cost is one scale per H int8 entries: with H = 64 and float32 scales, 68 bytes
a token per kv head, where float32 takes 256 and bfloat16 128 (`bytes_per_token`;
docs/decoding.md, "An int8 KV cache").

Scales are kept in the config's dtype (the dtype a read returns), rounded up, never
down, to it, so that max|x| / scale <= 127 exactly and no entry is clipped:

    x = [0.5, -1.27, 0.02]   scale = 1.27 / 127 = 0.01   q = [50, -127, 2]
    dequantize -> [0.50, -1.27, 0.02]                     (error <= 0.005 each)

Cross-attention keys and values (an encoder-decoder's, projected once per source) stay in
the config's dtype: they are not written token by token.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int8

from models.errors import UserError

# "auto": the config's dtype (the cache as it has always been); "int8": this module's.
KV_CACHE_DTYPES = ("auto", "int8")


def check_kv_cache_dtype(value, name: str = "kv_cache_dtype") -> str:
    """`value` if it is one of `KV_CACHE_DTYPES`, else a UserError naming it and them."""
    if not isinstance(value, str) or value not in KV_CACHE_DTYPES:
        raise UserError(f"{name}={value!r} must be one of {KV_CACHE_DTYPES}")
    return value


def quantize(x: Float[Array, "... H"], scale_dtype) -> tuple[Int8[Array, "... H"],
                                                              Float[Array, "... 1"]]:
    """(int8 values, scales [..., 1] in `scale_dtype`) of `x`, symmetric over its last axis:
    q = round(x / scale) with scale = max|x| / 127 (rounded up to `scale_dtype`), so q lies
    in [-127, 127]. An all-zero vector gets scale 0 and q = 0, which dequantize to 0."""
    x32 = x.astype(jnp.float32)
    scale32 = jnp.max(jnp.abs(x32), axis=-1, keepdims=True) / 127.0
    scale = scale32.astype(scale_dtype)
    scale = jnp.where(scale.astype(jnp.float32) < scale32,          # rounded down: one ulp up
                      jnp.nextafter(scale, jnp.asarray(jnp.inf, scale.dtype)), scale)
    safe = jnp.where(scale > 0, scale.astype(jnp.float32), 1.0)
    q = jnp.clip(jnp.round(x32 / safe), -127, 127).astype(jnp.int8)
    return q, scale


def dequantize(q: Int8[Array, "... H"], scale: Float[Array, "... 1"]) -> Float[Array, "... H"]:
    """q * scale in the scale's dtype (the config's: what attention reads)."""
    return q.astype(scale.dtype) * scale


def round_trip(x: Float[Array, "... H"], scale_dtype) -> Float[Array, "... H"]:
    """`x` as an int8 cache gives it back: dequantize(quantize(x))."""
    return dequantize(*quantize(x, scale_dtype))


def bytes_per_token(config, kv_cache_dtype: str = "auto") -> int:
    """The self-attention cache's bytes per token of one row: keys and values of every
    decoder layer and kv head, with an int8 cache's two scales.

        L 2, K 2, H 64:  float32 2*2*2*64*4 = 2048;  bfloat16 1024;
                         int8 with float32 scales 2*2*2*(64 + 4) = 544
    """
    item = np.dtype(config.dtype).itemsize
    heads, key_width, value_width = config.cache_shape      # latent attention: one "head"
    if check_kv_cache_dtype(kv_cache_dtype) == "auto":
        per_head = (key_width + value_width) * item
    else:
        per_head = key_width + value_width + 2 * item
    return config.decoder_layers * heads * per_head


# ---------------------------------------------------------------------------------------------
# What the caches (`KVCache`, `BeamKVCache`, `PagedKVCache`) share: make, read, round trip.

def layers_dtype(x) -> jnp.dtype:
    """The dtype of a per-layer leaf (a tuple of L arrays, or one stacked array)."""
    return x[0].dtype if isinstance(x, tuple) else x.dtype


def empty_self(config, rows: int, slots: int, dtype: str) -> dict:
    """Zero self-attention leaves of [rows, K, slots, H] per decoder layer (K and the keys'
    and values' H from `config.cache_shape`: a latent-attention cache's values are read
    from its keys, and have H = 0), in the layout of the config's stack, as a cache's
    constructor keywords: with `dtype` "auto" keys and values in the config's dtype; with
    "int8" int8 ones and their scales ([rows, K, slots, 1], in the config's dtype).

    Raises:
        UserError: a dtype not in `KV_CACHE_DTYPES`, or "int8" for latent attention.
    """
    heads, key_width, value_width = config.cache_shape
    k_shape, v_shape = ((rows, heads, slots, width) for width in (key_width, value_width))
    # A linear (Gated DeltaNet) layer keeps no keys: its buffers have no heads, so every
    # operation on the cache's layers passes over them at no cost (its state is in
    # `KVCache.linear`). Linear layers are looped only.
    linear = [kind == "linear" for kind in config.layer_types] if config.has_linear_layers \
        else [False] * config.decoder_layers

    def zeros(shape, dtype):
        if config.scan_layers:
            return jnp.zeros((config.decoder_layers, *shape), dtype)
        return tuple(jnp.zeros((shape[0], 0, *shape[2:]) if none else shape, dtype)
                     for none in linear)
    if check_kv_cache_dtype(dtype, "dtype") == "auto":
        return dict(k=zeros(k_shape, config.dtype), v=zeros(v_shape, config.dtype))
    if config.latent:
        raise UserError("kv_cache_dtype='int8' is not built for latent attention (kv_lora_rank="
                        f"{config.kv_lora_rank}): its cache is already the compressed latent; "
                        "use 'auto'")
    scales = (rows, heads, slots, 1)
    return dict(k=zeros(k_shape, jnp.int8), v=zeros(v_shape, jnp.int8),
                k_scale=zeros(scales, config.dtype), v_scale=zeros(scales, config.dtype))


def read_kv(cache, layer, view):
    """Keys and values of `layer` as `view(leaf, layer)` shows a leaf ([B, S, K, H]),
    dequantized when the cache is int8 (after the view: a paged cache gathers int8 pages,
    then dequantizes them)."""
    k, v = view(cache.k, layer), view(cache.v, layer)
    if cache.k_scale is None:
        return k, v
    return (dequantize(k, view(cache.k_scale, layer)),
            dequantize(v, view(cache.v_scale, layer)))


def as_cached(cache, k_BTKH, v_BTKH):
    """New keys and values as the cache gives them back once written: rounded through int8
    in an int8 cache, unchanged otherwise. A decoding step that attends to its own token
    without writing it first (`read_step`) then sees what a step that writes first sees
    (`step`, the serving engine's prefill), and what every later step will."""
    if cache.k_scale is None:
        return k_BTKH, v_BTKH
    dtype = layers_dtype(cache.k_scale)
    return round_trip(k_BTKH, dtype), round_trip(v_BTKH, dtype)


__all__ = ["KV_CACHE_DTYPES", "as_cached", "bytes_per_token", "check_kv_cache_dtype", "dequantize",
           "empty_self", "quantize", "read_kv", "round_trip"]
