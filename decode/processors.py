"""Logits processors: small pure functions `(logits_BV, param) -> logits_BV`.

Each removes tokens by setting their logits to -inf (`models.numerics.REMOVED_LOGIT`: the
probability of a removed token is exactly 0), rescales them, or forces one token (all
others -inf, its own 0), and can be called on any
logits, inside or outside jit. Parameters are traced values, a scalar or one per row
(shape [B]), so changing them never recompiles. `process_logits` composes them in the order
transformers' `generate` applies its processors:

    repetition penalty                              (RepetitionPenaltyLogitsProcessor)
    the token constraints, `constrain_logits`:
        repeated n-grams banned                     (NoRepeatNGramLogitsProcessor)
        banned ids                                  (NoBadWordsLogitsProcessor, single tokens;
                                                     SuppressTokensLogitsProcessor)
        ids banned as the first new token           (SuppressTokensAtBeginLogitsProcessor)
        end ids banned before min_new_tokens        (MinLength / MinNewTokensLength...)
        the forced first token                      (ForcedBOSTokenLogitsProcessor)
        the forced last token                       (ForcedEOSTokenLogitsProcessor)
    temperature, top-k, top-p, min-p                (the sampling warpers, in that order)

Greedy decoding and sampling apply them to the model's logits; beam search applies the
constraints to the log-probs (log_softmax of the logits) and sums what they return, as
transformers does: a forced token adds log-prob 0 to its beam, whatever the model gave it.

    >>> top_k_filter(jnp.array([[1., 3., 3., 2.]]), 2)      # ties go to the lower id
    [[-inf, 3., 3., -inf]]
    >>> top_p_filter(jnp.log(jnp.array([[.5, .25, .125, .125]])), .75)
    [[log .5, log .25, -inf, -inf]]                         # keeps the smallest set with mass >= p
    >>> force_token(jnp.array([[1., 3., 2.]]), 2, True)     # the forced id gets 0, others -inf
    [[-inf, -inf, 0.]]
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int

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


def ban_tokens(logits_BV: Float[Array, "B V"], banned) -> Float[Array, "B V"]:
    """Removes the banned tokens: `banned` is bool[V] (the same in every row) or bool[B, V].

        >>> ban_tokens(jnp.array([[1., 3., 2.]]), jnp.array([False, True, False]))
        [[1., -inf, 2.]]
    """
    banned = jnp.asarray(banned)
    return jnp.where(banned[None, :] if banned.ndim == 1 else banned, REMOVED_LOGIT, logits_BV)


def force_token(logits_BV: Float[Array, "B V"], token_id, when) -> Float[Array, "B V"]:
    """Where `when` holds and `token_id` >= 0, every logit becomes -inf but the token's, which
    becomes 0 (transformers' ForcedBOS/ForcedEOSTokenLogitsProcessor); elsewhere, and for
    token_id -1 (none), the logits are unchanged. `token_id` and `when` are each a scalar or
    one per row, and may be traced.

        >>> force_token(jnp.array([[1., 3., 2.], [1., 3., 2.]]), 0, jnp.array([True, False]))
        [[0., -inf, -inf], [1., 3., 2.]]
    """
    id_B1 = _per_row(token_id, logits_BV).astype(jnp.int32)
    on_B1 = _per_row(when, logits_BV) & (id_B1 >= 0)
    forced_BV = jnp.where(jnp.arange(logits_BV.shape[-1])[None, :] == id_B1, 0.0, REMOVED_LOGIT)
    return jnp.where(on_B1, forced_BV.astype(logits_BV.dtype), logits_BV)


def ban_end_before(logits_BV: Float[Array, "B V"], end_V: Bool[Array, " V"], generated,
                   min_new_tokens) -> Float[Array, "B V"]:
    """Bans the end ids (`end_V`) in rows that have generated fewer than `min_new_tokens`
    tokens (transformers' MinNewTokensLengthLogitsProcessor; its MinLengthLogitsProcessor is
    the same with min_length minus the decoder prompt's length).

        >>> ban_end_before(jnp.zeros((2, 3)), jnp.array([False, True, False]), 2, jnp.array([3, 2]))
        [[0., -inf, 0.], [0., 0., 0.]]          # row 0 has 2 < 3 tokens; row 1 has its 2
    """
    early_B1 = _per_row(generated, logits_BV) < _per_row(min_new_tokens, logits_BV)
    return jnp.where(early_B1 & end_V[None, :], REMOVED_LOGIT, logits_BV)


@flax.struct.dataclass
class Constraints:
    """Traced token constraints: changing any value never recompiles (see `constrain_logits`).

    Attributes:
        banned: bool[V] ids never generated (all False: none).
        forced_bos: int32[] the id forced as new token 0 (-1: none).
        forced_eos: int32[] the id forced as the last new token, index max_new_tokens - 1
            (-1: none).
        min_new_tokens: int32[B] (or [R], one per beam row) the end ids are banned until a row
            has generated that many tokens (0: off).
        end: bool[V] the end ids (from the static eos_ids) that min_new_tokens bans.
        no_repeat_ngram_size: int32[] n > 0: no n-gram occurs twice in a row's decoder
            sequence (0: off). It needs the n-gram history (`decode.ngrams`), which is
            compiled in only where asked for.
        banned_first: bool[V] ids not generated as new token 0 (Whisper's
            begin_suppress_tokens), or None (none; compiled in only where given).
    """

    banned: Bool[Array, " V"]
    forced_bos: Int[Array, ""]
    forced_eos: Int[Array, ""]
    min_new_tokens: Int[Array, " B"]
    end: Bool[Array, " V"]
    no_repeat_ngram_size: Int[Array, ""]
    banned_first: Bool[Array, " V"] | None = None

    @classmethod
    def none(cls, vocab_size: int, batch: int) -> Constraints:
        """Constraints that change nothing."""
        return cls(banned=jnp.zeros((vocab_size,), bool), forced_bos=jnp.int32(-1),
                   forced_eos=jnp.int32(-1), min_new_tokens=jnp.zeros((batch,), jnp.int32),
                   end=jnp.zeros((vocab_size,), bool), no_repeat_ngram_size=jnp.int32(0))


def constrain_logits(logits_BV: Float[Array, "B V"], c: Constraints, step, last_step,
                     repeated_BV: Bool[Array, "B V"] | None = None) -> Float[Array, "B V"]:
    """The token constraints in transformers' order, for new token `step` (0-based, also the
    tokens generated so far) of `last_step + 1`: repeated n-grams (`repeated_BV`, from
    `decode.ngrams.repeated`, or None), banned ids, ids banned at step 0, end ids before
    min_new_tokens, the forced first token, the forced last token. A forced token comes
    last, so it wins over a ban.

        step 0 of 4, forced_bos 5, banned {5}: token 5 is forced (logit 0, the others -inf)
        step 3 of 4 (last_step 3), forced_eos 2: token 2 is forced
    """
    if repeated_BV is not None:
        logits_BV = ban_tokens(logits_BV, repeated_BV)
    logits_BV = ban_tokens(logits_BV, c.banned)
    if c.banned_first is not None:
        logits_BV = ban_tokens(logits_BV, c.banned_first & (step == 0))
    logits_BV = ban_end_before(logits_BV, c.end, step, c.min_new_tokens)
    logits_BV = force_token(logits_BV, c.forced_bos, step == 0)
    return force_token(logits_BV, c.forced_eos, step == last_step)


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


def process_logits(logits_BV, seen_BV, params: SamplingParams, strategy: Strategy,
                   constrain=None):
    """The composition used by `decode.generate`, in the module docstring's order;
    processors that are off are skipped. `constrain(logits_BV) -> logits_BV` applies the
    token constraints (`constrain_logits` with the loop's step), or None for none."""
    if strategy.penalty:
        logits_BV = apply_repetition_penalty(logits_BV, seen_BV, params.repetition_penalty)
    if constrain is not None:
        logits_BV = constrain(logits_BV)
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
