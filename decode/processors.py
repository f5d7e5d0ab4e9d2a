"""Logits processors: small pure functions `(logits_BV, param) -> logits_BV`.

Each removes tokens by setting their logits to -inf (`models.numerics.REMOVED_LOGIT`: the
probability of a removed token is exactly 0) or rescales them, and can be called on any
logits, inside or outside jit. Parameters are traced values, a scalar or one per row
(shape [B]), so changing them never recompiles. `process_logits` composes them in the
usual order: repetition penalty, temperature, top-k, top-p, min-p.

    >>> top_k_filter(jnp.array([[1., 3., 3., 2.]]), 2)      # ties go to the lower id
    [[-inf, 3., 3., -inf]]
    >>> top_p_filter(jnp.log(jnp.array([[.5, .25, .125, .125]])), .75)
    [[log .5, log .25, -inf, -inf]]                         # keeps the smallest set with mass >= p
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float

from models.numerics import REMOVED_LOGIT


def _per_row(x, logits_BV) -> Array:
    """A scalar or [B] parameter as a [B, 1] column that broadcasts over the vocabulary."""
    x = jnp.asarray(x)
    return jnp.broadcast_to(x, logits_BV.shape[:1])[:, None]


def _order_keys(x_BV) -> Array:
    """uint32 keys with the order of the float32 values (-inf lowest; NaN not expected)."""
    bits = lax.bitcast_convert_type(x_BV.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _largest_key_with_mass(keys_BV, weights_BV, target_B1) -> Array:
    """Per row, the largest key t with sum(weights[keys >= t]) >= target (bisection).

    Mass falls as t grows, so 32 halvings of the uint32 key range find the t a descending
    sort would give (the key of the last value such a sort keeps), in 32 passes of
    compare-and-sum over [B, V] instead of a sort over the vocabulary.
    """
    lo = jnp.min(keys_BV, axis=-1, keepdims=True)     # mass(lo) is the whole row
    hi = jnp.max(keys_BV, axis=-1, keepdims=True)

    def halve(_, bounds):
        lo, hi = bounds
        gap = hi - lo
        mid = lo + (gap >> 1) + (gap & 1)              # ceil((lo + hi) / 2), no overflow
        ok = jnp.sum(jnp.where(keys_BV >= mid, weights_BV, 0), -1, keepdims=True) >= target_B1
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo, _ = lax.fori_loop(0, 32, halve, (lo, hi))
    return lo


def apply_temperature(logits_BV: Float[Array, "B V"], temperature) -> Float[Array, "B V"]:
    """logits / temperature for rows with temperature > 0; rows with 0 (greedy) unchanged."""
    t_B1 = _per_row(temperature, logits_BV).astype(logits_BV.dtype)
    return jnp.where(t_B1 > 0, logits_BV / jnp.where(t_B1 > 0, t_B1, 1.0), logits_BV)


def top_k_filter(logits_BV: Float[Array, "B V"], k) -> Float[Array, "B V"]:
    """Keeps exactly the k highest logits of each row (ties to the lower id); k = 0 keeps all."""
    k_B1 = _per_row(k, logits_BV).astype(jnp.int32)
    keys_BV = _order_keys(logits_BV)
    kth_B1 = _largest_key_with_mass(keys_BV, jnp.ones_like(keys_BV, jnp.int32), k_B1)
    above_BV = keys_BV > kth_B1
    ties_BV = keys_BV == kth_B1
    # Among the values equal to the k-th, the lowest ids fill the remaining places.
    room_B1 = k_B1 - jnp.sum(above_BV, axis=-1, keepdims=True, dtype=jnp.int32)
    keep = above_BV | (ties_BV & (jnp.cumsum(ties_BV, axis=-1, dtype=jnp.int32) <= room_B1))
    return jnp.where(keep | (k_B1 == 0), logits_BV, REMOVED_LOGIT)


def top_p_filter(logits_BV: Float[Array, "B V"], p) -> Float[Array, "B V"]:
    """Nucleus: keeps the most probable tokens until their mass reaches p (the token that
    crosses p is kept, so at least one token survives; ties with the last kept token are
    kept too); p = 1 keeps all."""
    p_B1 = _per_row(p, logits_BV).astype(jnp.float32)
    probs_BV = jax.nn.softmax(logits_BV.astype(jnp.float32), axis=-1)
    keys_BV = _order_keys(probs_BV)
    threshold_B1 = _largest_key_with_mass(keys_BV, probs_BV, p_B1)
    keep = (keys_BV >= threshold_B1) | (p_B1 >= 1.0)
    return jnp.where(keep, logits_BV, REMOVED_LOGIT)


def min_p_filter(logits_BV: Float[Array, "B V"], min_p) -> Float[Array, "B V"]:
    """Keeps tokens whose probability is at least min_p times the row's top probability."""
    m_B1 = _per_row(min_p, logits_BV).astype(jnp.float32)
    logits32 = logits_BV.astype(jnp.float32)
    top_B1 = jnp.max(logits32, axis=-1, keepdims=True)
    # p_i >= m * p_max  <=>  logit_i - logit_max >= log m
    keep = (logits32 - top_B1 >= jnp.log(jnp.maximum(m_B1, 1e-38))) | (m_B1 <= 0)
    return jnp.where(keep, logits_BV, REMOVED_LOGIT)


def apply_repetition_penalty(logits_BV: Float[Array, "B V"], seen_BV: Bool[Array, "B V"],
                             penalty) -> Float[Array, "B V"]:
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
    """Which processors run at all (static: each combination compiles once).

    `decode.generate` reads it from concrete sampling values; pass one, as in
    `generate(..., strategy=decode.Strategy(sample=True, top_p=True))`, when those values
    are traced. A processor left off is not applied, whatever its values.

    Attributes:
        sample: temperature and sampling (rows with temperature 0 stay greedy).
        top_k: the top-k filter. top_p: the nucleus filter. min_p: the min-p filter.
        penalty: the repetition penalty (and the bool[B, V] of tokens seen it needs).
    """

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
