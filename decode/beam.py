"""Beam search with a GNMT length penalty, as one jitted `lax.scan`.

Each iteration expands the W alive beams of every source by the whole vocabulary, keeps
the 2W best continuations, moves those among the W best that end in an end token into the
finished pool (scored by log-prob / ((5 + length) / 6) ** alpha, Wu et al. 2016) and keeps
the W best others alive. Only the self-attention cache is reordered (gathered by parent
beam); the encoder's cross-attention keys/values stay one row per source, shared by its
beams.

A source stops early once its W-th best finished score beats anything an alive beam can
still reach (its log-prob can only fall; the penalty at most grows to that of the maximum
length); once all have stopped, the remaining iterations call no model. At the end the
alive beams join the finished pool, so a source whose beams never ended still returns W.

Rows of the cache are beam-major within a source: row b * W + w is beam w of source b.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float, Int

from decode import checks
from decode.generate import model_step_fn, start_decoding
from decode.loop import unchanged

NEG = -1.0e30  # "no sequence here"; finite so that sums and divisions stay finite


def gnmt_penalty(length, alpha: float):
    """GNMT: ((5 + length) / 6) ** alpha; alpha = 0 gives 1 (plain log-prob sums)."""
    return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


@flax.struct.dataclass
class BeamOutput:
    """What `beam_search` returns.

    Attributes:
        tokens: int32[B, W, N] new tokens of each beam, best first, pad (0) after the end.
        scores: float32[B, W] length-penalised log-probabilities, best first.
        lengths: int32[B, W] new tokens of each beam, the end token included.
    """

    tokens: Int[Array, "B W N"]
    scores: Float[Array, "B W"]
    lengths: Int[Array, "B W"]


@flax.struct.dataclass
class BeamState:
    """The beam-search carry.

    Attributes:
        step: int32[] tokens chosen so far (the length of every alive beam).
        logits: float32[B*W, V] next-token logits of the alive beams.
        cache: the model cache, B*W self-attention rows.
        alive_tokens: int32[B, W, N]; alive_logprobs: float32[B, W] (NEG: empty slot).
        finished_tokens: int32[B, W, N]; finished_scores: float32[B, W] (NEG: empty);
        finished_lengths: int32[B, W].
        done: bool[B] sources whose W finished beams can no longer change.
    """

    step: Int[Array, ""]
    logits: Float[Array, "BW V"]
    cache: object
    alive_tokens: Int[Array, "B W N"]
    alive_logprobs: Float[Array, "B W"]
    finished_tokens: Int[Array, "B W N"]
    finished_scores: Float[Array, "B W"]
    finished_lengths: Int[Array, "B W"]
    done: Array


def _top(scores_BC, W, *arrays_BC):
    """The W best of C candidates by score, best first, and each [B, C, ...] array
    gathered to [B, W, ...] in the same order."""
    scores_BW, idx_BW = lax.top_k(scores_BC, W)

    def gather(a):
        return jnp.take_along_axis(a, idx_BW.reshape(idx_BW.shape + (1,) * (a.ndim - 2)), axis=1)

    return (scores_BW,) + tuple(gather(a) for a in arrays_BC)


def beam_loop(step_fn, state: BeamState, *, alpha, eos_ids) -> BeamState:
    """Runs N = alive_tokens.shape[-1] beam-search iterations (see the module docstring)."""
    B, W, N = state.alive_tokens.shape
    eos_E = None if eos_ids is None else jnp.asarray(eos_ids, jnp.int32)
    max_penalty = gnmt_penalty(N, alpha)

    def expand(s: BeamState) -> BeamState:
        V = s.logits.shape[-1]
        logp_BWV = jax.nn.log_softmax(s.logits, axis=-1).reshape(B, W, V)
        total_BC = (s.alive_logprobs[:, :, None] + logp_BWV).reshape(B, W * V)
        cand_BC, flat_BC = lax.top_k(total_BC, 2 * W)                  # C = 2W candidates
        parent_BC, token_BC = flat_BC // V, (flat_BC % V).astype(jnp.int32)
        seqs_BCN = jnp.take_along_axis(s.alive_tokens, parent_BC[:, :, None], axis=1)
        seqs_BCN = lax.dynamic_update_slice(seqs_BCN, token_BC[:, :, None], (0, 0, s.step))
        # A candidate finishes only if it ranks among the W best, i.e. it would have taken a
        # beam: then beam_size=1 is exactly greedy decoding.
        in_top_w_C = jnp.arange(2 * W) < W
        is_eos_BC = ((jnp.isin(token_BC, eos_E) if eos_E is not None
                      else jnp.zeros_like(token_BC, bool))
                     & (cand_BC > NEG / 2) & in_top_w_C[None, :])
        # Finished: old pool and the candidates that just ended, best W.
        new_scores_BC = jnp.where(is_eos_BC, cand_BC / gnmt_penalty(s.step + 1, alpha), NEG)
        fin_scores, fin_tokens, fin_lengths = _top(
            jnp.concatenate([s.finished_scores, new_scores_BC], 1), W,
            jnp.concatenate([s.finished_tokens, seqs_BCN], 1),
            jnp.concatenate([s.finished_lengths, jnp.full(cand_BC.shape, s.step + 1)], 1))
        # Alive: the best W candidates that did not end.
        alive_logprobs, alive_tokens, alive_parent = _top(
            jnp.where(is_eos_BC, NEG, cand_BC), W, seqs_BCN, parent_BC[:, :, None])
        rows = (jnp.arange(B)[:, None] * W + alive_parent[:, :, 0]).reshape(B * W)
        last_BW = lax.dynamic_slice_in_dim(alive_tokens, s.step, 1, axis=2)[:, :, 0]
        # Stop a source when no alive beam can beat its W-th finished one.
        best_alive = alive_logprobs[:, 0] / max_penalty
        done = s.done | (fin_scores[:, -1] >= best_alive)
        logits, cache = lax.cond(
            jnp.all(done) | (s.step == N - 1),
            lambda: (s.logits, s.cache.take_rows(rows)),
            lambda: step_fn(last_BW.reshape(B * W), s.cache.take_rows(rows)))
        return BeamState(s.step + 1, logits.astype(jnp.float32), cache, alive_tokens,
                         alive_logprobs, fin_tokens, fin_scores, fin_lengths, done)

    def body(s, _):
        return lax.cond(jnp.all(s.done), lambda: unchanged(s), lambda: expand(s)), None

    state, _ = lax.scan(body, state, None, length=N)
    return state


def finalize(state: BeamState, alpha, pad_id: int) -> BeamOutput:
    """Merges the alive beams into the finished pool and returns the W best, best first."""
    B, W, N = state.alive_tokens.shape
    alive_scores = jnp.where(state.alive_logprobs > NEG / 2,
                             state.alive_logprobs / gnmt_penalty(state.step, alpha), NEG)
    scores, tokens, lengths = _top(
        jnp.concatenate([state.finished_scores, alive_scores], 1), W,
        jnp.concatenate([state.finished_tokens, state.alive_tokens], 1),
        jnp.concatenate([state.finished_lengths, jnp.full((B, W), state.step)], 1))
    tokens = jnp.where(jnp.arange(N)[None, None, :] < lengths[:, :, None], tokens, pad_id)
    return BeamOutput(tokens, scores, lengths)


@functools.partial(jax.jit, static_argnames=("model", "beam_size", "max_new_tokens", "cache_len",
                                             "eos_ids"))
def _beam_search(model, params, prompts_BP, lengths_B, alpha, *, beam_size, max_new_tokens,
                 cache_len, eos_ids) -> BeamOutput:
    B, W, N = prompts_BP.shape[0], beam_size, max_new_tokens
    logits, cache = start_decoding(model, params, prompts_BP, lengths_B, cache_len, beams=W)
    # Beams start identical: only beam 0 is alive, so the first expansion has no repeats.
    alive_logprobs = jnp.where(jnp.arange(W)[None, :] == 0, 0.0, NEG) * jnp.ones((B, 1))
    state = BeamState(
        step=jnp.zeros((), jnp.int32), logits=logits.astype(jnp.float32), cache=cache,
        alive_tokens=jnp.zeros((B, W, N), jnp.int32), alive_logprobs=alive_logprobs,
        finished_tokens=jnp.zeros((B, W, N), jnp.int32), finished_scores=jnp.full((B, W), NEG),
        finished_lengths=jnp.zeros((B, W), jnp.int32), done=jnp.zeros((B,), bool))
    state = beam_loop(model_step_fn(model, params), state, alpha=alpha, eos_ids=eos_ids)
    return finalize(state, alpha, model.config.pad_id)


def beam_search(
    model: nn.Module,
    params,
    prompts,
    lengths,
    *,
    beam_size: int = 4,
    max_new_tokens: int,
    length_penalty: float = 0.6,
    eos_id: int | tuple[int, ...] | None = 1,
    cache_len: int | None = None,
) -> BeamOutput:
    """The `beam_size` best continuations of each prompt (source), best first.

    Args:
        model, params, prompts, lengths, max_new_tokens, eos_id, cache_len: as `generate`.
        beam_size: W >= 1; W = 1 with length_penalty 0 is greedy decoding.
        length_penalty: GNMT alpha >= 0 (0: plain sums of log-probs); traced, so changing
            it never recompiles.

    Returns:
        A `BeamOutput`.
    """
    cfg = model.config
    prompts, lengths = checks.check_prompts(cfg, prompts, lengths)
    beam_size = checks.check_positive_int(beam_size, "beam_size")
    max_new_tokens = checks.check_positive_int(max_new_tokens, "max_new_tokens")
    cache_len = checks.check_cache_len(cfg, prompts.shape[1], max_new_tokens, cache_len)
    eos_ids = checks.check_eos(cfg, eos_id)
    alpha = np.float32(length_penalty)
    checks.check_in_range(np.array([alpha]), "length_penalty", 0.0, np.inf, hi_open=True)
    return _beam_search(model, params, prompts, lengths, alpha, beam_size=beam_size,
                        max_new_tokens=max_new_tokens, cache_len=cache_len, eos_ids=eos_ids)
