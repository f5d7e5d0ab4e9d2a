"""Gated DeltaNet: the linear-attention layer of Qwen3-Next (a "linear" kind of
`TransformerConfig.layer_types`), in the place of self-attention.

For each token the layer projects the (normed) residual stream x [D] to

    queries and keys   K' heads of width H'      ("query", "key")
    values             N' heads of width E'      ("value"), N' a multiple of K'
    an output gate z   N' heads of width E'      ("gate")
    b and a            one number per value head ("beta", "decay")

then runs the queries, keys and values, joined on the channel axis (queries' K' H', keys'
K' H', values' N' E', in that order), through a causal depthwise convolution of width W
(`linear_conv_width`) and SiLU (`delta_rule.causal_conv1d`), takes the decay
g = -exp(A) * softplus(a + dt_bias) and the write strength beta = sigmoid(b)
(`delta_rule.decay_and_beta`, A and dt_bias one per value head), and computes the gated
delta rule over the sequence with L2-normalised queries and keys (`delta_rule.chunked`,
chunks of `linear_chunk_size` tokens). Each value head's output o [E'] is then
RMS-normed and gated, scale * rmsnorm(o) * silu(z) (Qwen3-Next's `RMSNormGated`: the
plain scale, not the (1 + scale) of its other norms), and the heads are projected back
to D ("out").

Parameters (under the layer's "linear_attention"): `query/kernel` and `key/kernel`
[D, K', H'], `value/kernel` and `gate/kernel` [D, N', E'], `beta/kernel` and
`decay/kernel` [D, N'], `conv_kernel` [C, W] (C = 2 K' H' + N' E', the joined channels
in the order above; tap W - 1 multiplies the current token), `decay_log_scale` [N']
(Qwen3-Next's A_log), `decay_bias` [N'] (its dt_bias), `output_norm/scale` [E'] and
`out/kernel` [N', E', D]. No biases, whatever `use_bias` says. Value head n reads key
head n // (N' / K') (consecutive value heads share a key head).

Called with `lengths_B` (a right-padded block of each row's next tokens) the layer also
takes and returns its state between calls (`LinearState`: the delta rule's state
[B, N', H', E'], float32, and the convolution's last W - 1 inputs [B, C, W - 1]): a
prompt in one call or in pieces, then one token a call, gives the outputs of the whole
sequence in one call. Packed rows (`segment_ids`, teacher-forced) restart the state and
the convolution at each sequence's first token. Padding changes nothing: its decay and
write strength are zeroed (the state passes it unchanged) and the window is each row's
own last inputs. The decoding caches hold one per linear layer (`KVCache.linear`,
`BeamKVCache.linear`, `PagedKVCache.linear`): prefill writes it, a read-only step
returns the next for `commit`, and speculative decoding rebuilds it from the kept tokens
(`decode.speculative.rolled_back`).
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float

from models.axes import ONES, named
from models.config import TransformerConfig
from models.delta_rule import causal_conv1d, chunked, decay_and_beta, step
from models.errors import UserError
from models.projection import Projection

# The depthwise convolution's taps [C, W]: uniform in +-1/sqrt(W), as torch initialises a
# depthwise Conv1d (fan in W).
CONV_INIT = nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform", in_axis=1,
                                             out_axis=0)


def decay_log_scale_init(key, shape, dtype=jnp.float32):
    """log(A) with A uniform in [1, 16] per value head (the decay rates' spread)."""
    return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0)).astype(dtype)


class LinearState(NamedTuple):
    """A Gated DeltaNet layer's state between calls, per row.

    Attributes:
        recurrent: the delta rule's state [B, N', H', E'], float32.
        window: the convolution's last W - 1 inputs [B, C, W - 1], newest last, in the
            layer's dtype (`delta_rule.causal_conv1d`'s window).
    """

    recurrent: Float[Array, "B N H E"]
    window: Float[Array, "B C W"]

    @classmethod
    def zeros(cls, config: TransformerConfig, batch_size: int, dtype=None) -> LinearState:
        """The state before a sequence's first token."""
        K, N = config.linear_num_key_heads, config.linear_num_value_heads
        H, E = config.linear_key_head_dim, config.linear_value_head_dim
        channels = 2 * K * H + N * E
        return cls(jnp.zeros((batch_size, N, H, E), jnp.float32),
                   jnp.zeros((batch_size, channels, config.linear_conv_width - 1),
                             dtype or config.dtype or jnp.float32))


class GatedRMSNorm(nn.Module):
    """scale * rmsnorm(o) * silu(z) over the last axis: the normalisation in float32 and
    rounded to o's dtype, the product with the scale in o's dtype, the gate in float32
    (the order of transformers' Qwen3NextRMSNormGated). Its parameter is `scale` [E']."""

    epsilon: float
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, o_BTNE, z_BTNE):
        scale_E = self.param("scale", named(ONES, "head_dim"), (o_BTNE.shape[-1],),
                             self.param_dtype)
        o32 = o_BTNE.astype(jnp.float32)
        normed = (o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, axis=-1, keepdims=True)
                                      + self.epsilon)).astype(o_BTNE.dtype)
        scale = scale_E.astype(o_BTNE.dtype).reshape((1,) * (o_BTNE.ndim - 1) + (-1,))
        y = (scale * normed).astype(jnp.float32)
        return (y * jax.nn.silu(z_BTNE.astype(jnp.float32))).astype(o_BTNE.dtype)


class GatedDeltaNet(nn.Module):
    """Qwen3-Next's linear-attention layer (the module docstring): [B, T, D] -> [B, T, D],
    each row one sequence from an empty state."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x_BTD: Float[Array, "B T D"], *, deterministic: bool = True,
                 lengths_B=None, state: LinearState | None = None, segment_ids=None):
        """y [B, T, D]; with `lengths_B` (each row's real tokens of x, the rest right
        padding), (y, the state after them) from `state` (None: a sequence's start).
        `segment_ids` [B, T] (packed rows, teacher-forced): each sequence of a row starts
        from a zero state and a convolution that reads none of the one before."""
        if segment_ids is not None and lengths_B is not None:
            raise UserError("a Gated DeltaNet layer takes segment_ids (packed rows) or "
                            "lengths_B (decoding state), not both")
        cfg, det = self.config, deterministic
        K, N = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        H, E = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        B, T, _ = x_BTD.shape

        def project(name, features, axes):
            return Projection.make(cfg, features, name, in_axes=("embed",), out_axes=axes,
                                   bias=False)(x_BTD, det)

        q_BTKH = project("query", (K, H), ("kv_heads", "head_dim"))
        k_BTKH = project("key", (K, H), ("kv_heads", "head_dim"))
        v_BTNE = project("value", (N, E), ("heads", "head_dim"))
        z_BTNE = project("gate", (N, E), ("heads", "head_dim"))
        b_BTN = project("beta", N, ("heads",))
        a_BTN = project("decay", N, ("heads",))

        joined_BTC = jnp.concatenate([q_BTKH.reshape(B, T, K * H), k_BTKH.reshape(B, T, K * H),
                                      v_BTNE.reshape(B, T, N * E)], axis=-1)
        conv_CW = self.param("conv_kernel", named(CONV_INIT, "conv_in", "taps"),
                             (joined_BTC.shape[-1], cfg.linear_conv_width), cfg.param_dtype)
        joined_BTC, window = causal_conv1d(joined_BTC, conv_CW,
                                           window=None if state is None else state.window,
                                           lengths=lengths_B, segment_ids=segment_ids)
        q_BTKH = joined_BTC[..., :K * H].reshape(B, T, K, H)
        k_BTKH = joined_BTC[..., K * H:2 * K * H].reshape(B, T, K, H)
        v_BTNE = joined_BTC[..., 2 * K * H:].reshape(B, T, N, E)

        log_scale_N = self.param("decay_log_scale", named(decay_log_scale_init, "heads"),
                                 (N,), cfg.param_dtype)
        bias_N = self.param("decay_bias", named(ONES, "heads"), (N,), cfg.param_dtype)
        g_BTN, beta_BTN = decay_and_beta(a_BTN, b_BTN, log_scale_N, bias_N)
        recurrent = None
        if lengths_B is not None:          # padding: a decay of 1 and nothing written
            real_BT1 = (jnp.arange(T)[None, :] < lengths_B[:, None])[..., None]
            g_BTN, beta_BTN = jnp.where(real_BT1, g_BTN, 0.0), jnp.where(real_BT1, beta_BTN, 0.0)
            recurrent = None if state is None else state.recurrent
        if T == 1 and recurrent is not None:                 # a decoding step
            o_BNE, recurrent = step(q_BTKH[:, 0], k_BTKH[:, 0], v_BTNE[:, 0], g_BTN[:, 0],
                                    beta_BTN[:, 0], recurrent, qk_l2norm=True)
            o_BTNE = o_BNE[:, None]
        else:
            o_BTNE, recurrent = chunked(q_BTKH, k_BTKH, v_BTNE, g_BTN, beta_BTN, recurrent,
                                        chunk_size=cfg.linear_chunk_size, qk_l2norm=True,
                                        segment_ids=segment_ids)
        o_BTNE = GatedRMSNorm(cfg.norm_eps, cfg.param_dtype, name="output_norm")(
            o_BTNE.astype(cfg.dtype), z_BTNE)
        o_BTNE = checkpoint_name(o_BTNE, "attention_out")
        y_BTD = Projection.make(cfg, cfg.d_model, "out", in_axes=("heads", "head_dim"),
                                out_axes=("embed",), bias=False)(o_BTNE, det)
        if lengths_B is None:
            return y_BTD
        return y_BTD, LinearState(recurrent, window)
