"""Attention: thin projection modules over one attention call (`models.kernels.attend`).

Its call sites: encoder self-attention (padding), causal self-attention (with or without
a cache) and cross-attention (queries from the decoder, keys/values projected once from the
encoder output). Each passes a description of what each query sees (`MaskSpec`) and, for
T5, of its relative bias; the config's `attention_impl` picks the implementation that
computes it (`xla`, the materialised `dot_product_attention`; `chunked`; `cudnn`).
Grouped-query attention is native: N query heads share K key/value heads in groups of
G = N / K, so multi-head (K = N) and multi-query (K = 1) are the same code. The attention
output is named "attention_out" for remat policies (`jax.ad_checkpoint.checkpoint_name`).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int

from models.axes import LORA_STACKED_A_INIT, ZEROS, named, stacked_projection_init
from models.cache import KVCache
from models.config import TransformerConfig
from models.kernels import attend, dot_product_attention, merge
from models.layers import make_norm
from models.masks import MaskSpec
from models.projection import Projection, adapted
from models.quant import Quantized, param_or_stored
from models.relative import RelativeBias
from models.rope import apply_rope, rope_frequencies, rope_tables

__all__ = ["CrossAttention", "CrossKVProjection", "SelfAttention", "apply_rope",
           "dot_product_attention", "fuse_qkv", "rope_frequencies"]


def _dense_heads(config: TransformerConfig, heads: int, name: str,
                 width: int | None = None) -> Projection:
    """A query, key or value projection [D] -> [heads, width] (width H by default; heads
    named "heads" for queries, "kv_heads" for keys and values)."""
    axis = "heads" if name == "query" else "kv_heads"
    return Projection.make(config, (heads, width or config.head_dim), name, in_axes=("embed",),
                           out_axes=(axis, "head_dim"),
                           bias=config.use_bias or config.qkv_bias)


def _queries_and_gate(config: TransformerConfig, x_BTD, deterministic: bool):
    """The queries [B, T, N, H] and, with `attention_output_gate`, the gate [B, T, N, H]:
    one projection [D] -> [N, 2H] whose first H channels of each head are its query and
    the last H its gate (None without the gate)."""
    if not config.attention_output_gate:
        return _dense_heads(config, config.num_heads, "query")(x_BTD, deterministic), None
    both_BTN2H = _dense_heads(config, config.num_heads, "query", 2 * config.head_dim)(
        x_BTD, deterministic)
    return both_BTN2H[..., :config.head_dim], both_BTN2H[..., config.head_dim:]


def _gated(out_BTNH, gate_BTNH):
    """The attention output times sigmoid(gate) (`attention_output_gate`), or as it is."""
    if gate_BTNH is None:
        return out_BTNH
    return out_BTNH * jax.nn.sigmoid(gate_BTNH.astype(out_BTNH.dtype))


def _dense_out(config: TransformerConfig) -> Projection:
    return Projection.make(config, config.d_model, "out", in_axes=("heads", "head_dim"),
                           out_axes=("embed",), bias=config.use_bias)


def _sinks(module: nn.Module):
    """The self-attention's learned sink logits [N] (`config.attention_sinks`), or None."""
    cfg = module.config
    if not cfg.attention_sinks:
        return None
    return module.param("sinks", named(ZEROS, "heads"), (cfg.num_heads,), cfg.param_dtype)


def _with_sinks(sinks_N, out_BTNH, probs_BNTS, lse_BTN):
    """The attention with each head's sink logit in its softmax, from the attention without
    it: the sink takes exp(sink) / (exp(sink) + sum exp(logits)) of the weight and gives a
    value of zero, so every key's weight, and the output, scale by sigmoid(lse - sink)
    (0 for a query that sees no key)."""
    keep_BTN = jax.nn.sigmoid(lse_BTN - sinks_N.astype(jnp.float32)[None, None, :])
    out_BTNH = (out_BTNH.astype(jnp.float32) * keep_BTN[..., None]).astype(out_BTNH.dtype)
    if probs_BNTS is not None:
        probs_BNTS = probs_BNTS * keep_BTN.transpose(0, 2, 1)[..., None]
    return out_BTNH, probs_BNTS


def _attend(module: nn.Module, q, k, v, spec: MaskSpec, *, bias=None, deterministic: bool,
            sinks=None):
    """The attention core by the config's implementation, with the dropout rng and the
    sown weights, shared by both modules (`sinks`: the self-attention's, or None). The
    probabilities exist (and are sown) only when the caller applies with
    mutable=["intermediates"]: `auto` then runs `xla`."""
    cfg = module.config
    rate = 0.0 if deterministic else cfg.attention_dropout_rate
    rng = module.make_rng("dropout") if rate > 0.0 else None
    with_probs = module.is_mutable_collection("intermediates")
    out_BTNH, probs_BNTS, lse_BTN = attend(
        q, k, v, spec, bias, impl=cfg.attention_impl, scale=_scale(cfg, q),
        dropout_rate=rate, dropout_rng=rng, with_probs=with_probs, block=cfg.attention_block,
        softcap=cfg.attn_logit_softcapping, with_lse=sinks is not None)
    if sinks is not None:
        out_BTNH, probs_BNTS = _with_sinks(sinks, out_BTNH, probs_BNTS, lse_BTN)
    if probs_BNTS is not None:
        module.sow("intermediates", "attention_weights", probs_BNTS)
    return checkpoint_name(out_BTNH, "attention_out")


def _scale(cfg: TransformerConfig, q) -> float:
    if not cfg.scale_attention:
        return 1.0
    width = cfg.head_dim if cfg.latent else q.shape[-1]    # a latent step's q is wider
    return (width if cfg.query_pre_attn_scalar is None
            else cfg.query_pre_attn_scalar) ** -0.5


def _attend_new(module: nn.Module, q, cached, new, *, positions_BT, spec: MaskSpec, bias,
                sinks=None):
    """A decoding step's attention, reading the cache and never writing it: the queries
    over the cache's filled slots (`cached` = (k_BSKH, v_BSKH) under `spec`), merged with
    their attention over their own new keys (`new` = (k_BTKH, v_BTKH), causal among
    themselves: a single token sees itself). Sown weights cover the S slots, then the T
    new tokens."""
    cfg = module.config
    with_probs = module.is_mutable_collection("intermediates")
    out_c, probs_c, lse_c = attend(
        q, *cached, spec, bias, impl=cfg.attention_impl, scale=_scale(cfg, q),
        with_probs=with_probs, with_lse=True, block=cfg.attention_block,
        softcap=cfg.attn_logit_softcapping)
    own_spec = MaskSpec(positions_BT, positions_BT, causal=True, window=spec.window,
                        window_on=spec.window_on, chunk=spec.chunk, chunk_on=spec.chunk_on)
    own_bias = None if bias is None else bias.replace(k_pos=positions_BT)
    out_n, probs_n, lse_n = attend(q, *new, own_spec, own_bias, impl="xla", scale=_scale(cfg, q),
                                   with_probs=with_probs, with_lse=True,
                                   softcap=cfg.attn_logit_softcapping)
    out_BTNH, lse_BTN = merge((out_c, lse_c), (out_n, lse_n))
    if with_probs:
        def rescaled(probs_BNTS, lse_part):
            return probs_BNTS * jnp.exp(lse_part - lse_BTN).transpose(0, 2, 1)[..., None]
        probs_BNTS = jnp.concatenate([rescaled(probs_c, lse_c), rescaled(probs_n, lse_n)],
                                     axis=-1)
    if sinks is not None:
        out_BTNH, probs_BNTS = _with_sinks(sinks, out_BTNH, probs_BNTS if with_probs else None,
                                           lse_BTN)
    if with_probs:
        module.sow("intermediates", "attention_weights", probs_BNTS)
    return checkpoint_name(out_BTNH, "attention_out")


def layer_kind(cfg: TransformerConfig, spec: MaskSpec, kind, positions_BT):
    """One self-attention layer's mask description and rotary tables ((inv_freq, factor)
    of `models.rope.rope_tables`; None: no rotation) for its kind: `kind` None (every
    layer alike), or its `LayerKind` (Python bools, or traced ones in a scanned stack,
    which select without branching).

        sliding   -> spec windowed by sliding_window; rope_local_theta's frequencies,
                     unscaled (rope_theta's and rope_scaling's without it)
        chunked   -> spec within chunks of attention_chunk_size
        rope off  -> no rotation (traced: every angle 0, the identity)
    """
    full = rope_tables(cfg, positions_BT) if cfg.positions == "rope" else None
    if kind is None:
        return spec, full
    local = full
    if full is not None and cfg.rope_local_theta is not None:
        local = (jnp.asarray(rope_frequencies(cfg.rope_dim, cfg.rope_local_theta)), 1.0)
    if isinstance(kind.sliding, bool):
        spec = spec.replace(window=cfg.sliding_window if kind.sliding else None,
                            chunk=cfg.attention_chunk_size if kind.chunked else None)
        return spec, (local if kind.sliding else full) if kind.rope else None
    spec = spec.replace(window=cfg.sliding_window, window_on=kind.sliding,
                        chunk=cfg.attention_chunk_size, chunk_on=kind.chunked)
    if full is None:
        return spec, None
    inv_freq = jnp.where(kind.sliding, local[0], full[0])
    factor = jnp.where(kind.sliding, local[1], full[1])
    if cfg.nope_layers:
        inv_freq = jnp.where(kind.rope, inv_freq, 0.0)
        factor = jnp.where(kind.rope, factor, 1.0)
    return spec, (inv_freq, factor)


def _if_kind(flag, then, otherwise):
    """then() for a layer whose flag holds, otherwise() for one where it does not: chosen
    here for a Python bool, by `jnp.where` for a traced one."""
    if isinstance(flag, bool):
        return then() if flag else otherwise()
    return jnp.where(flag, then(), otherwise())


def _l2_norm(x, eps: float):
    """x / sqrt(mean(x^2) + eps) over the last axis, in float32 (Llama 4's q/k norm)."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
            ).astype(x.dtype)


def _temperature(cfg: TransformerConfig, positions_BT):
    """Llama 4's query factor in its NoPE layers, [B, T, 1, 1]:
    1 + scale * log(1 + floor((position + 1) / floor))."""
    steps = jnp.floor((positions_BT.astype(jnp.float32) + 1.0) / cfg.attn_temperature_floor)
    return (jnp.log1p(steps) * cfg.attn_temperature_scale + 1.0)[:, :, None, None]


def _queries_and_keys(cfg: TransformerConfig, q_BTNH, k_BTKH, positions_BT, rope, kind):
    """Rotary positions (when the layer rotates), then Llama 4's L2 norm (rotating layers)
    and attention temperature (the others) where the config asks for them."""
    rotates = True if kind is None else kind.rope
    if rope is not None:
        q_BTNH = apply_rope(q_BTNH, positions_BT, *rope, interleaved=cfg.rope_interleaved)
        k_BTKH = apply_rope(k_BTKH, positions_BT, *rope, interleaved=cfg.rope_interleaved)
    if cfg.qk_l2_norm:
        q_BTNH = _if_kind(rotates, lambda: _l2_norm(q_BTNH, cfg.norm_eps), lambda: q_BTNH)
        k_BTKH = _if_kind(rotates, lambda: _l2_norm(k_BTKH, cfg.norm_eps), lambda: k_BTKH)
    if cfg.attn_temperature_floor is not None:
        q_BTNH = _if_kind(rotates, lambda: q_BTNH, lambda: (
            q_BTNH * _temperature(cfg, positions_BT)).astype(q_BTNH.dtype))
    return q_BTNH, k_BTKH


class SelfAttention(nn.Module):
    """Self-attention projections; bidirectional or causal as the mask description says.

    With a cache, the new keys/values are written into `cache` for `layer` at `positions`
    and the queries attend over all cache slots (the description hides unwritten ones).
    With `read_only` the cache is only read: the queries attend over its filled slots and
    their own new keys, and the new keys/values come back (k_BTKH, v_BTKH) for the caller
    to commit, in place of the cache (a decoding step: see `_CachedDecoder.read_step`).
    `bias` (relative positions, a `RelativeBias`) is added to the logits. With
    `config.qk_norm` the queries and keys are normalised over H (scales `query_norm`,
    `key_norm`) before rotary positions, so the cache holds normalised, rotated keys.
    `kind` is this layer's `LayerKind` (None when all layers are alike): Python bools in
    a looped stack, traced ones in a scanned one (`layer_kind`). Llama 4's parts follow
    the rotation (`_queries_and_keys`). With
    `config.attention_sinks` each head's learned `sinks` logit joins its softmax
    (`_with_sinks`), in the forward pass and the read-only step alike. With
    `config.attention_output_gate` the query projection is [D, N, 2H], each head's last H
    channels a gate: the output is multiplied by their sigmoid before `out` (Qwen3-Next;
    `fuse_qkv` leaves such a query apart).
    """

    config: TransformerConfig

    @nn.compact
    def __call__(
        self,
        x_BTD: Float[Array, "B T D"],
        *,
        spec: MaskSpec,
        positions_BT: Int[Array, "B T"],
        cache: KVCache | None,
        layer,
        deterministic: bool,
        bias: RelativeBias | None = None,
        read_only: bool = False,
        kind=None,
    ) -> tuple[Float[Array, "B T D"], KVCache | tuple | None]:
        cfg, det = self.config, deterministic
        spec, rope = layer_kind(cfg, spec, kind, positions_BT)
        gate_BTNH = None
        if self.has_variable("params", "qkv_kernel"):            # see `fuse_qkv`
            q_BTNH, k_BTKH, v_BTKH = self._fused_qkv(x_BTD)
        else:
            q_BTNH, gate_BTNH = _queries_and_gate(cfg, x_BTD, det)
            k_BTKH = _dense_heads(cfg, cfg.num_kv_heads, "key")(x_BTD, det)
            v_BTKH = _dense_heads(cfg, cfg.num_kv_heads, "value")(x_BTD, det)
        if cfg.qk_norm:                  # over H, one scale for every head (before RoPE)
            q_BTNH = make_norm(cfg, "query_norm", axis="head_dim")(q_BTNH)
            k_BTKH = make_norm(cfg, "key_norm", axis="head_dim")(k_BTKH)
        q_BTNH, k_BTKH = _queries_and_keys(cfg, q_BTNH, k_BTKH, positions_BT, rope, kind)
        sinks = _sinks(self)
        if read_only:
            out_BTNH = _attend_new(self, q_BTNH, cache.read(layer),   # own k/v as stored
                                   cache.as_cached(k_BTKH, v_BTKH),
                                   positions_BT=positions_BT, spec=spec, bias=bias,
                                   sinks=sinks)
            return _dense_out(cfg)(_gated(out_BTNH, gate_BTNH), det), (k_BTKH, v_BTKH)
        if cache is None:
            k_BSKH, v_BSKH = k_BTKH, v_BTKH
        else:
            cache = cache.write(layer, k_BTKH, v_BTKH, positions_BT)
            k_BSKH, v_BSKH = cache.read(layer)
        out_BTNH = _attend(self, q_BTNH, k_BSKH, v_BSKH, spec, bias=bias,
                           deterministic=deterministic, sinks=sinks)
        return _dense_out(cfg)(_gated(out_BTNH, gate_BTNH), det), cache

    def _fused_qkv(self, x_BTD):
        """The queries, keys and values as one product with `fuse_qkv`'s kernel [D, N+2K, H]
        (and bias [N+2K, H]), in the dtype the three projections compute in."""
        cfg = self.config
        kernel = self.get_variable("params", "qkv_kernel")
        bias = (self.get_variable("params", "qkv_bias")
                if self.has_variable("params", "qkv_bias") else None)
        dtype = cfg.dtype or jnp.result_type(x_BTD, kernel)
        y_BTMH = jnp.einsum("BTD,DMH->BTMH", x_BTD.astype(dtype), kernel.astype(dtype))
        if bias is not None:
            y_BTMH = y_BTMH + bias.astype(dtype)[None, None]
        N, K = cfg.num_heads, cfg.num_kv_heads
        return y_BTMH[:, :, :N], y_BTMH[:, :, N:N + K], y_BTMH[:, :, N + K:]


_QKV = ("query", "key", "value")


def fuse_qkv(params):
    """`params` with each self-attention's query, key and value projections as one kernel
    `qkv_kernel` [(L,) D, N+2K, H] (and `qkv_bias` [(L,) N+2K, H]), which `SelfAttention`
    reads in their place: one matrix product instead of three, for decoding steps.

    A decoding step at batch 1 reads each weight matrix once, and on a CPU a product over
    a 1 MB matrix runs at about two thirds of the bandwidth of one three times its size
    (measured: `bench.decode --only overhead`). The copy is made once per decoding call,
    before its loop. Projections that carry adapters (`lora_a`), quantized kernels, or
    anything but a kernel and a bias are left as they are, and so is every other
    parameter: the tree still applies to the same model, with the same numbers up to the
    product's rounding.
    """
    if not isinstance(params, dict):
        return params
    return {k: _joined(v) if k == "self_attention" else fuse_qkv(v)
            for k, v in params.items()}


def _joined(attention):
    """One `SelfAttention`'s parameters with its query, key and value joined, where they
    can be (only a self-attention's: another layer's "query", "key" and "value", as a
    Gated DeltaNet's, mean something else)."""
    if not (isinstance(attention, dict) and all(isinstance(attention.get(n), dict)
                                                for n in _QKV) and _fusable(attention)):
        return attention
    out = {k: v for k, v in attention.items() if k not in _QKV}
    out["qkv_kernel"] = jnp.concatenate([attention[n]["kernel"] for n in _QKV], axis=-2)
    if "bias" in attention["query"]:
        out["qkv_bias"] = jnp.concatenate([attention[n]["bias"] for n in _QKV], axis=-2)
    return out


def _fusable(params) -> bool:
    """Whether a self-attention's query/key/value subtrees are plain kernels (and biases)
    of one dtype, every one of them or none with a bias, alike but for their heads (a
    query twice as wide, as a gated one, is not joined)."""
    names = {frozenset(params[n]) for n in _QKV}
    if len(names) != 1 or next(iter(names)) not in ({"kernel"}, {"kernel", "bias"}):
        return False
    leaves = [params[n][k] for n in _QKV for k in params[n]]
    if not all(isinstance(x, jax.Array) for x in leaves) or len({x.dtype for x in leaves}) != 1:
        return False
    return all(len({_without_heads(params[n][k].shape) for n in _QKV}) == 1
               for k in params["query"])


def _without_heads(shape: tuple) -> tuple:
    return shape[:-2] + shape[-1:] if len(shape) >= 2 else shape


class CrossAttention(nn.Module):
    """Cross-attention: queries from the decoder over keys/values projected beforehand
    (once per source, by `CrossKVProjection`)."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x_BTD, k_BSKH, v_BSKH, *, spec: MaskSpec, deterministic: bool):
        cfg = self.config
        q_BTNH = _dense_heads(cfg, cfg.num_heads, "query")(x_BTD, deterministic)
        out_BTNH = _attend(self, q_BTNH, k_BSKH, v_BSKH, spec, deterministic=deterministic)
        return _dense_out(cfg)(out_BTNH, deterministic)


class CrossKVProjection(nn.Module):
    """Keys and values of every decoder layer's cross-attention, from the encoder output.

    The kernels are stacked over the L decoder layers, so all layers' keys/values are one
    einsum, computed once per source and then only read (by the forward pass and by every
    decoding step alike). Output layout [L, B, K, S, H], as in `KVCache`.
    """

    config: TransformerConfig
    num_layers: int

    @nn.compact
    def __call__(self, encoded_BSD: Float[Array, "B S D"],
                 deterministic: bool = True) -> tuple[Array, Array]:
        """Returns k_LBKSH, v_LBKSH. Adapted (`config.lora`), each layer's keys/values add
        scale * (x A_l) B_l, A [L, D, r] and B [L, r, K, H] stacked like the kernels."""
        cfg = self.config
        shape = (self.num_layers, cfg.d_model, cfg.num_kv_heads, cfg.head_dim)
        # Initialise like L separate [D, K*H] projections (fan_in D, fan_out K*H).
        init = stacked_projection_init(in_axis=1, out_axis=(2, 3), batch_axis=(0,))
        out = []
        for name in ("key", "value"):
            kernel_LDKH = param_or_stored(
                self, f"{name}_kernel", named(init, "layers", "embed", "kv_heads", "head_dim"),
                shape, cfg.param_dtype)
            if isinstance(kernel_LDKH, Quantized):      # read once per source: rebuilt whole
                kernel_LDKH = kernel_LDKH.dequantize(cfg.dtype or jnp.float32)
            y_LBKSH = jnp.einsum(
                "BSD,LDKH->LBKSH", encoded_BSD.astype(cfg.dtype),
                kernel_LDKH.astype(cfg.dtype))
            if cfg.use_bias or cfg.qkv_bias:
                bias_LKH = self.param(
                    f"{name}_bias", named(ZEROS, "layers", "kv_heads", "head_dim"),
                    shape[:1] + shape[2:], cfg.param_dtype)
                y_LBKSH = y_LBKSH + bias_LKH.astype(cfg.dtype)[:, None, :, None, :]
            lora = cfg.lora and cfg.lora.shape_of(("decoder", "cross_attention", name))
            if lora:
                y_LBKSH = y_LBKSH + self._adapter(name, encoded_BSD, lora, deterministic)
            out.append(y_LBKSH)
        return out[0], out[1]

    def _adapter(self, name: str, x_BSD, lora: tuple[int, float], deterministic: bool):
        """The adapter's update of every layer's keys (or values), [L, B, K, S, H]."""
        cfg, (rank, scale) = self.config, lora
        rows, row_axis = ((x_BSD.shape[0],), ("lora_rows",)) if cfg.lora.per_row else ((), ())
        a_LDr = self.param(f"{name}_lora_a", named(LORA_STACKED_A_INIT, "layers", *row_axis,
                                                   "embed", "lora"),
                           (self.num_layers, *rows, cfg.d_model, rank), cfg.param_dtype)
        b_LrKH = self.param(f"{name}_lora_b", named(ZEROS, "layers", *row_axis, "lora",
                                                    "kv_heads", "head_dim"),
                            (self.num_layers, *rows, rank, cfg.num_kv_heads, cfg.head_dim),
                            cfg.param_dtype)
        x_BSD = nn.Dropout(cfg.lora.dropout)(x_BSD, deterministic=deterministic)
        if cfg.lora.per_row:         # a_LBDr, b_LBrKH: row b by its own adapter
            def one_layer(a, b):
                return jax.vmap(lambda x, a, b: adapted(x, a, b, scale, cfg.dtype))(
                    x_BSD, a, b)
        else:
            def one_layer(a, b):
                return adapted(x_BSD, a, b, scale, cfg.dtype)
        return jnp.moveaxis(jax.vmap(one_layer)(a_LDr, b_LrKH), 3, 2)  # [L,B,S,K,H]: K, S
