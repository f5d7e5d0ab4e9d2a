"""Logits processors: small pure functions `(logits_BV, param) -> logits_BV`.

Each removes tokens by setting their logits to -inf (or rescales them) and can be called on
any logits, inside or outside jit. Parameters are traced values, a scalar or one per row
(shape [B]), so changing them never recompiles. `process_logits` composes them in the
usual order: repetition penalty, temperature, top-k, top-p, min-p.

    >>> top_k_filter(jnp.array([[1., 3., 3., 2.]]), 2)      # ties go to the lower id
    [[-inf, 3., 3., -inf]]
    >>> top_p_filter(jnp.log(jnp.array([[.5, .25, .125, .125]])), .75)
    [[log .5, log .25, -inf, -inf]]                           # keeps the smallest set with mass >= p
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

NEG_INF = -jnp.inf


def _per_row(x, logits_BV) -> Array:
    """A scalar or [B] parameter as a [B, 1] column that broadcasts over the vocabulary."""
    x = jnp.asarray(x)
    return jnp.broadcast_to(x, logits_BV.shape[:1])[:, None]


def _descending_ranks(logits_BV) -> Array:
    """Rank of every token when sorted by logit, highest first; ties rank the lower id first."""
    B, V = logits_BV.shape
    order_BV = jnp.argsort(-logits_BV, axis=-1, stable=True)
    rows_B1 = jnp.arange(B)[:, None]
    return jnp.zeros((B, V), jnp.int32).at[rows_B1, order_BV].set(
        jnp.broadcast_to(jnp.arange(V, dtype=jnp.int32)[None, :], (B, V)))


def apply_temperature(logits_BV: Float[Array, "B V"], temperature) -> Float[Array, "B V"]:
    """logits / temperature for rows with temperature > 0; rows with 0 (greedy) unchanged."""
    t_B1 = _per_row(temperature, logits_BV).astype(logits_BV.dtype)
    return jnp.where(t_B1 > 0, logits_BV / jnp.where(t_B1 > 0, t_B1, 1.0), logits_BV)


def top_k_filter(logits_BV: Float[Array, "B V"], k) -> Float[Array, "B V"]:
    """Keeps exactly the k highest logits of each row (ties to the lower id); k = 0 keeps all."""
    k_B1 = _per_row(k, logits_BV)
    keep = (_descending_ranks(logits_BV) < k_B1) | (k_B1 == 0)
    return jnp.where(keep, logits_BV, NEG_INF)


def top_p_filter(logits_BV: Float[Array, "B V"], p) -> Float[Array, "B V"]:
    """Nucleus: keeps the most probable tokens until their mass reaches p (the token that
    crosses p is kept, so at least one token survives); p = 1 keeps all."""
    p_B1 = _per_row(p, logits_BV)
    probs_BV = jax.nn.softmax(logits_BV.astype(jnp.float32), axis=-1)
    sorted_BV = -jnp.sort(-probs_BV, axis=-1)
    mass_before_BV = jnp.cumsum(sorted_BV, axis=-1) - sorted_BV
    # The smallest probability still kept; ties with it are kept as well.
    kept_count_B1 = jnp.sum(mass_before_BV < p_B1, axis=-1, keepdims=True)
    threshold_B1 = jnp.take_along_axis(sorted_BV, kept_count_B1 - 1, axis=-1)
    keep = (probs_BV >= threshold_B1) | (p_B1 >= 1.0)
    return jnp.where(keep, logits_BV, NEG_INF)


def min_p_filter(logits_BV: Float[Array, "B V"], min_p) -> Float[Array, "B V"]:
    """Keeps tokens whose probability is at least min_p times the row's top probability."""
    m_B1 = _per_row(min_p, logits_BV).astype(jnp.float32)
    logits32 = logits_BV.astype(jnp.float32)
    top_B1 = jnp.max(logits32, axis=-1, keepdims=True)
    # p_i >= m * p_max  <=>  logit_i - logit_max >= log m
    keep = (logits32 - top_B1 >= jnp.log(jnp.maximum(m_B1, 1e-38))) | (m_B1 <= 0)
    return jnp.where(keep, logits_BV, NEG_INF)


def apply_repetition_penalty(logits_BV: Float[Array, "B V"], seen_BV: Bool[Array, "B V"], penalty) -> Float[Array, "B V"]:
    """CTRL's penalty on tokens already seen (prompt or output): positive logits are
    divided by `penalty`, negative ones multiplied; penalty = 1 changes nothing."""
    r_B1 = _per_row(penalty, logits_BV).astype(logits_BV.dtype)
    penalised = jnp.where(logits_BV > 0, logits_BV / r_B1, logits_BV * r_B1)
    return jnp.where(seen_BV, penalised, logits_BV)


@flax.struct.dataclass
class SamplingParams:
    """Traced sampling parameters, each a float/int array of shape [B].

    Attributes:
      temperature: 0 means greedy for that row.
      top_k: 0 means off. top_p: 1 means off. min_p: 0 means off.
      repetition_penalty: 1 means off.
    """

    temperature: Array
    top_k: Array
    top_p: Array
    min_p: Array
    repetition_penalty: Array


@flax.struct.dataclass
class Strategy:
    """Which processors run at all (static: each combination compiles once)."""

    sample: bool = flax.struct.field(pytree_node=False, default=False)
    top_k: bool = flax.struct.field(pytree_node=False, default=False)
    top_p: bool = flax.struct.field(pytree_node=False, default=False)
    min_p: bool = flax.struct.field(pytree_node=False, default=False)
    penalty: bool = flax.struct.field(pytree_node=False, default=False)


def process_logits(logits_BV, seen_BV, params: SamplingParams, strategy: Strategy):
    """The composition used by `decode.generate`; processors that are off are skipped."""
    if strategy.penalty:
        logits_BV = apply_repetition_penalty(logits_BV, seen_BV, params.repetition_penalty)
    if strategy.sample:
        logits_BV = apply_temperature(logits_BV, params.temperature)
    if strategy.top_k:
        logits_BV = top_k_filter(logits_BV, params.top_k)
    if strategy.top_p:
        logits_BV = top_p_filter(logits_BV, params.top_p)
    if strategy.min_p:
        logits_BV = min_p_filter(logits_BV, params.min_p)
    return logits_BV


def select_tokens(logits_BV, rng, params: SamplingParams, strategy: Strategy):
    """Greedy argmax, or a categorical sample for rows with temperature > 0."""
    greedy_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    if not strategy.sample:
        return greedy_B
    sampled_B = jax.random.categorical(rng, logits_BV, axis=-1).astype(jnp.int32)
    return jnp.where(params.temperature > 0, sampled_B, greedy_B)
