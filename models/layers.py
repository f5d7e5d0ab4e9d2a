"""Building blocks below attention: embeddings, positions, norms, the MLP, residuals."""

from __future__ import annotations

import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int

from models import quant
from models.axes import ONES, ZEROS, constrain, named, normal_init
from models.config import TransformerConfig
from models.projection import Projection


def sinusoidal_embedding(positions_BT: Int[Array, "B T"], d_model: int) -> Float[Array, "B T D"]:
    """Vaswani et al.'s fixed positions: [sin(p w_i) for i < D/2] ++ [cos(p w_i) ...],
    w_i = 10000 ** (-i / (D/2 - 1)), evaluated at any (absolute) position."""
    half = d_model // 2
    scale = jnp.log(10_000.0) / max(half - 1, 1)
    freq_h = jnp.exp(-scale * jnp.arange(half, dtype=jnp.float32))
    angle_BTh = positions_BT.astype(jnp.float32)[:, :, None] * freq_h[None, None, :]
    emb = jnp.concatenate([jnp.sin(angle_BTh), jnp.cos(angle_BTh)], axis=-1)
    if d_model % 2:
        emb = jnp.pad(emb, ((0, 0), (0, 0), (0, 1)))
    return emb


@functools.lru_cache(maxsize=16)
def paper_sinusoid_table(max_len: int, d_model: int) -> np.ndarray:
    """float32[max_len, D]: Vaswani et al.'s frequencies w_i = 10000 ** (-2i / D), sines in
    the first ceil(D/2) channels and cosines in the last floor(D/2) (Marian's layout),
    computed in float64 as p / 10000 ** (2i / D) and rounded once: the operations of
    transformers' Marian and Pegasus tables, so the float32 tables are equal bit for bit.

        D = 4, position p:  [sin(p), sin(p / 100), cos(p), cos(p / 100)]
    """
    p = np.arange(max_len, dtype=np.float64)[:, None]
    sin = np.sin(p / 10_000.0 ** (2 * np.arange((d_model + 1) // 2) / d_model))
    cos = np.cos(p / 10_000.0 ** (2 * np.arange(d_model // 2) / d_model))
    return np.concatenate([sin, cos], axis=1).astype(np.float32)


def token_embedding(config: TransformerConfig, name: str) -> nn.Embed:
    """The [V, D] table; also the output projection when embeddings are tied."""
    std = config.d_model ** -0.5 if config.scale_embeddings else 0.02
    return quant.Embed(
        config.vocab_size, config.d_model, dtype=config.dtype,
        param_dtype=config.param_dtype,
        embedding_init=named(normal_init(std), "vocab", "embed"), name=name)


class InputEmbedding(nn.Module):
    """Token embedding (optionally shared, optionally scaled by sqrt(D)), plus token types
    when the config has them, plus absolute positions when the config uses them (rotary
    and relative positions act inside attention), then the embedding norm if the config
    has one, then dropout."""

    config: TransformerConfig
    tokens: nn.Embed

    @nn.compact
    def __call__(self, tokens_BT, positions_BT, deterministic: bool,
                 token_types_BT=None) -> Float[Array, "B T D"]:
        """`token_types_BT` (config.num_token_types > 0 only): None means type 0."""
        cfg = self.config
        x_BTD = self.tokens(tokens_BT)
        if cfg.scale_embeddings:
            x_BTD = x_BTD * jnp.asarray(cfg.d_model ** 0.5, x_BTD.dtype)
        if cfg.num_token_types:
            types = nn.Embed(
                cfg.num_token_types, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                embedding_init=named(normal_init(0.02), "types", "embed"),
                name="token_types")
            if token_types_BT is None:
                token_types_BT = jnp.zeros_like(tokens_BT)
            x_BTD = x_BTD + types(token_types_BT)
        if cfg.positions == "sinusoidal":
            x_BTD = x_BTD + sinusoidal_embedding(positions_BT + cfg.position_offset,
                                                 cfg.d_model).astype(x_BTD.dtype)
        elif cfg.positions == "sinusoidal_paper":
            table_PD = jnp.asarray(paper_sinusoid_table(cfg.max_len, cfg.d_model))
            x_BTD = x_BTD + table_PD[positions_BT].astype(x_BTD.dtype)
        elif cfg.positions == "learned":
            table = nn.Embed(
                cfg.max_len + cfg.position_offset, cfg.d_model, dtype=cfg.dtype,
                param_dtype=cfg.param_dtype,
                embedding_init=named(normal_init(0.01), "positions", "embed"),
                name="positions")
            x_BTD = x_BTD + table(positions_BT + cfg.position_offset)
        if cfg.embedding_norm:
            x_BTD = make_norm(cfg, "norm")(x_BTD)
        return nn.Dropout(cfg.dropout_rate)(x_BTD, deterministic=deterministic)


def make_norm(config: TransformerConfig, name: str | None = None,
              axis: str = "embed") -> nn.Module:
    """The config's norm over the last axis (logically named `axis`: "embed" for the
    residual stream, "head_dim" for `qk_norm`)."""
    ones, zeros = named(ONES, axis), named(ZEROS, axis)
    if config.norm == "rmsnorm" and config.norm_scale_offset:
        return OffsetRMSNorm(
            epsilon=config.norm_eps, offset=config.norm_scale_offset, dtype=config.dtype,
            param_dtype=config.param_dtype,
            scale_init=named(nn.initializers.constant(1.0 - config.norm_scale_offset), axis),
            name=name)
    if config.norm == "rmsnorm":
        return nn.RMSNorm(
            epsilon=config.norm_eps, dtype=config.dtype, param_dtype=config.param_dtype,
            scale_init=ones, name=name)
    return nn.LayerNorm(
        epsilon=config.norm_eps, dtype=config.dtype, param_dtype=config.param_dtype,
        use_bias=config.norm_bias, scale_init=ones, bias_init=zeros, name=name)


class OffsetRMSNorm(nn.Module):
    """RMSNorm times (offset + scale), computed in float32 and cast to `dtype` at the end
    (Gemma's norm, offset 1: a scale of 0 is the identity). Its parameter is `scale` [D],
    initialised to 1 - offset (the identity)."""

    epsilon: float
    offset: float
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    scale_init: Callable

    @nn.compact
    def __call__(self, x_BTD: Float[Array, "... D"]) -> Float[Array, "... D"]:
        scale_D = self.param("scale", self.scale_init, (x_BTD.shape[-1],), self.param_dtype)
        x = x_BTD.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.epsilon)
        factor = (self.offset + scale_D.astype(jnp.float32)).reshape((1,) * (x.ndim - 1) + (-1,))
        return (x * factor).astype(self.dtype)


ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": functools.partial(jax.nn.gelu, approximate=True),       # GPT-2's tanh form
    "gelu_exact": functools.partial(jax.nn.gelu, approximate=False),  # erf
    "silu": jax.nn.silu,
}
# Gated activations: the function applied to the gate, which multiplies the up projection.
GATED = {"swiglu": jax.nn.silu, "geglu": ACTIVATIONS["gelu"],
         "geglu_exact": ACTIVATIONS["gelu_exact"], "clamped_swiglu": None}
# The plain activation of each gated one (an encoder head's transform applies it).
UNGATED = {"swiglu": "silu", "geglu": "gelu", "geglu_exact": "gelu_exact"}


def gated(cfg: TransformerConfig, gate, up):
    """The hidden activations of a gated MLP (the dense one and each expert) from its gate
    and up projections: act(gate) * up, or GPT-OSS's clamped SwiGLU ("clamped_swiglu"),
    the gate clamped above and up on both sides at `swiglu_limit`, then
    gate * sigmoid(swiglu_alpha * gate) * (up + 1)."""
    if cfg.activation != "clamped_swiglu":
        return GATED[cfg.activation](gate) * up
    limit = cfg.swiglu_limit
    gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return gate * jax.nn.sigmoid(gate * cfg.swiglu_alpha) * (up + 1)


class MLP(nn.Module):
    """D -> F -> D, either act(x W_up) W_down (ReLU, GELU tanh or exact, SiLU) or gated:
    (act(x W_gate) * x W_up) W_down (SwiGLU with SiLU, GeGLU with tanh GELU; `gated`). Dropout at
    `mlp_dropout_rate` on the hidden activations. The input is named "mlp_in" for remat
    policies."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x_BTD: Float[Array, "B T D"],
                 deterministic: bool = True) -> Float[Array, "B T D"]:
        cfg = self.config

        def dense(features, name, axes):
            return Projection.make(cfg, features, name, in_axes=axes[:1], out_axes=axes[1:],
                                   bias=cfg.use_bias)

        up, down = ("embed", "mlp"), ("mlp", "embed")
        x_BTD = checkpoint_name(x_BTD, "mlp_in")
        if cfg.activation in GATED:
            h_BTF = gated(cfg, dense(cfg.mlp_dim, "gate", up)(x_BTD, deterministic),
                          dense(cfg.mlp_dim, "up", up)(x_BTD, deterministic))
        else:
            h_BTF = ACTIVATIONS[cfg.activation](dense(cfg.mlp_dim, "up", up)(x_BTD, deterministic))
        h_BTF = nn.Dropout(cfg.mlp_dropout_rate)(h_BTF, deterministic=deterministic)
        return dense(cfg.d_model, "down", down)(h_BTF, deterministic)


def residual(
    config: TransformerConfig,
    x_BTD: Float[Array, "B T D"],
    sublayer: Callable,
    norm: nn.Module,
    *,
    deterministic: bool,
    out_norm: nn.Module | None = None,
):
    """One residual sublayer, pre-norm `x + f(norm(x))` or post-norm `norm(x + f(x))`;
    with `out_norm` (pre-norm, `config.sublayer_output_norm`) `x + out_norm(f(norm(x)))`.

    `sublayer` returns (y, aux); aux (for example an updated cache) is passed through.
    Under a mesh (`models.axes.sharded_activations`) the stream is split over the batch.
    """
    drop = nn.Dropout(config.dropout_rate)
    x_BTD = constrain(x_BTD, "batch", None, None)      # a no-op without a mesh
    if config.norm_position == "pre":
        y_BTD, aux = sublayer(norm(x_BTD))
        if out_norm is not None:
            y_BTD = out_norm(y_BTD)
        return x_BTD + drop(y_BTD, deterministic=deterministic), aux
    y_BTD, aux = sublayer(x_BTD)
    return norm(x_BTD + drop(y_BTD, deterministic=deterministic)), aux
