"""The decoding loop. It knows nothing about models: it drives any

    step_fn(tokens_B, cache) -> (logits_BV, cache)

or a `SplitStep` (the same step in two parts, see below) from the logits of the first new
token, choosing one token per row and step. Each iteration chooses a token from `logits`,
records it, marks rows that emitted an end token as done, and calls the step for the next
logits, unless every row is done or the last token was just chosen, in which case the
model is not called at all (`lax.cond`).

A `SplitStep` keeps that skip cheap. A `lax.cond` branch that updates a buffer in place,
as a step writes its cache, makes XLA's copy insertion copy the buffer into the branch on
every iteration: the whole cache, as large as the parameters a step reads. A split step
only reads the cache in the branch (`read`), and the loop writes the new slot after it
(`commit`), outside the cond, in place.

Worked example, max_new_tokens=4, eos_ids=(1,), rows choosing 7 1 ... and 5 6 8 9:

    iteration      0      1      2      3
    row 0 token    7      1(eos) 0      0        lengths[0] = 2, logprobs 0 after eos
    row 1 token    5      6      8      9        lengths[1] = 4
    step_fn calls  yes    yes    yes    no (last token)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from decode import ngrams
from decode.processors import (
    Constraints,
    SamplingParams,
    Strategy,
    constrain_logits,
    process_logits,
    select_tokens,
)

StepFn = Callable[[Array, object], tuple[Array, object]]


class SplitStep(NamedTuple):
    """A step in two parts, for a loop that may skip it.

    Attributes:
        read: (tokens_B, cache) -> (logits_BV, update): the next logits, reading the cache
            and writing nothing; `update` is what the step would have written.
        commit: (cache, update, active_B) -> cache: writes `update` and advances the rows
            (only the `active_B` ones).
    """

    read: Callable[[Array, object], tuple[Array, object]]
    commit: Callable[[object, object, Array], object]

    def __call__(self, tokens_B, cache):
        """The whole step, `step_fn`'s contract."""
        logits_BV, update = self.read(tokens_B, cache)
        return logits_BV, self.commit(cache, update, jnp.ones(tokens_B.shape, bool))


def maybe_step(step_fn: StepFn | SplitStep, skip, tokens_B, cache, logits_BV):
    """(logits, cache) after the step on `tokens_B`, or when `skip` (traced bool) the old
    `logits_BV` (never read again) and the cache as it was, without a model call. A
    `SplitStep` reads under the `lax.cond` and commits after it; any other step runs under
    it whole, returning the cache through `unchanged` on the skip branch."""
    if not isinstance(step_fn, SplitStep):
        return lax.cond(skip, lambda: (logits_BV, unchanged(cache)),
                        lambda: step_fn(tokens_B, cache))
    # The read is traced once: its jaxpr gives the skip branch its output shapes and is
    # replayed in the other branch (tracing the model twice doubled the start-up cost).
    read_jaxpr, shapes = jax.make_jaxpr(step_fn.read, return_shape=True)(tokens_B, cache)

    def read():
        out = jax.core.eval_jaxpr(read_jaxpr.jaxpr, read_jaxpr.consts,
                                  *jax.tree.leaves((tokens_B, cache)))
        return jax.tree.unflatten(jax.tree.structure(shapes), out)

    new_logits, update = lax.cond(
        skip, lambda: (logits_BV.astype(shapes[0].dtype), _zeros_like(shapes[1])),
        read)
    active_B = jnp.broadcast_to(~skip, tokens_B.shape)
    return new_logits, step_fn.commit(cache, update, active_B)


def _varying_axes(x) -> frozenset:
    """The mapped axes (inside `shard_map`) over which `x` (an array or a shape) varies."""
    kind = getattr(x, "manual_axis_type", None) or getattr(jax.typeof(x), "manual_axis_type",
                                                           None)
    return frozenset(getattr(kind, "varying", ()) or ())


def _vary(x, axes: frozenset):
    missing = tuple(sorted(axes - _varying_axes(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


def _zeros_like(shapes):
    """Zeros of `shapes` (`jax.ShapeDtypeStruct`s), each varying over the mapped axes its
    shape names: inside `shard_map` a cond's branches must agree on that, and a read of
    rows that differ per device varies."""
    return jax.tree.map(lambda a: _vary(jnp.zeros(a.shape, a.dtype), _varying_axes(a)),
                        shapes)


def varying_alike(tree):
    """`tree` with every array varying over the mapped axes any of them varies over (none
    outside `shard_map`): a loop's carry starts as its body leaves it, when rows that
    differ per device (decoding inside a shard_map train step) meet zeros made in the loop.
    """
    leaves = jax.tree.leaves(tree)
    axes = frozenset().union(*(_varying_axes(x) for x in leaves))
    return jax.tree.map(lambda x: _vary(x, axes), tree) if axes else tree


@flax.struct.dataclass
class LoopState:
    """The loop carry.

    Attributes:
        step: int32[] the index of the token chosen next.
        logits: float32[B, V] the model's logits for that token.
        cache: the model's cache pytree, carried and updated in place.
        rng: the PRNG key, split once per iteration.
        done: bool[B] rows that emitted an end token.
        lengths: int32[B] new tokens per row, the end token included.
        tokens: int32[B, N] chosen tokens, pad after the end token.
        logprobs: float32[B, N] the model's log-probability of each chosen token, 0 after end.
        seen: bool[B, V] tokens seen so far (for the repetition penalty), or None.
        history: each row's decoder sequence (for no_repeat_ngram_size), or None.
    """

    step: Int[Array, ""]
    logits: Float[Array, "B V"]
    cache: object
    rng: jax.Array
    done: Bool[Array, " B"]
    lengths: Int[Array, " B"]
    tokens: Int[Array, "B N"]
    logprobs: Float[Array, "B N"]
    seen: Bool[Array, "B V"] | None
    history: ngrams.NgramHistory | None = None


def unchanged(tree):
    """`tree` as the result of a one-element in-place update of each array.

    The skip branch of a `lax.cond` that carries the KV cache returns it through this
    instead of as is: a branch that returns its operand untouched makes XLA give the
    conditional a fresh output buffer, so the other branch copies the whole cache on every
    step (measured: +60% per decode step on CPU); an in-place update lets both branches
    alias the carried buffer.
    """
    def touch(x):
        if not hasattr(x, "ndim") or x.ndim == 0:
            return x
        start = (0,) * x.ndim
        return lax.dynamic_update_slice(x, lax.dynamic_slice(x, start, (1,) * x.ndim), start)
    return jax.tree.map(touch, tree)


def initial_state(logits_BV, cache, rng, max_new_tokens: int, *, seen_BV=None,
                  history: ngrams.NgramHistory | None = None) -> LoopState:
    """The carry before the first new token, from the prefill's logits and cache."""
    B = logits_BV.shape[0]
    return LoopState(
        step=jnp.zeros((), jnp.int32), logits=logits_BV.astype(jnp.float32), cache=cache,
        rng=rng, done=jnp.zeros((B,), bool), lengths=jnp.zeros((B,), jnp.int32),
        tokens=jnp.zeros((B, max_new_tokens), jnp.int32),
        logprobs=jnp.zeros((B, max_new_tokens), jnp.float32), seen=seen_BV, history=history)


def decode_loop(
    step_fn: StepFn | SplitStep,
    state: LoopState,
    *,
    eos_ids: tuple[int, ...] | None,
    pad_id: int,
    params: SamplingParams,
    strategy: Strategy,
    constraints: Constraints | None = None,
    while_loop: bool = False,
) -> LoopState:
    """Runs the loop for N = state.tokens.shape[1] tokens.

    `lax.scan` by default (fixed trip count, differentiable); with `while_loop=True` a
    `lax.while_loop` that also stops iterating once every row is done. Both give the same
    tokens. `constraints` (forced, banned and end ids before a minimum length; repeated
    n-grams when the state carries a `history`) apply between the repetition penalty and the
    temperature, as in `decode.processors`; None applies none.
    """
    N = state.tokens.shape[1]
    V = state.logits.shape[-1]
    eos_E = None if eos_ids is None else jnp.asarray(eos_ids, jnp.int32)

    def constrain(s: LoopState):
        repeated_BV = (None if s.history is None else
                       ngrams.repeated(s.history, constraints.no_repeat_ngram_size, V))
        return lambda logits_BV: constrain_logits(logits_BV, constraints, s.step, N - 1,
                                                  repeated_BV)

    def body(s: LoopState) -> LoopState:
        rng, sample_rng = jax.random.split(s.rng)
        processed_BV = process_logits(s.logits, s.seen, params, strategy,
                                      None if constraints is None else constrain(s))
        token_B = select_tokens(processed_BV, sample_rng, params, strategy)
        # log_softmax at the chosen token only: no [B, V] array in the loop body.
        logprob_B = (jnp.take_along_axis(s.logits, token_B[:, None], axis=-1)[:, 0]
                     - jax.nn.logsumexp(s.logits, axis=-1))
        token_B = jnp.where(s.done, pad_id, token_B)
        logprob_B = jnp.where(s.done, 0.0, logprob_B)
        lengths = s.lengths + (~s.done).astype(jnp.int32)
        done = s.done if eos_E is None else s.done | jnp.isin(token_B, eos_E)
        seen = s.seen
        if seen is not None:
            seen = seen.at[jnp.arange(seen.shape[0]), token_B].set(True)
        stop = jnp.all(done) | (s.step == N - 1)
        logits, cache = maybe_step(step_fn, stop, token_B, s.cache, s.logits)
        return LoopState(
            step=s.step + 1, logits=logits.astype(jnp.float32), cache=cache, rng=rng,
            done=done, lengths=lengths,
            tokens=lax.dynamic_update_slice(s.tokens, token_B[:, None], (0, s.step)),
            logprobs=lax.dynamic_update_slice(s.logprobs, logprob_B[:, None], (0, s.step)),
            seen=seen,
            history=None if s.history is None else ngrams.append(s.history, token_B, ~s.done))

    state = varying_alike(state)
    if while_loop:
        return lax.while_loop(lambda s: (s.step < N) & ~jnp.all(s.done), body, state)
    state, _ = lax.scan(lambda s, _: (body(s), None), state, None, length=N)
    return state
