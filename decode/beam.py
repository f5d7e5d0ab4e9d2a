"""`beam_search`: the W best continuations with a length penalty, one jitted `lax.scan`.

    beams = decode.beam_search(model, params, prompts, lengths, beam_size=4,
                               max_new_tokens=64, length_penalty=0.6, eos_id=1)

Each iteration expands the W alive beams of every source by the whole vocabulary, keeps
the 2W best continuations (more with several end ids), moves those among the W best that
end in an end token into the finished pool (scored by log-prob / ((5 + length) / 6) **
alpha, Wu et al. 2016, or with `length_normalization="hf"` log-prob / length ** alpha, as
transformers does) and keeps the W best that add no end token alive; `decode.beam_steps`
names each step and works through an example. The token constraints (forced, banned and
end ids before a minimum length, repeated n-grams) apply to each step's log-probs before
the candidates are chosen, as in transformers' beam search. Only the self-attention cache
is reordered (gathered by parent beam); the encoder's cross-attention keys/values stay one
row per source, shared by its beams.

A source stops once its W-th best finished score beats anything an alive beam can still
reach (an exact bound, `beam_steps.cannot_improve`; transformers' `early_stopping=True`
stops as soon as W beams have finished, so the best beam here scores at least as high as
transformers'); once all have stopped, the remaining iterations call no model. At the end the alive
beams join the finished pool, so a source whose beams never ended still returns W.

Like `generate`, a call is `_beam_search(*args, **static)` with
`args, static = decode.beam_search_arguments(...)`, and `beam_search.lower(...)` returns
`_beam_search.lower(*args, **static)`. It runs inside your own `jax.jit` too.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from decode import checks, ngrams, placement
from decode.beam_steps import NORMALIZATIONS, beam_init, beam_loop, finalize
from decode.model_fns import decoder_prefix, model_step_fn, output_pad_id, start_decoding
from decode.processors import Constraints
from models.errors import UserError, check_positive_int


@flax.struct.dataclass
class BeamOutput:
    """What `beam_search` returns.

    Attributes:
        tokens: int32[B, W, N] new tokens of each beam, best first; after the end, the
            config's pad_id (0 when it has none).
        scores: float32[B, W] length-penalised log-probabilities, best first (sums of the
            log-probs after the constraints: a forced token adds 0).
        lengths: int32[B, W] new tokens of each beam, the end token included.
    """

    tokens: Int[Array, "B W N"]
    scores: Float[Array, "B W"]
    lengths: Int[Array, "B W"]


@functools.partial(jax.jit, static_argnames=("model", "beam_size", "max_new_tokens", "cache_len",
                                             "eos_ids", "normalization", "no_repeat",
                                             "cache_sharding"))
def _beam_search(model, params, prompts_BP, lengths_B, alpha, constraints: Constraints,
                 renormalize, *, beam_size, max_new_tokens, cache_len, eos_ids, normalization,
                 no_repeat, cache_sharding=None) -> BeamOutput:
    """The jitted computation; `beam_search_arguments` gives its (args, static)."""
    W = beam_size
    logits_RV, cache = start_decoding(model, params, prompts_BP, lengths_B, cache_len, beams=W,
                                      cache_sharding=cache_sharding)
    history = None
    if no_repeat:   # row b * W + w is beam w of source b
        prefix_BP, prefix_lengths_B = decoder_prefix(model.config, prompts_BP, lengths_B)
        history = ngrams.start(jnp.repeat(prefix_BP, W, axis=0),
                               jnp.repeat(prefix_lengths_B, W), prefix_BP.shape[1] + max_new_tokens)
    constraints = constraints.replace(min_new_tokens=jnp.repeat(constraints.min_new_tokens, W))
    state = beam_init(logits_RV, cache, W, max_new_tokens, history)
    state = beam_loop(model_step_fn(model, params, cache_sharding), state, alpha=alpha,
                      eos_ids=eos_ids, normalization=normalization, constraints=constraints,
                      renormalize=renormalize)
    return BeamOutput(*finalize(state, alpha, output_pad_id(model.config), normalization))


def beam_search_arguments(
    model: nn.Module,
    params,
    prompts,
    lengths,
    *,
    beam_size: int = 4,
    max_new_tokens: int,
    length_penalty=0.6,
    length_normalization: str = "gnmt",
    eos_id: int | tuple[int, ...] | str | None = "config",
    forced_bos_id=None,
    forced_eos_id=None,
    banned_ids=(),
    min_new_tokens=0,
    no_repeat_ngram_size=0,
    renormalize_logits=False,
    cache_len: int | None = None,
) -> tuple[tuple, dict]:
    """A `beam_search` call's arguments, checked, as its jitted computation takes them.

    `beam_search(...)` runs `_beam_search(*args, **static)` and `beam_search.lower(...)`
    returns `_beam_search.lower(*args, **static)`; both take exactly these arguments.

    Args:
        model, params, prompts, lengths, max_new_tokens, eos_id, cache_len: as in
            `decode.generate_arguments`.
        beam_size: W >= 1 (static); W = 1 with length_penalty 0 is greedy decoding.
        length_penalty: alpha, a scalar; traced, so changing it never recompiles. "gnmt"
            takes alpha >= 0 (0: plain sums of log-probs), "hf" any alpha (> 0 favours
            longer sequences, < 0 shorter ones).
        length_normalization: "gnmt" (default): score = log-prob / ((5 + length) / 6) **
            alpha; "hf": score = log-prob / length ** alpha, transformers' beam search.
            Length counts the new tokens, the end token included (static).
        forced_bos_id, forced_eos_id, banned_ids, min_new_tokens, no_repeat_ngram_size: the
            token constraints, as in `decode.generate_arguments` (traced), applied to each
            step's log-probs before the candidates are chosen.
        renormalize_logits: a log_softmax again after the constraints, transformers'
            renormalize_logits (a traced bool; False by default). It changes the scores only
            where a constraint removed probability mass.

    Returns:
        (args, static): `(model, params, prompts int32[B, P], lengths int32[B], alpha
        float32[], Constraints, renormalize bool[])` and the static keywords `beam_size`,
        `max_new_tokens`, `cache_len`, `eos_ids`, `normalization`, `no_repeat`, and
        `cache_sharding` when the params split their kv heads over a mesh (absent
        otherwise).

    Raises:
        UserError: naming the argument, its value and the limit it breaks (values only
            when concrete).
    """
    cfg = model.config
    common = checks.check_common(cfg, prompts, lengths, max_new_tokens=max_new_tokens,
                                 cache_len=cache_len, eos_id=eos_id)
    beam_size = check_positive_int(beam_size, "beam_size")
    if length_normalization not in NORMALIZATIONS:
        raise UserError(f"length_normalization={length_normalization!r} must be one of "
                         f"{NORMALIZATIONS}")
    if common.eos_ids is not None and len(set(common.eos_ids)) >= cfg.vocab_size:
        raise UserError(f"eos_id {common.eos_ids} names every token of the vocabulary "
                         f"(vocab_size={cfg.vocab_size}): beam search needs one that is not an end")
    alpha = checks.as_array(length_penalty)
    if alpha.shape != () or not jnp.issubdtype(alpha.dtype, jnp.number):
        raise UserError(f"length_penalty must be a number, got {length_penalty!r}")
    alpha = alpha.astype(np.float32)
    if length_normalization == "gnmt":
        checks.check_in_range(alpha, "length_penalty", 0.0, np.inf, hi_open=True)
    else:
        checks.check_in_range(alpha, "length_penalty", -np.inf, np.inf, lo_open=True,
                              hi_open=True)
    renormalize = checks.as_array(renormalize_logits)
    if renormalize.shape != () or renormalize.dtype != bool:
        raise UserError(f"renormalize_logits must be a bool, got {renormalize_logits!r}")
    constraints, no_repeat = checks.check_constraints(
        cfg, common.prompts.shape[0], common.eos_ids, forced_bos_id=forced_bos_id,
        forced_eos_id=forced_eos_id, banned_ids=banned_ids, min_new_tokens=min_new_tokens,
        no_repeat_ngram_size=no_repeat_ngram_size)
    static = dict(beam_size=beam_size, max_new_tokens=common.max_new_tokens,
                  cache_len=common.cache_len, eos_ids=common.eos_ids,
                  normalization=length_normalization, no_repeat=no_repeat)
    return ((model, params, common.prompts, common.lengths, alpha, constraints, renormalize),
            placement.with_cache_sharding(static, params))


def beam_search(model: nn.Module, params, prompts, lengths, **options) -> BeamOutput:
    """The `beam_size` best continuations of each prompt (source), best first.

        beams = decode.beam_search(model, params, prompts, lengths, beam_size=4,
                                   max_new_tokens=16)
        beams.tokens, beams.scores, beams.lengths    # int32[B, W, N], float32[B, W], int32[B, W]

    Args:
        model, params, prompts, lengths: as in `decode.generate` (params on one device or
            sharded over a mesh; the KV cache is then split by kv heads like them).
        **options: `max_new_tokens` (required), `beam_size`, `length_penalty`,
            `length_normalization`, `eos_id`, `forced_bos_id`, `forced_eos_id`, `banned_ids`,
            `min_new_tokens`, `no_repeat_ngram_size`, `renormalize_logits`, `cache_len`, each
            documented in `decode.beam_search_arguments`, which checks them. A model
            directory's defaults for them: `models.load(path).generation
            .beam_options(config)`.

    Returns:
        A `BeamOutput`.

    Raises:
        UserError: naming the argument, its value and the limit it breaks.

    `beam_search.lower(...)` takes the same arguments and returns the `jax.stages.Lowered`
    computation instead of running it.
    """
    args, static = beam_search_arguments(model, params, prompts, lengths, **options)
    return _beam_search(*args, **static)


def _lower(model: nn.Module, params, prompts, lengths, **options) -> jax.stages.Lowered:
    """`beam_search`'s computation for these arguments (the same ones), lowered, not run."""
    args, static = beam_search_arguments(model, params, prompts, lengths, **options)
    return _beam_search.lower(*args, **static)


beam_search.lower = _lower
