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

When a source stops is `early_stopping`, one of transformers' three rules
(`beam_steps.STOPPINGS`): "never" (the default) once its W-th best finished score beats
anything an alive beam can still reach (an exact bound, `beam_steps.cannot_improve`);
False (transformers' default) once W have finished and the W-th scores at least the best
alive beam at its current length; True as soon as W have finished. The rule is traced:
changing it never recompiles. A stopped source takes no more finished beams, so with
"hf" normalisation each rule gives transformers' beams; the exact stop's best beam scores
at least as high as the other two's. Once all sources have stopped, the remaining
iterations call no model. At the end the alive beams of the sources not stopped join the
finished pool, so a source whose beams never ended still returns W.

Like `generate`, `beam_search` is a `decode.setup.DecodeCall`: a call is
`_beam_search(*args, **static)` with `args, static = decode.beam_search_arguments(...)`
(a "beam" `decode.DecodeRequest`'s fields, then the keywords, which win), and
`beam_search.lower(...)` returns `_beam_search.lower(*args, **static)`. It runs inside
your own `jax.jit` too.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from decode import checks, ngrams
from decode.beam_steps import (
    NORMALIZATIONS,
    STOPPINGS,
    beam_init,
    beam_loop,
    finalize,
    stopping_rule,
)
from decode.model_fns import (
    BEAM_CACHES,
    decoder_prefix,
    model_step_fn,
    output_pad_id,
    start_decoding,
)
from decode.processors import Constraints
from decode.request import DecodeRequest
from decode.setup import DecodeCall, shared_arguments, with_request
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


@flax.struct.dataclass
class BeamInputs:
    """The traced arguments of one `beam_search` call besides the parameters.

    Attributes:
        prompts: int32[B, P] right-padded prompts (decoder-only) or sources.
        lengths: int32[B] their true lengths.
        alpha: float32[] the length penalty.
        constraints: the token constraints (`decode.processors.Constraints`).
        renormalize: bool[] transformers' renormalize_logits.
        stopping: int32[] the stopping rule, an index in `beam_steps.STOPPINGS`.
    """

    prompts: Int[Array, "B P"]
    lengths: Int[Array, " B"]
    alpha: Float[Array, ""]
    constraints: Constraints
    renormalize: Array
    stopping: Int[Array, ""]


@functools.partial(jax.jit, static_argnames=("model", "beam_size", "max_new_tokens", "cache_len",
                                             "eos_ids", "normalization", "no_repeat",
                                             "constrained", "beam_cache", "cache_sharding",
                                             "kv_cache_dtype"))
def _beam_search(model, params, inputs: BeamInputs, *, beam_size, max_new_tokens, cache_len,
                 eos_ids, normalization, no_repeat, constrained=True, beam_cache="table",
                 cache_sharding=None, kv_cache_dtype="auto") -> BeamOutput:
    """The jitted computation; `beam_search_arguments` gives its (args, static)."""
    W = beam_size
    prompts_BP, lengths_B = inputs.prompts, inputs.lengths
    logits_RV, cache = start_decoding(model, params, prompts_BP, lengths_B, cache_len, beams=W,
                                      beam_cache=beam_cache, cache_sharding=cache_sharding,
                                      kv_cache_dtype=kv_cache_dtype)
    history = None
    if no_repeat:   # row b * W + w is beam w of source b
        prefix_BP, prefix_lengths_B = decoder_prefix(model.config, prompts_BP, lengths_B)
        history = ngrams.start(jnp.repeat(prefix_BP, W, axis=0),
                               jnp.repeat(prefix_lengths_B, W), prefix_BP.shape[1] + max_new_tokens)
    constraints = inputs.constraints.replace(
        min_new_tokens=jnp.repeat(inputs.constraints.min_new_tokens, W))
    state = beam_init(logits_RV, cache, W, max_new_tokens, history)
    state = beam_loop(model_step_fn(model, params, cache_sharding), state, alpha=inputs.alpha,
                      eos_ids=eos_ids, normalization=normalization,
                      constraints=constraints if constrained else None,
                      renormalize=inputs.renormalize, stopping=inputs.stopping)
    return BeamOutput(*finalize(state, inputs.alpha, output_pad_id(model.config), normalization))


def beam_search_arguments(model: nn.Module, params, prompts, lengths,
                          request: DecodeRequest | None = None, **options) -> tuple[tuple, dict]:
    """A `beam_search` call's arguments, checked, as its jitted computation takes them.

    `beam_search(...)` runs `_beam_search(*args, **static)` and `beam_search.lower(...)`
    returns `_beam_search.lower(*args, **static)`; both take exactly these arguments.

    Args:
        model, params, prompts, lengths: as in `decode.generate_arguments`.
        request: a "beam" `decode.DecodeRequest`, or None: its fields are the keywords
            below (`DecodeRequest.beam_options`), and a keyword given too wins over its
            field.
        **options: the keywords:
            max_new_tokens, eos_id, cache_len, kv_cache_dtype: as in
                `decode.generate_arguments` (an int8 cache's scales are reordered with
                its keys and values, whichever `beam_cache`).
            beam_size: W >= 1 (static; default 4); W = 1 with length_penalty 0 is greedy
                decoding.
            length_penalty: alpha, a scalar (default 0.6); traced, so changing it never
                recompiles. "gnmt" takes alpha >= 0 (0: plain sums of log-probs), "hf" any
                alpha (> 0 favours longer sequences, < 0 shorter ones).
            length_normalization: "gnmt" (default): score = log-prob / ((5 + length) / 6)
                ** alpha; "hf": score = log-prob / length ** alpha, transformers' beam
                search. Length counts the new tokens, the end token included (static).
            forced_bos_id, forced_eos_id, banned_ids, min_new_tokens, no_repeat_ngram_size:
                the token constraints, as in `decode.generate_arguments` (traced), applied
                to each step's log-probs before the candidates are chosen.
            renormalize_logits: a log_softmax again after the constraints, transformers'
                renormalize_logits (a traced bool; False by default). It changes the scores
                only where a constraint removed probability mass.
            early_stopping: when a source stops, transformers' values (traced: changing
                it never recompiles): "never" (default), once no alive beam can beat its
                W-th finished one (exact); False, once W beams have finished and the W-th
                scores at least the best alive one at its current length (transformers'
                default); True, once W beams have finished.
            beam_cache: how the beams' keys and values are kept (static): "table"
                (default; `models.BeamKVCache`: they never move, an ancestry table
                follows the beams) or "gathered" (every beam its own cache rows, gathered
                by parent beam each step). The same beams either way; the table is faster
                (`decode.model_fns.BEAM_CACHES`).

    Returns:
        (args, static): `(model, params, BeamInputs)` and the static keywords `beam_size`,
        `max_new_tokens`, `cache_len`, `eos_ids`, `normalization`, `no_repeat`,
        `constrained`, `beam_cache`, `cache_sharding` when the params split their kv
        heads over a mesh, and `kv_cache_dtype` when it is "int8" (both absent otherwise).

    Raises:
        UserError: naming the argument, its value and the limit it breaks (values only
            when concrete). A greedy or sampling request is refused (`decode.generate`).
        TypeError: an unknown keyword.
    """
    return _keyword_arguments(model, params, prompts, lengths,
                              **with_request(request, options, beam=True))


def _keyword_arguments(model: nn.Module, params, prompts, lengths, *, beam_size: int = 4,
                       max_new_tokens: int, length_penalty=0.6,
                       length_normalization: str = "gnmt",
                       eos_id: int | tuple[int, ...] | str | None = "config",
                       forced_bos_id=None, forced_eos_id=None, banned_ids=(), min_new_tokens=0,
                       no_repeat_ngram_size=0, renormalize_logits=False,
                       early_stopping: bool | str = "never", cache_len: int | None = None,
                       beam_cache: str = "table",
                       kv_cache_dtype: str = "auto") -> tuple[tuple, dict]:
    """`beam_search_arguments` on its keywords alone (their defaults are the keyword API's)."""
    cfg = model.config
    shared = shared_arguments(
        model, params, prompts, lengths, max_new_tokens=max_new_tokens, cache_len=cache_len,
        eos_id=eos_id, forced_bos_id=forced_bos_id, forced_eos_id=forced_eos_id,
        banned_ids=banned_ids, min_new_tokens=min_new_tokens,
        no_repeat_ngram_size=no_repeat_ngram_size, kv_cache_dtype=kv_cache_dtype)
    beam_size = check_positive_int(beam_size, "beam_size")
    if beam_cache not in BEAM_CACHES:
        raise UserError(f"beam_cache={beam_cache!r} must be one of {BEAM_CACHES}")
    if length_normalization not in NORMALIZATIONS:
        raise UserError(f"length_normalization={length_normalization!r} must be one of "
                        f"{NORMALIZATIONS}")
    if shared.eos_ids is not None and len(set(shared.eos_ids)) >= cfg.vocab_size:
        raise UserError(f"eos_id {shared.eos_ids} names every token of the vocabulary "
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
    stopping = np.int32(STOPPINGS.index(stopping_rule(early_stopping)))
    inputs = BeamInputs(shared.prompts, shared.lengths, alpha, shared.constraints, renormalize,
                        stopping)
    return (model, params, inputs), {**shared.static, "beam_size": beam_size,
                                     "normalization": length_normalization,
                                     "beam_cache": beam_cache}


beam_search = DecodeCall("beam_search", beam_search_arguments, _beam_search, doc="""\
The `beam_size` best continuations of each prompt (source), best first.

    beams = decode.beam_search(model, params, prompts, lengths, beam_size=4,
                               max_new_tokens=16)
    beams.tokens, beams.scores, beams.lengths    # int32[B, W, N], float32[B, W], int32[B, W]
    beams = decode.beam_search(model, params, prompts, lengths, request)   # strategy "beam"

Args:
    model, params, prompts, lengths: as in `decode.generate` (params on one device or
        sharded over a mesh; the KV cache is then split by kv heads like them).
    request: a "beam" `decode.DecodeRequest` (None: keywords only); a model directory's:
        `decode.DecodeRequest.from_generation(pre.generation, pre.config)`.
    **options: `max_new_tokens` (required, here or in the request), `beam_size`,
        `length_penalty`, `length_normalization`, `eos_id`, `forced_bos_id`,
        `forced_eos_id`, `banned_ids`, `min_new_tokens`, `no_repeat_ngram_size`,
        `renormalize_logits`, `early_stopping`, `cache_len`, `beam_cache`, `kv_cache_dtype`,
        each documented in `decode.beam_search_arguments`, which checks them; each wins
        over the request's field.

Returns:
    A `BeamOutput`.

Raises:
    UserError: naming the argument, its value and the limit it breaks.

`beam_search.lower(...)` takes the same arguments and returns the `jax.stages.Lowered`
computation instead of running it; `beam_search.arguments(...)` is
`decode.beam_search_arguments(...)`.
""")
