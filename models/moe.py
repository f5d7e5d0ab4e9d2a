"""The mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks k of E SwiGLU experts for
each token, and the token's output is their outputs weighted by the router.

The `TransformerConfig` fields that choose and shape it:

    num_experts           E; 0 means the dense MLP (`models.layers.MLP`) instead.
    experts_per_token     k, the experts each token goes to (top-k of the router).
    expert_mlp_dim        F of each expert; None means `mlp_dim` (`config.expert_width`).
    router_renormalize    True: softmax over all E experts, keep the top k, divide the k
                          weights by their sum (Mixtral; Qwen3-MoE's `norm_topk_prob`).
                          False: the k softmax probabilities as they are.
    router_score          "softmax" (above) or "sigmoid": each chosen expert's weight is
                          the sigmoid of its logit (Llama 4, DeepSeek-V3), renormalised as
                          above.
    router_groups, router_top_groups
                          sigmoid routing limited to the experts of the top_groups best of
                          `router_groups` equal groups (DeepSeek-V3's n_group, topk_group).
    router_score_bias     a learned-elsewhere bias [E] ("router_score_bias") added to the
                          sigmoid scores to choose the experts, not to weigh them
                          (DeepSeek-V3's e_score_correction_bias; no gradient reaches it).
    routed_scaling        the factor on the routed experts' weights (routed_scaling_factor).
    router_scales_input   False: each expert's output is multiplied by its weight. True:
                          its input is (Llama 4: expert(x * w)), and outputs are summed.
    shared_expert_mlp_dim None, or F_s: a dense gated MLP of that width ("shared_expert")
                          that every token goes through, added to the experts' sum.
    shared_expert_gate    the shared expert's output times sigmoid(x . w), w [D]
                          ("shared_expert_gate"; Qwen3-Next's shared_expert_gate).
    moe_layers            the layers with the mixture; () for every layer (the others
                          have the dense MLP of `mlp_dim`; not with `scan_layers`).
    router_aux_loss_coef  the weight of the load-balancing loss in training (Switch
                          Transformer's, as transformers' `load_balancing_loss_func`).
    router_z_loss_coef    the weight of the router z-loss, the mean over tokens of
                          logsumexp(router logits) ** 2 (ST-MoE).
    moe_dispatch          "ragged": tokens sorted by expert and computed with
                          `jax.lax.ragged_dot`, each expert on its own tokens only;
                          "dense": every expert on every token, weighted by the routing
                          (zero for the experts a token does not go to). The same numbers;
                          "dense" is simpler and costs E / k times the FLOPs.

Routing never drops a token: whatever the imbalance, every token goes to exactly k experts
(no capacity factor). The router's logits are computed and softmaxed in float32.

Parameters (under the layer's "mlp"): `router_kernel` [D, E], `gate_kernel` and `up_kernel`
[E, D, F], `down_kernel` [E, F, D], with the logical axis "expert" on E so that a mesh can
place the experts (`models.axes`). With `use_bias` (GPT-OSS) also `router_bias` [E] on the
router's logits and `gate_bias`, `up_bias` [E, F] and `down_bias` [E, D] on each expert's
projections. The experts' activation is the config's gated one, "swiglu" or GPT-OSS's
"clamped_swiglu" (`models.layers.gated`).

Each layer sows its router logits, float32 [B, T, E], into the "router" collection as
"router_logits" when the caller makes that collection mutable; the training losses
(`train.objectives.moe_terms`) read them. Elsewhere (decoding) nothing is kept.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int

from models.axes import ZEROS, named, stacked_projection_init
from models.config import TransformerConfig
from models.layers import MLP, gated
from models.quant import Quantized, param_or_stored

ROUTER_COLLECTION = "router"


def route(logits_NE: Float[Array, "N E"], k: int, *, renormalize: bool,
          score: str = "softmax", choice_bias_E=None, groups: int = 1, top_groups: int = 1,
          scaling: float = 1.0) -> tuple[Float[Array, "N k"], Int[Array, "N k"]]:
    """The top-k routing of float32 logits: (weights [N, k], expert ids [N, k]), the
    largest probability first.

        route([[0., 0., log(2)]], 2, renormalize=True)  -> ([[2/3, 1/3]], [[2, 0]])
        route([[0., 0., log(2)]], 2, renormalize=False) -> ([[1/2, 1/4]], [[2, 0]])

    With `score="sigmoid"` each expert's score is the sigmoid of its logit, and the k
    chosen are those of the highest scores plus `choice_bias_E` (DeepSeek-V3's selection
    bias, which chooses but does not weigh) among the experts of the `top_groups` best of
    `groups` equal groups (a group's worth: the sum of its two best biased scores). The
    weights are the chosen scores (renormalised), times `scaling`.
    """
    logits_NE = logits_NE.astype(jnp.float32)
    if score == "sigmoid":
        scores_NE = jax.nn.sigmoid(logits_NE)
        choice_NE = logits_NE if choice_bias_E is None and groups == 1 else (  # same order
            scores_NE if choice_bias_E is None
            else scores_NE + choice_bias_E.astype(jnp.float32)[None, :])
        if groups > 1:
            n, e = choice_NE.shape
            grouped_NGe = choice_NE.reshape(n, groups, e // groups)
            worth_NG = jax.lax.top_k(grouped_NGe, 2)[0].sum(-1)
            kept_NG = jnp.zeros((n, groups), bool).at[
                jnp.arange(n)[:, None], jax.lax.top_k(worth_NG, top_groups)[1]].set(True)
            choice_NE = jnp.where(kept_NG[:, :, None], grouped_NGe, -jnp.inf).reshape(n, e)
        experts_Nk = jax.lax.top_k(choice_NE, k)[1]
        weights_Nk = jnp.take_along_axis(scores_NE, experts_Nk, axis=-1)
    else:
        weights_Nk, experts_Nk = jax.lax.top_k(jax.nn.softmax(logits_NE, axis=-1), k)
    if renormalize:
        weights_Nk = weights_Nk / jnp.sum(weights_Nk, axis=-1, keepdims=True)
    if scaling != 1.0:
        weights_Nk = weights_Nk * scaling
    return weights_Nk, experts_Nk


def ragged_experts(x_ND, weights_Nk, experts_Nk, *, gate_EDF, up_EDF, down_EFD,
                   act=None, biases=None, dropout=lambda h: h, scale_input=False):
    """Each of the N * k (token, expert) pairs computed by its expert: pairs sorted by
    expert, `jax.lax.ragged_dot` over groups of (tokens per expert), then unsorted, weighted
    and summed over the k experts of each token. `act(gate, up)`: the gated activation
    (None: SwiGLU); `biases`: None, or (gate [E, F], up [E, F], down [E, D]) added to each
    pair's projections by its expert; `scale_input`: each pair's input is weighted instead
    of its output. Returns [N, D] in x's dtype."""
    n, k = experts_Nk.shape
    num_experts = gate_EDF.shape[0]
    flat_M = experts_Nk.reshape(-1)                                      # M = N * k
    order_M = jnp.argsort(flat_M, stable=True)
    group_sizes_E = jnp.bincount(flat_M, length=num_experts).astype(jnp.int32)
    xs_MD = x_ND[order_M // k]
    if scale_input:
        w_M1 = weights_Nk.reshape(-1)[order_M][:, None]
        xs_MD = (xs_MD * w_M1).astype(x_ND.dtype)
        weights_Nk = jnp.ones_like(weights_Nk)
    gate_MF = jax.lax.ragged_dot(xs_MD, gate_EDF, group_sizes_E)
    up_MF = jax.lax.ragged_dot(xs_MD, up_EDF, group_sizes_E)
    if biases is not None:
        expert_M = flat_M[order_M]
        gate_MF, up_MF = gate_MF + biases[0][expert_M], up_MF + biases[1][expert_M]
    h_MF = (act or _swiglu)(gate_MF, up_MF)
    y_MD = jax.lax.ragged_dot(dropout(h_MF), down_EFD, group_sizes_E)
    if biases is not None:
        y_MD = y_MD + biases[2][expert_M]
    y_NkD = y_MD[jnp.argsort(order_M)].reshape(n, k, -1)
    y_ND = jnp.einsum("nkd,nk->nd", y_NkD.astype(jnp.float32), weights_Nk)
    return y_ND.astype(x_ND.dtype)


def _swiglu(gate, up):
    return jax.nn.silu(gate) * up


def dense_experts(x_ND, weights_Nk, experts_Nk, *, gate_EDF, up_EDF, down_EFD,
                  act=None, biases=None, dropout=lambda h: h, scale_input=False):
    """Every expert on every token, weighted by the routing: the same [N, D] as
    `ragged_experts` (a token's unchosen experts weigh 0)."""
    num_experts = gate_EDF.shape[0]
    chosen_NkE = jax.nn.one_hot(experts_Nk, num_experts, dtype=jnp.float32)
    combine_NE = jnp.sum(chosen_NkE * weights_Nk[..., None], axis=1)
    if scale_input:                  # each expert reads x * its weight; outputs summed
        x_END = (x_ND[None] * combine_NE.T[:, :, None]).astype(x_ND.dtype)
        gate_ENF = jnp.einsum("end,edf->enf", x_END, gate_EDF)
        up_ENF = jnp.einsum("end,edf->enf", x_END, up_EDF)
        combine_NE = jnp.sum(chosen_NkE, axis=1)
    else:
        gate_ENF = jnp.einsum("nd,edf->enf", x_ND, gate_EDF)
        up_ENF = jnp.einsum("nd,edf->enf", x_ND, up_EDF)
    if biases is not None:
        gate_ENF, up_ENF = gate_ENF + biases[0][:, None], up_ENF + biases[1][:, None]
    h_ENF = (act or _swiglu)(gate_ENF, up_ENF)
    y_END = jnp.einsum("enf,efd->end", dropout(h_ENF), down_EFD)
    if biases is not None:
        y_END = y_END + biases[2][:, None]
    y_ND = jnp.einsum("end,ne->nd", y_END.astype(jnp.float32), combine_NE)
    return y_ND.astype(x_ND.dtype)


DISPATCH = {"ragged": ragged_experts, "dense": dense_experts}


class MoeMLP(nn.Module):
    """The mixture-of-experts MLP (see the module docstring): [B, T, D] -> [B, T, D]."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x_BTD: Float[Array, "B T D"],
                 deterministic: bool = True) -> Float[Array, "B T D"]:
        cfg = self.config
        d, e, f = cfg.d_model, cfg.num_experts, cfg.expert_width
        stacked = stacked_projection_init(1, (2,), (0,))
        router_DE = self.param("router_kernel", named(stacked_projection_init(0, (1,), ()),
                                                      "embed", "expert"), (d, e),
                               cfg.param_dtype)
        gate_EDF, up_EDF = (param_or_stored(self, name, named(stacked, "expert", "embed", "mlp"),
                                            (e, d, f), cfg.param_dtype)
                            for name in ("gate_kernel", "up_kernel"))
        down_EFD = param_or_stored(self, "down_kernel", named(stacked, "expert", "mlp", "embed"),
                                   (e, f, d), cfg.param_dtype)
        # Quantized experts (`models.quant`) are rebuilt in the compute dtype for dispatch.
        gate_EDF, up_EDF, down_EFD = (
            w.dequantize(cfg.dtype or jnp.float32) if isinstance(w, Quantized) else w
            for w in (gate_EDF, up_EDF, down_EFD))
        x_BTD = checkpoint_name(x_BTD, "mlp_in")
        b, t, _ = x_BTD.shape
        x_ND = x_BTD.reshape(b * t, d).astype(cfg.dtype)
        logits_NE = jnp.dot(x_ND.astype(jnp.float32), router_DE.astype(jnp.float32),
                            precision=jax.lax.Precision.HIGHEST)
        biases = None
        if cfg.use_bias:
            logits_NE = logits_NE + self.param(
                "router_bias", named(ZEROS, "expert"), (e,),
                cfg.param_dtype).astype(jnp.float32)[None, :]
            biases = tuple(
                self.param(name, named(ZEROS, "expert", axis), (e, width),
                           cfg.param_dtype).astype(cfg.dtype)
                for name, axis, width in (("gate_bias", "mlp", f), ("up_bias", "mlp", f),
                                          ("down_bias", "embed", d)))
        self.sow(ROUTER_COLLECTION, "router_logits", logits_NE.reshape(b, t, e))
        choice_bias_E = None
        if cfg.router_score_bias:        # chooses, never weighs: it takes no gradient
            choice_bias_E = self.param("router_score_bias", named(ZEROS, "expert"), (e,),
                                       cfg.param_dtype)
        weights_Nk, experts_Nk = route(logits_NE, cfg.experts_per_token,
                                       renormalize=cfg.router_renormalize,
                                       score=cfg.router_score, choice_bias_E=choice_bias_E,
                                       groups=cfg.router_groups,
                                       top_groups=cfg.router_top_groups,
                                       scaling=cfg.routed_scaling)
        drop = nn.Dropout(cfg.mlp_dropout_rate)
        y_ND = DISPATCH[cfg.moe_dispatch](
            x_ND, weights_Nk, experts_Nk, gate_EDF=gate_EDF.astype(cfg.dtype),
            up_EDF=up_EDF.astype(cfg.dtype), down_EFD=down_EFD.astype(cfg.dtype),
            act=functools.partial(gated, cfg), biases=biases,
            dropout=lambda h: drop(h, deterministic=deterministic),
            scale_input=cfg.router_scales_input)
        y_BTD = y_ND.reshape(b, t, d)
        if cfg.shared_expert_mlp_dim:
            shared = MLP(cfg.replace(mlp_dim=cfg.shared_expert_mlp_dim), name="shared_expert")
            shared_BTD = shared(x_BTD, deterministic)
            if cfg.shared_expert_gate:
                gate_D = self.param("shared_expert_gate", named(ZEROS, "embed"), (d,),
                                    cfg.param_dtype)
                dtype = cfg.dtype or shared_BTD.dtype
                gate_BT1 = jax.nn.sigmoid(jnp.einsum("btd,d->bt", x_BTD.astype(dtype),
                                                     gate_D.astype(dtype)))[..., None]
                shared_BTD = shared_BTD * gate_BT1.astype(shared_BTD.dtype)
            y_BTD = y_BTD + shared_BTD
        return y_BTD
