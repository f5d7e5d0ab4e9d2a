"""Beam search as named steps: the start state, one iteration, the loop, the final merge.

Shapes: B sources, W beams per source, C = 2W candidates per source, N new tokens,
V vocabulary, and R = B * W rows of the model's batch (its cache and logits), beam-major
within a source: row b * W + w is beam w of source b (R is never the pmap axis here).

One iteration (`beam_step`), from the logits of the W alive beams of each source:

    token_logprobs   log_softmax of the logits, then the token constraints (banned, forced,
                     ...; `decode.processors.constrain_logits`), as transformers applies its
                     processors in beam search
    top_candidates   the C best one-token extensions: log-prob sums, parent beams, tokens
    extend           their token sequences: the parent's, plus the new token
    finishing        which of them end now (an end token, among the W best)
    merge_finished   the finished pool: the W best of (the pool, the candidates that end),
                     scored by log-prob / length_penalty(length)
    select_alive     the W best candidates that add no end token become the alive beams
    stops            a source is done once no alive beam can beat its W-th finished one
                     (`cannot_improve`, exact), or by one of transformers' rules
    cache_rows       the rows of the cache the new beams continue (their parents')
    follow           the cache after the new beams (`models.BeamKVCache` moves only its
                     ancestry table, no keys or values)
    maybe_step       the model's step on the new beams' tokens, unless every source is
                     done or this was the last token (`lax.cond`: no model call then)

C = max(2, 1 + E) * W for E end ids: each parent adds at most E end tokens, so at least W
candidates add none (transformers keeps as many). Each step's docstring works through the
same example: one source, W = 2, V = 3, end id 2 (so C = 4).

Two length normalisations (`length_penalty(length, alpha, normalization)`, where length
counts the new tokens, the end token included, and not the decoder's prompt or start token):

    "gnmt"   score = log-prob / ((5 + length) / 6) ** alpha       (Wu et al. 2016)
    "hf"     score = log-prob / length ** alpha                   (transformers' beam search)

    log-prob -6.0 at length 4, alpha 1:  gnmt -6.0 / 1.5 = -4.0;   hf -6.0 / 4 = -1.5

Three stopping rules (`STOPPINGS`), each one of transformers' `early_stopping` values
(`EARLY_STOPPING`, `stopping_rule`):

    "exact"      no alive beam can still beat the W-th finished one (`cannot_improve`);
                 transformers' early_stopping="never" (log-prob sums are <= 0, so its
                 bound, the best alive sum at max_length when alpha > 0 and at the current
                 length otherwise, is this one)
    "heuristic"  the pool is full and its W-th score is at least the best alive sum at
                 its current length (`heuristic_stop`); transformers' default, False
    "full"       the pool is full (W finished); transformers' early_stopping=True

A rule is a name (static) or its index in `STOPPINGS` (int32[], traced: one compilation
serves all three, `decode.beam_search`'s way). A source that is done takes no more
finished sequences, and its alive beams do not join the pool at the end (`finalize`), so
with "heuristic" and "full" the result is exactly transformers', which may score below
the exact search's.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from decode import ngrams
from decode.loop import maybe_step, unchanged
from decode.processors import Constraints, constrain_logits
from models.errors import UserError
from models.numerics import NO_SEQUENCE_SCORE

NORMALIZATIONS = ("gnmt", "hf")
STOPPINGS = ("exact", "heuristic", "full")
# transformers' early_stopping values -> the stopping rule that reproduces them.
EARLY_STOPPING = {"never": "exact", False: "heuristic", True: "full"}


def stopping_rule(early_stopping, name: str = "early_stopping") -> str:
    """The `STOPPINGS` rule of one of transformers' early_stopping values, True, False or
    "never"; anything else (1, "true", None) is refused naming `name` and the value.

        stopping_rule("never") -> "exact";  stopping_rule(False) -> "heuristic"
        stopping_rule(1)       -> UserError: early_stopping=1 must be True, False or 'never'
    """
    if isinstance(early_stopping, (bool, np.bool_)):
        return EARLY_STOPPING[bool(early_stopping)]
    if isinstance(early_stopping, str) and early_stopping == "never":
        return EARLY_STOPPING["never"]
    raise UserError(f"{name}={early_stopping!r} must be True, False or 'never' "
                    "(transformers' early_stopping values)")


def gnmt_penalty(length, alpha: float):
    """GNMT: ((5 + length) / 6) ** alpha; alpha = 0 gives 1 (plain log-prob sums)."""
    return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


def hf_penalty(length, alpha: float):
    """transformers' beam search: length ** alpha, length the new tokens with the end token
    (not the decoder's prompt or start token); alpha = 0 gives 1."""
    return jnp.asarray(length, jnp.float32) ** alpha


def length_penalty(length, alpha, normalization: str = "gnmt"):
    """The divisor of a finished sequence's log-prob: `gnmt_penalty` or `hf_penalty`."""
    if normalization not in NORMALIZATIONS:
        raise UserError(f"length_normalization={normalization!r} must be one of "
                         f"{NORMALIZATIONS}")
    return (gnmt_penalty if normalization == "gnmt" else hf_penalty)(length, alpha)


@flax.struct.dataclass
class BeamState:
    """The beam-search carry.

    Attributes:
        step: int32[] tokens chosen so far (the length of every alive beam).
        logits: float32[R, V] next-token logits of the alive beams.
        cache: the model cache, R = B * W self-attention rows.
        alive_tokens: int32[B, W, N]; alive_logprobs: float32[B, W] (NO_SEQUENCE_SCORE: an
            empty slot).
        finished_tokens: int32[B, W, N]; finished_scores: float32[B, W] (NO_SEQUENCE_SCORE:
            empty); finished_lengths: int32[B, W].
        done: bool[B] sources whose W finished beams can no longer change.
        history: the alive beams' decoder sequences (R rows) for no_repeat_ngram_size, or
            None.
    """

    step: Int[Array, ""]
    logits: Float[Array, "R V"]
    cache: object
    alive_tokens: Int[Array, "B W N"]
    alive_logprobs: Float[Array, "B W"]
    finished_tokens: Int[Array, "B W N"]
    finished_scores: Float[Array, "B W"]
    finished_lengths: Int[Array, "B W"]
    done: Bool[Array, " B"]
    history: ngrams.NgramHistory | None = None


def beam_init(logits_RV, cache, beam_size: int, max_new_tokens: int,
              history: ngrams.NgramHistory | None = None) -> BeamState:
    """The state before the first token, from the prefill's logits and cache (R rows).

    The W beams of a source start identical, so only beam 0 is alive (log-prob 0) and the
    others are empty slots: the first expansion then has no repeats. W = 3, B = 1:

        alive_logprobs  [[0, -1e30, -1e30]]      finished_scores [[-1e30, -1e30, -1e30]]
    """
    W, N = beam_size, max_new_tokens
    B = logits_RV.shape[0] // W
    alive_logprobs_BW = (jnp.where(jnp.arange(W)[None, :] == 0, 0.0, NO_SEQUENCE_SCORE)
                         * jnp.ones((B, 1)))
    return BeamState(
        step=jnp.zeros((), jnp.int32), logits=logits_RV.astype(jnp.float32), cache=cache,
        alive_tokens=jnp.zeros((B, W, N), jnp.int32), alive_logprobs=alive_logprobs_BW,
        finished_tokens=jnp.zeros((B, W, N), jnp.int32),
        finished_scores=jnp.full((B, W), NO_SEQUENCE_SCORE),
        finished_lengths=jnp.zeros((B, W), jnp.int32), done=jnp.zeros((B,), bool),
        history=history)


def top_w(scores_BM, W: int, *arrays_BM):
    """The W best of M entries by score, best first (ties: the lower index), and each
    [B, M, ...] array gathered to [B, W, ...] in the same order."""
    scores_BW, index_BW = lax.top_k(scores_BM, W)

    def gather(a):
        index = index_BW.reshape(index_BW.shape + (1,) * (a.ndim - 2))
        return jnp.take_along_axis(a, index, axis=1)

    return (scores_BW,) + tuple(gather(a) for a in arrays_BM)


def token_logprobs(logits_RV, constraints: Constraints | None, step, last_step, *,
                   repeated_RV=None, renormalize=False):
    """The next-token log-probs beam search adds up: log_softmax of the logits, then the
    token constraints for new token `step` (None: none); with `renormalize` (traced bool)
    a log_softmax again, transformers' renormalize_logits. Every value stays <= 0: the
    constraints only remove a token (-inf) or force one (0).

        logits [[0., 0., 0.]], banned {1}   -> [[-1.10, -inf, -1.10]]
        the same with renormalize           -> [[-0.69, -inf, -0.69]]
        step 0, forced_bos 2                -> [[-inf, -inf, 0.]]
    """
    logprobs_RV = jax.nn.log_softmax(logits_RV, axis=-1)
    if constraints is None:
        return logprobs_RV
    logprobs_RV = constrain_logits(logprobs_RV, constraints, step, last_step, repeated_RV)
    return jnp.where(renormalize, jax.nn.log_softmax(logprobs_RV, axis=-1), logprobs_RV)


def top_candidates(logprobs_RV, alive_logprobs_BW, C: int):
    """The C best one-token extensions of each source's alive beams.

    Returns (logprobs_BC: the sequences' log-prob sums, parent_BC: the alive beam each
    extends, token_BC: the token it adds). The W * V sums are ranked as one flat row, in
    which entry w * V + v is beam w plus token v:

        alive log-probs  [-0.1, -1.5]
        token log-probs  beam 0 [-3.91, -0.25, -1.61]    (probabilities .02 .78 .20)
                         beam 1 [-0.36, -4.61, -1.24]    (probabilities .70 .01 .29)
        sums, flat       [-4.01, -0.35, -1.71,  -1.86, -6.11, -2.74]
        C = 4 best       logprobs [-0.35, -1.71, -1.86, -2.74] at flat [1, 2, 3, 5]
                         parent = flat // V = [0, 0, 1, 1], token = flat % V = [1, 2, 0, 2]
    """
    B, W = alive_logprobs_BW.shape
    V = logprobs_RV.shape[-1]
    sums_BWV = alive_logprobs_BW[:, :, None] + logprobs_RV.reshape(B, W, V)
    logprobs_BC, flat_BC = lax.top_k(sums_BWV.reshape(B, W * V), C)
    return logprobs_BC, flat_BC // V, (flat_BC % V).astype(jnp.int32)


def extend(alive_tokens_BWN, parent_BC, token_BC, step):
    """The candidates' sequences: each parent's tokens with the new token at `step`.

        step 1, alive tokens [[4, 0, 0], [7, 0, 0]], parent [0, 0, 1, 1], token [1, 2, 0, 2]
        -> [[4, 1, 0], [4, 2, 0], [7, 0, 0], [7, 2, 0]]
    """
    seqs_BCN = jnp.take_along_axis(alive_tokens_BWN, parent_BC[:, :, None], axis=1)
    return lax.dynamic_update_slice(seqs_BCN, token_BC[:, :, None], (0, 0, step))


def adds_end(token_BC, eos_E):
    """bool[B, C]: the candidates whose new token is an end id (none without end ids).

        token [1, 2, 0, 2], end id 2 -> [False, True, False, True]
    """
    if eos_E is None:
        return jnp.zeros_like(token_BC, bool)
    return jnp.isin(token_BC, eos_E)


def finishing(token_BC, logprobs_BC, eos_E, W: int):
    """bool[B, C]: the candidates that end now. A candidate ends if its token is an end id,
    it extends a real beam (not an empty slot, nor a token a constraint removed), and it
    ranks among the W best, i.e. it would have taken a beam: so beam_size = 1 is exactly
    greedy decoding.

        W = 2, token [1, 2, 0, 2] -> [False, True, False, False]
        (candidate 3 also adds the end id 2, but ranks 4th: it is dropped, as in
        transformers, neither finished nor alive)
    """
    among_w_best_C = jnp.arange(token_BC.shape[1]) < W
    return (adds_end(token_BC, eos_E)
            & (logprobs_BC > NO_SEQUENCE_SCORE / 2) & among_w_best_C[None, :])


def merge_finished(finished, seqs_BCN, logprobs_BC, ending_BC, *, length, alpha,
                   normalization: str = "gnmt"):
    """The new finished pool: the W best of the M = W + C entries of the old pool
    `finished` = (scores_BW, tokens_BWN, lengths_BW) and the candidates that end now (of
    `length` tokens, scored logprob / length_penalty(length); the others score
    NO_SEQUENCE_SCORE). Returns the new pool, (scores_BW, tokens_BWN, lengths_BW).

        alpha 0, pool scores [-0.9, -1e30], candidates [-0.35, -1.71, -1.86, -2.74] ending
        [False, True, False, False] -> M scores [-0.9, -1e30,  -1e30, -1.71, -1e30, -1e30]
        -> scores [-0.9, -1.71]: the old finished beam, then candidate 1
    """
    finished_scores_BW, finished_tokens_BWN, finished_lengths_BW = finished
    new_scores_BC = jnp.where(
        ending_BC, logprobs_BC / length_penalty(length, alpha, normalization), NO_SEQUENCE_SCORE)
    return top_w(
        jnp.concatenate([finished_scores_BW, new_scores_BC], 1), finished_scores_BW.shape[1],
        jnp.concatenate([finished_tokens_BWN, seqs_BCN], 1),
        jnp.concatenate([finished_lengths_BW, jnp.full(logprobs_BC.shape, length)], 1))


def select_alive(logprobs_BC, ends_BC, seqs_BCN, parent_BC, token_BC, *, W: int):
    """The W best candidates that add no end token (`adds_end`): (logprobs_BW, tokens_BWN,
    parent_BW, token_BW). There are always W of them (C = max(2, 1 + E) * W, and at most
    E * W candidates add one of the E end ids).

        logprobs [-0.35, -1.71, -1.86, -2.74], ends [False, True, False, True]
        -> candidates 0 and 2: logprobs [-0.35, -1.86], parent [0, 1], token [1, 0]
    """
    return top_w(jnp.where(ends_BC, NO_SEQUENCE_SCORE, logprobs_BC), W,
                 seqs_BCN, parent_BC, token_BC)


def heuristic_stop(finished_scores_BW, alive_logprobs_BW, penalty_now):
    """bool[B]: transformers' default stop (early_stopping=False): all W finished slots
    hold a sequence and the W-th scores at least the best alive sum divided by the penalty
    at its current length (which a longer sequence may still beat when alpha > 0).

        finished [-0.9, -1.0], best alive -2.4 at l = 2, hf alpha 1: -1.0 >= -1.2: True
        finished [-0.9, -1e30]: False (a slot is empty)
    """
    full_B = finished_scores_BW[:, -1] > NO_SEQUENCE_SCORE / 2
    return full_B & (finished_scores_BW[:, -1] >= alive_logprobs_BW[:, 0] / penalty_now)


def stops(stopping, finished_scores_BW, alive_logprobs_BW, penalty_now, penalty_last):
    """bool[B]: the sources the rule `stopping` stops after this step: a `STOPPINGS` name
    (static), or its index in `STOPPINGS` (int32[], traced: the three are computed and
    the index picks one)."""
    def rule(name):
        if name == "exact":
            return cannot_improve(finished_scores_BW, alive_logprobs_BW, penalty_now,
                                  penalty_last)
        if name == "heuristic":
            return heuristic_stop(finished_scores_BW, alive_logprobs_BW, penalty_now)
        return finished_scores_BW[:, -1] > NO_SEQUENCE_SCORE / 2          # "full"

    if isinstance(stopping, str):
        check_stopping(stopping)
        return rule(stopping)
    return jnp.select([stopping == i for i in range(len(STOPPINGS) - 1)],
                      [rule(name) for name in STOPPINGS[:-1]], rule(STOPPINGS[-1]))


def check_stopping(stopping) -> None:
    """A `STOPPINGS` name, or an int32[] index of one (not checked when traced)."""
    if isinstance(stopping, str):
        if stopping not in STOPPINGS:
            raise UserError(f"stopping={stopping!r} must be one of {STOPPINGS}")
    elif getattr(stopping, "shape", None) != () or not jnp.issubdtype(stopping.dtype,
                                                                        jnp.integer):
        raise TypeError(f"stopping must be one of {STOPPINGS} or an int32[] index of one, "
                        f"got {stopping!r}")


def cannot_improve(finished_scores_BW, alive_logprobs_BW, penalty_now, penalty_last):
    """bool[B]: no alive beam can beat the W-th finished one, so the finished pool is final.

    An alive beam has log-prob sum s at its length l now (`penalty_now` = the penalty at l)
    and ends at some length L in [l, N] (N = max_new_tokens, `penalty_last`), finished or
    joined at the end. The sum only falls (each step adds a log-prob <= 0: a constraint
    removes a token or forces it with 0), so its score is at most s / penalty(L). Both
    penalties are monotone in L, for any sign of alpha, so s / penalty(L) is monotone in L
    and its largest value over [l, N] is at an end: the bound is
    max(s / penalty(l), s / penalty(N)). With alpha > 0 and s < 0 that is s / penalty(N):
    a longer sequence divides the same (negative) sum by more, which raises its score, so
    the bound must take the longest length, not the current one. The best alive sum gives
    the largest bound (every beam shares the penalties), and a finished score equal to it
    already ranks first (ties keep the pool's entry).

        finished [-0.9, -1.71], best alive -0.35, penalties 1, 1 -> -1.71 >= -0.35: False
        hf, alpha 1: finished [-0.9, -1.0], best alive -2.4 at l = 2, N = 3
                     bound max(-2.4 / 2, -2.4 / 3) = -0.8 > -1.0: not done (the bound at
                     l alone, -1.2, would have stopped it)
    """
    best_B = alive_logprobs_BW[:, 0]
    bound_B = jnp.maximum(best_B / penalty_now, best_B / penalty_last)
    return finished_scores_BW[:, -1] >= bound_B


def cache_rows(parent_BW):
    """int32[R]: the cache row each new beam continues, row b * W + parent.

        B = 2, W = 2, parent [[0, 1], [1, 1]] -> rows [0, 1, 3, 3]
        (both beams of source 1 continue its beam 1, row 1 * 2 + 1 = 3)
    """
    B, W = parent_BW.shape
    return (jnp.arange(B)[:, None] * W + parent_BW).reshape(B * W)


def follow(cache, parent_BW):
    """The cache after the beams chose their parents: a `models.BeamKVCache` moves only
    its ancestry table (`reorder`); any other cache gathers its rows by parent beam
    (`take_rows` of `cache_rows`)."""
    if hasattr(cache, "reorder"):
        return cache.reorder(parent_BW)
    return cache.take_rows(cache_rows(parent_BW))


def choose(s: BeamState, *, alpha, eos_E, normalization: str = "gnmt",
           constraints: Constraints | None = None, renormalize=False,
           stopping: str | Array = "exact"):
    """Everything one iteration does but the model: the steps listed in the module
    docstring up to `cache_rows`. A source already done takes no finished sequence, and
    the last iteration stops none (at the end every source not done before it takes its
    alive beams, as transformers' last step finishes its W best). Returns (the state after
    it, its `logits` and `cache` still the old ones; parent_BW; token_BW, the tokens the
    new beams feed the model)."""
    B, W, N = s.alive_tokens.shape
    V = s.logits.shape[-1]
    C = max(2, 1 + (0 if eos_E is None else eos_E.shape[0])) * W
    repeated_RV = (None if s.history is None else
                   ngrams.repeated(s.history, constraints.no_repeat_ngram_size, V))
    logprobs_RV = token_logprobs(s.logits, constraints, s.step, N - 1,
                                 repeated_RV=repeated_RV, renormalize=renormalize)
    logprobs_BC, parent_BC, token_BC = top_candidates(logprobs_RV, s.alive_logprobs, C)
    seqs_BCN = extend(s.alive_tokens, parent_BC, token_BC, s.step)
    ending_BC = finishing(token_BC, logprobs_BC, eos_E, W) & ~s.done[:, None]
    finished_scores_BW, finished_tokens_BWN, finished_lengths_BW = merge_finished(
        (s.finished_scores, s.finished_tokens, s.finished_lengths), seqs_BCN, logprobs_BC,
        ending_BC, length=s.step + 1, alpha=alpha, normalization=normalization)
    alive_logprobs_BW, alive_tokens_BWN, parent_BW, token_BW = select_alive(
        logprobs_BC, adds_end(token_BC, eos_E), seqs_BCN, parent_BC, token_BC, W=W)
    stop_B = stops(stopping, finished_scores_BW, alive_logprobs_BW,
                   length_penalty(s.step + 1, alpha, normalization),
                   length_penalty(N, alpha, normalization))
    done_B = s.done | (stop_B & (s.step < N - 1))
    state = s.replace(
        step=s.step + 1, alive_tokens=alive_tokens_BWN, alive_logprobs=alive_logprobs_BW,
        finished_tokens=finished_tokens_BWN, finished_scores=finished_scores_BW,
        finished_lengths=finished_lengths_BW, done=done_B,
        history=(None if s.history is None else ngrams.append(
            s.history.take_rows(cache_rows(parent_BW)), token_BW.reshape(B * W))))
    return state, parent_BW, token_BW


def beam_step(step_fn, s: BeamState, *, alpha, eos_E, normalization: str = "gnmt",
              constraints: Constraints | None = None, renormalize=False,
              stopping: str | Array = "exact") -> BeamState:
    """One iteration: `choose` the new beams, `follow` them in the cache, and the model's
    step on their tokens for the next logits, unless every source is done or this was the
    last token (`decode.loop.maybe_step`: no model call then). Once every source is done an
    iteration changes nothing.

    Only the small search state goes through a `lax.cond`; the cache follows the beams and
    takes the step's new keys and values outside it (with a `decode.SplitStep`), so no
    iteration copies the cache."""
    B, W, N = s.alive_tokens.shape
    searched = s.replace(cache=None)
    keep_BW = jnp.broadcast_to(jnp.arange(W, dtype=jnp.int32)[None, :], (B, W))
    searched, parent_BW, token_BW = lax.cond(
        jnp.all(s.done),
        lambda: (unchanged(searched), keep_BW, jnp.zeros((B, W), jnp.int32)),
        lambda: choose(searched, alpha=alpha, eos_E=eos_E, normalization=normalization,
                       constraints=constraints, renormalize=renormalize, stopping=stopping))
    cache = follow(s.cache, parent_BW)
    skip = jnp.all(searched.done) | (s.step == N - 1)
    logits_RV, cache = maybe_step(step_fn, skip, token_BW.reshape(B * W), cache, s.logits)
    return searched.replace(logits=logits_RV.astype(jnp.float32), cache=cache)


def beam_loop(step_fn, state: BeamState, *, alpha, eos_ids, normalization: str = "gnmt",
              constraints: Constraints | None = None, renormalize=False,
              stopping: str | Array = "exact") -> BeamState:
    """Runs N = alive_tokens.shape[-1] iterations of `beam_step` as a `lax.scan`; an
    iteration where every source is done changes nothing and calls no model.
    `constraints` (with R = B * W rows of min_new_tokens) apply to every step's log-probs;
    None applies none. `stopping` is a `STOPPINGS` name (static) or its index (int32[],
    traced)."""
    check_stopping(stopping)
    N = state.alive_tokens.shape[-1]
    eos_E = None if eos_ids is None else jnp.asarray(sorted(set(eos_ids)), jnp.int32)

    def body(s, _):
        return beam_step(step_fn, s, alpha=alpha, eos_E=eos_E, normalization=normalization,
                         constraints=constraints, renormalize=renormalize,
                         stopping=stopping), None

    state, _ = lax.scan(body, state, None, length=N)
    return state


def finalize(state: BeamState, alpha, pad_id: int, normalization: str = "gnmt"):
    """The alive beams (scored by their length, `step`) of every source not done join the
    finished pool; returns the W best as (tokens_BWN, pad after each end; scores_BW;
    lengths_BW), best first, so a source whose beams never ended still gives W."""
    B, W, N = state.alive_tokens.shape
    alive_scores_BW = jnp.where(
        (state.alive_logprobs > NO_SEQUENCE_SCORE / 2) & ~state.done[:, None],
        state.alive_logprobs / length_penalty(state.step, alpha, normalization),
        NO_SEQUENCE_SCORE)
    scores_BW, tokens_BWN, lengths_BW = top_w(
        jnp.concatenate([state.finished_scores, alive_scores_BW], 1), W,
        jnp.concatenate([state.finished_tokens, state.alive_tokens], 1),
        jnp.concatenate([state.finished_lengths, jnp.full((B, W), state.step)], 1))
    tokens_BWN = jnp.where(jnp.arange(N)[None, None, :] < lengths_BW[:, :, None], tokens_BWN,
                           pad_id)
    return tokens_BWN, scores_BW, lengths_BW
