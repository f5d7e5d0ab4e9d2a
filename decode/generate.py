"""`generate`: prefill once, then one jitted `lax.scan` over new tokens.

    out = decode.generate(model, params, prompts, lengths, max_new_tokens=64, rng=key,
                          temperature=0.7, top_p=0.9, eos_id=1)
    out = decode.generate(model, params, prompts, lengths, request, rng=key)  # a DecodeRequest

Decoder-only models continue their prompts; encoder-decoder models encode `prompts` as
sources (and project every layer's cross-attention keys/values once), then decode from the
start token. One compilation per (model, batch, padded prompt width, cache length,
max_new_tokens, end ids, strategy, n-gram history on or off, the kv-heads split of sharded
parameters): the sampling values and the token constraints (forced, banned and end ids
before a minimum length) are traced, so new prompts of the same padded shape, new
temperatures and new banned ids never recompile (`bucket_width` and `pad_prompts` keep the
set of widths small).

`generate` is a `decode.setup.DecodeCall`: `generate_arguments` checks a call's arguments
(a request's fields, then the keywords, which win) into the traced `args` and the static
keywords, and `_generate(*args, **static)` is the jitted computation; `generate(...)` runs
it and `generate.lower(...)` lowers it with the same arguments. `generate` also runs inside
your own `jax.jit` and under `jax.grad` (`loop="scan"`): shapes are checked there too,
values only when concrete, and traced sampling values need an explicit `strategy`
(`decode.sampling`).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from decode import ngrams, speculative
from decode.loop import LoopState, decode_loop, initial_state
from decode.model_fns import (  # notebooks import start_decoding from here too
    decoder_prefix,
    model_step_fn,
    output_pad_id,
    start_decoding,
)
from decode.processors import Constraints, SamplingParams, Strategy
from decode.request import DecodeRequest
from decode.sampling import sampling_arguments
from decode.setup import DecodeCall, shared_arguments, with_request
from models.errors import UserError, check_positive_int
from models.masks import length_mask

LOOPS = ("scan", "while")


@flax.struct.dataclass
class DecodeOutput:
    """What `generate` returns (all arrays; detokenise outside jit).

    Attributes:
        tokens: int32[B, N] new tokens; after the end token, the config's pad_id (0 when
            it has none).
        lengths: int32[B] new tokens up to and including the end token.
        logprobs: float32[B, N] the model's log-probability of each chosen token (before any
            processor), 0 after the end token.
        cache_lengths: int32[B] decoder cache slots each row filled (prompt + fed tokens).
        cache_len: the cache's size in slots (static); cache_lengths never exceed it.
        drafted, accepted: int32[B] with a draft model (speculative decoding), the draft
            tokens proposed to each row and those its target accepted; None without one.
    """

    tokens: Int[Array, "B N"]
    lengths: Int[Array, " B"]
    logprobs: Float[Array, "B N"]
    cache_lengths: Int[Array, " B"]
    cache_len: int = flax.struct.field(pytree_node=False, default=0)
    drafted: Int[Array, " B"] | None = None
    accepted: Int[Array, " B"] | None = None


def bucket_width(length: int, minimum: int = 8) -> int:
    """The padded width for a prompt of `length` tokens: the next power of two, at least
    `minimum`. Bucketing bounds the number of compilations to one per bucket."""
    length = check_positive_int(length, "length")
    return max(minimum, 1 << (length - 1).bit_length())


def pad_prompts(token_lists, width: int | None = None, pad_id: int = 0):
    """Right-pads lists of token ids into (prompts int32[B, W], lengths int32[B]); W is
    `width` or the bucket of the longest list."""
    token_lists = [list(t) for t in token_lists]
    if not token_lists or any(len(t) == 0 for t in token_lists):
        raise UserError("pad_prompts needs at least one prompt, and no empty prompt")
    longest = max(len(t) for t in token_lists)
    width = bucket_width(longest) if width is None else width
    if longest > width:
        raise UserError(f"a prompt of {longest} tokens does not fit width={width}")
    prompts = np.full((len(token_lists), width), pad_id, np.int32)
    for b, t in enumerate(token_lists):
        prompts[b, : len(t)] = t
    return prompts, np.array([len(t) for t in token_lists], np.int32)


def _prompt_seen(cfg, prompts_BP, lengths_B):
    """bool[B, V]: the decoder-prompt tokens (the start token for an encoder-decoder), for
    the repetition penalty."""
    prefix_BP, lengths_B = decoder_prefix(cfg, prompts_BP, lengths_B)
    B, P = prefix_BP.shape
    valid_BP = length_mask(lengths_B, P)
    rows_BP = jnp.broadcast_to(jnp.arange(B)[:, None], (B, P))
    return jnp.zeros((B, cfg.vocab_size), bool).at[rows_BP, prefix_BP].max(valid_BP)


@flax.struct.dataclass
class GenerateInputs:
    """The traced arguments of one `generate` call besides the parameters.

    Attributes:
        prompts: int32[B, P] right-padded prompts (decoder-only) or sources.
        lengths: int32[B] their true lengths.
        rng: the PRNG key sampling draws from.
        sampling: the sampling values, [B] each (`decode.processors.SamplingParams`).
        constraints: the token constraints (`decode.processors.Constraints`).
        draft_params: the draft model's parameters (speculative decoding), or None.
    """

    prompts: Int[Array, "B P"]
    lengths: Int[Array, " B"]
    rng: jax.Array
    sampling: SamplingParams
    constraints: Constraints
    draft_params: object = None


@functools.partial(
    jax.jit,
    static_argnames=("model", "max_new_tokens", "cache_len", "eos_ids", "strategy", "loop",
                     "no_repeat", "constrained", "cache_sharding", "draft_model",
                     "draft_tokens", "kv_cache_dtype"))
def _generate(model, params, inputs: GenerateInputs, *, max_new_tokens, cache_len, eos_ids,
              strategy, loop, no_repeat, constrained=True, cache_sharding=None,
              draft_model=None, draft_tokens=0, kv_cache_dtype="auto") -> DecodeOutput:
    """The jitted computation; `generate_arguments` gives its (args, static)."""
    cfg = model.config
    prompts_BP, lengths_B = inputs.prompts, inputs.lengths
    logits_BV, cache = start_decoding(model, params, prompts_BP, lengths_B, cache_len,
                                      cache_sharding=cache_sharding,
                                      kv_cache_dtype=kv_cache_dtype)
    seen = _prompt_seen(cfg, prompts_BP, lengths_B) if strategy.penalty else None
    history = None
    if no_repeat:
        prefix_BP, prefix_lengths_B = decoder_prefix(cfg, prompts_BP, lengths_B)
        history = ngrams.start(prefix_BP, prefix_lengths_B,
                               prefix_BP.shape[1] + max_new_tokens + draft_tokens + 1)
    if draft_model is not None:
        rules = speculative.Rules(
            inputs.sampling, inputs.constraints if constrained else None, strategy=strategy,
            eos_ids=eos_ids, max_new_tokens=max_new_tokens, pad_id=output_pad_id(cfg))
        _, draft_cache = start_decoding(draft_model, inputs.draft_params, prompts_BP,
                                        lengths_B, cache_len, kv_cache_dtype=kv_cache_dtype)
        known = speculative.History(seen, history)
        rng, first_key = jax.random.split(inputs.rng)
        start = speculative.start_state(
            speculative.first_token(logits_BV, known, rules, first_key), (cache, draft_cache),
            known, rules, rng)
        models = speculative.Models(model, params, draft_model, inputs.draft_params)
        s = speculative.speculative_loop(models, start, rules, draft_tokens)
        tokens, logprobs, lengths = speculative.finish(s, rules)
        return DecodeOutput(tokens, lengths, logprobs, s.target_cache.lengths, cache_len,
                            drafted=s.drafted, accepted=s.accepted)
    state: LoopState = decode_loop(
        model_step_fn(model, params, cache_sharding),
        initial_state(logits_BV, cache, inputs.rng, max_new_tokens, seen_BV=seen,
                      history=history),
        eos_ids=eos_ids, pad_id=output_pad_id(cfg), params=inputs.sampling, strategy=strategy,
        constraints=inputs.constraints if constrained else None, while_loop=loop == "while")
    return DecodeOutput(state.tokens, state.lengths, state.logprobs, state.cache.lengths,
                        cache_len)


@functools.cache
def default_rng() -> jax.Array:
    """`jax.random.key(0)`, the key of a call given none, made once: making it is a
    dispatch of its own (0.6 ms) on every greedy call otherwise."""
    return jax.random.key(0)


def generate_arguments(model: nn.Module, params, prompts, lengths,
                       request: DecodeRequest | None = None, **options) -> tuple[tuple, dict]:
    """A `generate` call's arguments, checked, as its jitted computation takes them.

    `generate(...)` runs `_generate(*args, **static)` and `generate.lower(...)` returns
    `_generate.lower(*args, **static)`; both take exactly these arguments. Two calls whose
    `static` dicts are equal and whose `args` have the same shapes share one compilation.

    Args:
        model: a `models.build(...)` module (static).
        params: its parameters (traced; `jax.grad` may differentiate with respect to them),
            on one device or sharded over a mesh (see `generate`).
        prompts: int[B, P] right-padded prompts (decoder-only) or sources (encoder-decoder,
            padded with the config's pad id).
        lengths: int[B] their true lengths.
        request: a "greedy" or "sample" `decode.DecodeRequest`, or None: its fields are
            the keywords below (`DecodeRequest.generate_options`), and a keyword given too
            wins over its field.
        **options: the keywords:
            max_new_tokens: N, the tokens to generate per row (static; required, from the
                request or as a keyword).
            rng: PRNG key, required when sampling (any temperature > 0, or strategy.sample);
                default `jax.random.key(0)`, unused by greedy decoding.
            temperature: 0 is greedy, > 0 samples at that temperature (default 0).
            top_k: keep the k best tokens (0 off). top_p: the smallest set of most probable
                tokens with mass >= p (1 off). min_p: tokens with probability >= min_p x the
                top one (0 off). repetition_penalty: CTRL's penalty on tokens already seen
                (1 off). These five are each a scalar or one value per row, and traced.
            eos_id: "config" (default: the model config's end token, none if it has none),
                an end id, several, or None to always generate N tokens (static).
            forced_bos_id: the first new token is this id (None: not forced).
            forced_eos_id: the last new token, index N - 1, is this id (None: not forced),
                as transformers forces it at max_length - 1.
            banned_ids: token ids never generated (a sequence of ints; () none).
            min_new_tokens: the end ids are banned until a row has this many new tokens (a
                scalar or one per row; 0 off).
            no_repeat_ngram_size: n > 0: no n-gram occurs twice in a row's decoder sequence
                (a decoder-only model's prompt and new tokens; an encoder-decoder's start
                token and new tokens), as transformers' NoRepeatNGramLogitsProcessor (0 off).
                These five are traced (checked when concrete; a traced id of -1 is none), so
                changing them never recompiles; the n-gram history is compiled in only when
                no_repeat_ngram_size is traced or > 0. They apply after the repetition
                penalty and before the temperature (`decode.processors` gives the order).
            cache_len: decoder cache slots; default the decoder prompt width + N (static).
            kv_cache_dtype: the KV cache's (static): "auto" (default: the config's dtype)
                or "int8" (int8 keys and values with a scale per token per kv head,
                `models.cache_int8`; a draft model's cache too).
            loop: "scan" (default; differentiable) or "while" (stops once all rows are done;
                speculative decoding's, and its default).
            draft_model, draft_params, draft_tokens: speculative decoding (see `generate`):
                a draft module of the model's family and vocabulary (static), its
                parameters (traced), and the k tokens it proposes per iteration (static,
                default 4).
            strategy: the processors to compile (a `decode.Strategy`, static; not the
                request's strategy name). Default: the ones the sampling values switch on,
                which needs them concrete; pass it when a sampling value is traced (see
                `decode.sampling`).

    Returns:
        (args, static): the traced arguments `(model, params, GenerateInputs)` and the
        static keywords `max_new_tokens`, `cache_len`, `eos_ids`, `strategy`, `loop`,
        `no_repeat`, `constrained`, `cache_sharding` when the params split their kv
        heads over a mesh (`decode.placement.cache_sharding`; absent otherwise), and
        `kv_cache_dtype` when it is "int8" (absent otherwise).

    Raises:
        UserError: naming the argument, its value and the limit it breaks. Shapes and
            dtypes are always checked; values (token ids, lengths, sampling ranges) when
            they are concrete. A beam-search request is refused (`decode.beam_search`).
        TypeError: an unknown keyword.
    """
    return _keyword_arguments(model, params, prompts, lengths,
                              **with_request(request, options, beam=False))


def _keyword_arguments(model: nn.Module, params, prompts, lengths, *, max_new_tokens: int,
                       rng: jax.Array | None = None, temperature=0.0, top_k=0, top_p=1.0,
                       min_p=0.0, repetition_penalty=1.0,
                       eos_id: int | tuple[int, ...] | str | None = "config",
                       forced_bos_id=None, forced_eos_id=None, banned_ids=(), min_new_tokens=0,
                       no_repeat_ngram_size=0, cache_len: int | None = None,
                       kv_cache_dtype: str = "auto",
                       loop: str | None = None, strategy: Strategy | None = None,
                       draft_model: nn.Module | None = None, draft_params=None,
                       draft_tokens: int = 4) -> tuple[tuple, dict]:
    """`generate_arguments` on its keywords alone (their defaults are the keyword API's)."""
    shared = shared_arguments(
        model, params, prompts, lengths, max_new_tokens=max_new_tokens, cache_len=cache_len,
        eos_id=eos_id, forced_bos_id=forced_bos_id, forced_eos_id=forced_eos_id,
        banned_ids=banned_ids, min_new_tokens=min_new_tokens,
        no_repeat_ngram_size=no_repeat_ngram_size, kv_cache_dtype=kv_cache_dtype)
    if loop is not None and loop not in LOOPS:
        raise UserError(f"loop={loop!r} must be one of {LOOPS}")
    draft = {}
    if draft_model is not None:
        draft = _check_draft(model, draft_model, draft_params, draft_tokens,
                             shared.static["cache_len"])
        if loop == "scan":
            raise UserError("loop='scan' is not speculative decoding's loop: with a "
                            "draft_model it is a while loop (not differentiable); leave loop "
                            "unset or pass 'while'")
    loop = loop or ("while" if draft else "scan")
    sampling, strategy = sampling_arguments(
        model.config, shared.prompts.shape[0], strategy, temperature=temperature, top_k=top_k,
        top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty)
    if strategy.sample and rng is None:
        raise UserError("rng is required when temperature > 0 (sampling: strategy.sample)")
    rng = default_rng() if rng is None else rng
    inputs = GenerateInputs(shared.prompts, shared.lengths, rng, sampling, shared.constraints,
                            draft_params=draft_params if draft else None)
    return (model, params, inputs), {**shared.static, "strategy": strategy, "loop": loop,
                                     **draft}


def _check_draft(model, draft_model, draft_params, draft_tokens, cache_len: int) -> dict:
    """The static keywords of speculative decoding, its arguments checked: a draft of the
    target's kind and vocabulary (an encoder-decoder's with its start token), with room
    for the decode's positions, its parameters, and k >= 1 draft tokens."""
    cfg, dcfg = model.config, getattr(draft_model, "config", None)
    if dcfg is None or not isinstance(draft_model, nn.Module):
        raise UserError(f"draft_model must be a models.build(...) module, got "
                        f"{type(draft_model).__name__}")
    if dcfg.architecture != cfg.architecture:
        raise UserError(f"draft_model is {dcfg.architecture}, the model {cfg.architecture}: "
                        "the draft must be of the same family")
    if dcfg.vocab_size != cfg.vocab_size:
        raise UserError(f"draft_model has vocab_size={dcfg.vocab_size}, the model "
                        f"{cfg.vocab_size}: the draft must share the model's vocabulary")
    if cfg.is_encoder_decoder and dcfg.bos_id != cfg.bos_id:
        raise UserError(f"draft_model starts decoding from bos_id={dcfg.bos_id}, the model "
                        f"from {cfg.bos_id}")
    if cache_len > dcfg.max_len:
        raise UserError(f"the decode needs {cache_len} positions, beyond the draft_model's "
                        f"max_len {dcfg.max_len}")
    if draft_params is None:
        raise UserError("draft_model needs draft_params (its parameters)")
    return {"draft_model": draft_model,
            "draft_tokens": check_positive_int(draft_tokens, "draft_tokens")}


generate = DecodeCall("generate", generate_arguments, _generate, doc="""\
Autoregressive decoding with a KV cache, as one jitted computation.

    out = decode.generate(model, params, prompts, lengths, max_new_tokens=16)
    out.tokens, out.lengths, out.logprobs        # int32[B, N], int32[B], float32[B, N]
    out = decode.generate(model, params, prompts, lengths, request, rng=key)

Args:
    model: a `models.build(...)` module; params: its parameters, on one device or
        sharded over a mesh: `jax.device_put(params, models.axes.param_shardings(model,
        mesh))` with a tensor axis splits the heads, the MLP and the vocabulary, and
        the KV cache is then split by kv heads the same way (`decode.placement`). The
        tokens are the single-device ones; the log-probs match to float rounding.
    prompts: int[B, P] right-padded prompts (decoder-only) or sources (encoder-decoder);
        lengths: int[B] their true lengths.
    request: a "greedy" or "sample" `decode.DecodeRequest` (None: keywords only); a model
        directory's: `decode.DecodeRequest.from_generation(pre.generation, pre.config)`.
    **options: `max_new_tokens` (required, here or in the request), `rng`,
        `temperature`, `top_k`, `top_p`, `min_p`, `repetition_penalty`, `eos_id`,
        `forced_bos_id`, `forced_eos_id`, `banned_ids`, `min_new_tokens`,
        `no_repeat_ngram_size`, `cache_len`, `kv_cache_dtype`, `loop`, `strategy`, each
        documented in `decode.generate_arguments`, which checks them; each wins over the
        request's field. Speculative decoding (`decode.speculative`): `draft_model` (a smaller
        `models.build(...)` module of the same family and vocabulary), `draft_params`, and
        `draft_tokens` (k, default 4): the draft proposes k tokens, the model checks them
        in one call; greedy gives the model's own greedy tokens, sampling its own
        distribution. Its loop is a while loop (not differentiable).

Returns:
    A `DecodeOutput`.

Raises:
    UserError: naming the argument, its value and the limit it breaks.

`generate.lower(...)` takes the same arguments and returns the `jax.stages.Lowered`
computation instead of running it (ahead-of-time compilation, cost analysis, or a look
at the one `while` loop the scan becomes); `generate.arguments(...)` is
`decode.generate_arguments(...)`. `generate` may be called inside your own `jax.jit` and
under `jax.grad`.
""")
