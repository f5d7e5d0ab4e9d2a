"""The router's training terms of a mixture-of-experts model (`models.moe`): the
load-balancing loss and the router z-loss, added to a next-token objective's loss sums.

Every MoE layer sows its router logits (float32 [B, T, E]) into the "router" collection
when the forward makes it mutable; `router_logits` stacks them over layers, and:

    load_balancing_loss   Switch Transformer's auxiliary loss, exactly as transformers'
                          `load_balancing_loss_func` computes it: over every layer's tokens
                          (the mask excluding padding), f_e = the fraction of top-k
                          assignments that go to expert e (summing to k), P_e = the mean
                          router probability of e; loss = E * sum_e f_e * P_e. The counts
                          carry no gradient; the probabilities do.
    router_z_loss         ST-MoE's: the mean over every layer's unmasked tokens of
                          logsumexp(router logits) ** 2.

    sums = losses.cross_entropy(...)
    sums = moe_terms.add_router_terms(sums, cfg, router, weights_BT, train=True)

`add_router_terms` adds `router_aux_loss_coef * aux + router_z_loss_coef * z` to the loss
(training only), scaled by the rows' weight so that the step's division by the global
weight leaves the terms themselves, and the metrics `moe_aux_loss` and `router_z_loss`
(summarised per weight, like `z_loss`). Over several devices each device's terms are
those of its own rows, averaged by weight.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from models.moe import ROUTER_COLLECTION

COLLECTIONS = [ROUTER_COLLECTION]          # what the forward makes mutable
METRICS = ("moe_aux_loss", "router_z_loss")


def collects(config) -> bool:
    """Whether a model of `config` has routers whose terms the objective adds."""
    return config.num_experts > 0


def router_logits(collection) -> Float[Array, "L B T E"]:
    """Every layer's router logits from the "router" collection, stacked: looped layers
    sow [B, T, E] each, a scanned stack [L, B, T, E]."""
    leaves = jax.tree.leaves(collection)
    if not leaves:
        raise ValueError("the forward sowed no router logits (is 'router' mutable?)")
    return jnp.concatenate([x.reshape((-1, *x.shape[-3:])) for x in leaves])


def load_balancing_loss(logits_LBTE, mask_BT, *, top_k: int) -> jax.Array:
    """transformers' `load_balancing_loss_func` of the layers' logits (without its
    coefficient); `mask_BT` 1 at the tokens that count (its attention mask)."""
    num_experts = logits_LBTE.shape[-1]
    probs_LBTE = jax.nn.softmax(logits_LBTE.astype(jnp.float32), axis=-1)
    _, chosen_LBTk = jax.lax.top_k(probs_LBTE, top_k)
    counts_LBTE = jnp.sum(jax.nn.one_hot(chosen_LBTk, num_experts, dtype=jnp.float32), -2)
    m_1BT1 = mask_BT.astype(jnp.float32)[None, :, :, None]
    rows = jnp.maximum(logits_LBTE.shape[0] * jnp.sum(m_1BT1), 1.0)      # all padding: 0
    tokens_per_expert_E = jnp.sum(counts_LBTE * m_1BT1, axis=(0, 1, 2)) / rows
    prob_per_expert_E = jnp.sum(probs_LBTE * m_1BT1, axis=(0, 1, 2)) / rows
    return num_experts * jnp.sum(tokens_per_expert_E * prob_per_expert_E)


def router_z_loss(logits_LBTE, mask_BT) -> jax.Array:
    """The mean over layers and unmasked tokens of logsumexp(logits) ** 2."""
    z_LBT = jnp.square(jax.nn.logsumexp(logits_LBTE.astype(jnp.float32), axis=-1))
    m_1BT = mask_BT.astype(jnp.float32)[None]
    return jnp.sum(z_LBT * m_1BT) / jnp.maximum(logits_LBTE.shape[0] * jnp.sum(m_1BT), 1.0)


def add_router_terms(sums: dict, config, collection, weights_BT, *, train: bool) -> dict:
    """`sums` (`train.losses.cross_entropy`'s) with the router terms of the sown
    `collection` over the tokens of nonzero `weights_BT` (see the module docstring)."""
    logits_LBTE = router_logits(collection)
    mask_BT = weights_BT > 0
    aux = load_balancing_loss(logits_LBTE, mask_BT, top_k=config.experts_per_token)
    z = router_z_loss(logits_LBTE, mask_BT)
    out = {**sums, "moe_aux_loss": aux * sums["weight"], "router_z_loss": z * sums["weight"]}
    if train:
        term = config.router_aux_loss_coef * aux + config.router_z_loss_coef * z
        out["loss"] = sums["loss"] + term * sums["weight"]
    return out
