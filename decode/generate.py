"""`generate`: prefill once, then one jitted `lax.scan` over new tokens.

    out = decode.generate(model, params, prompts, lengths, max_new_tokens=64, rng=key,
                          temperature=0.7, top_p=0.9, eos_id=1)

Decoder-only models continue their prompts; encoder-decoder models encode `prompts` as
sources (and project every layer's cross-attention keys/values once), then decode from the
start token. One compilation per (model, batch, padded prompt width, cache length,
max_new_tokens, end ids, strategy): the sampling values themselves are traced, so new
prompts of the same padded shape and new temperatures never recompile (`bucket_width`
and `pad_prompts` keep the set of widths small).
"""

from __future__ import annotations

import functools
import inspect

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from decode import checks
from decode.loop import LoopState, decode_loop, initial_state
from decode.processors import SamplingParams, Strategy
from models import KVCache

LOOPS = ("scan", "while")


@flax.struct.dataclass
class DecodeOutput:
    """What `generate` returns (all arrays; detokenise outside jit).

    Attributes:
        tokens: int32[B, N] new tokens, pad (0) after the end token.
        lengths: int32[B] new tokens up to and including the end token.
        logprobs: float32[B, N] the model's log-probability of each chosen token (before any
            processor), 0 after the end token.
        cache_lengths: int32[B] decoder cache slots each row filled (prompt + fed tokens).
        cache_len: the cache's size in slots (static); cache_lengths never exceed it.
    """

    tokens: Int[Array, "B N"]
    lengths: Int[Array, " B"]
    logprobs: Float[Array, "B N"]
    cache_lengths: Int[Array, " B"]
    cache_len: int = flax.struct.field(pytree_node=False, default=0)


def bucket_width(length: int, minimum: int = 8) -> int:
    """The padded width for a prompt of `length` tokens: the next power of two, at least
    `minimum`. Bucketing bounds the number of compilations to one per bucket."""
    length = checks.check_positive_int(length, "length")
    return max(minimum, 1 << (length - 1).bit_length())


def pad_prompts(token_lists, width: int | None = None, pad_id: int = 0):
    """Right-pads lists of token ids into (prompts int32[B, W], lengths int32[B]); W is
    `width` or the bucket of the longest list."""
    token_lists = [list(t) for t in token_lists]
    if not token_lists or any(len(t) == 0 for t in token_lists):
        raise ValueError("pad_prompts needs at least one prompt, and no empty prompt")
    longest = max(len(t) for t in token_lists)
    width = bucket_width(longest) if width is None else width
    if longest > width:
        raise ValueError(f"a prompt of {longest} tokens does not fit width={width}")
    prompts = np.full((len(token_lists), width), pad_id, np.int32)
    for b, t in enumerate(token_lists):
        prompts[b, : len(t)] = t
    return prompts, np.array([len(t) for t in token_lists], np.int32)


def sampling_arguments(config, batch, temperature, top_k, top_p, min_p, repetition_penalty):
    """Checks the sampling values; returns them as traced [B] arrays and the static flags."""
    t = checks.per_row(temperature, "temperature", batch, np.float32)
    k = checks.per_row(top_k, "top_k", batch, np.int32)
    p = checks.per_row(top_p, "top_p", batch, np.float32)
    m = checks.per_row(min_p, "min_p", batch, np.float32)
    r = checks.per_row(repetition_penalty, "repetition_penalty", batch, np.float32)
    checks.check_in_range(t, "temperature", 0.0, np.inf)
    checks.check_in_range(k, "top_k", 0, config.vocab_size)
    checks.check_in_range(p, "top_p", 0.0, 1.0, lo_open=True)
    checks.check_in_range(m, "min_p", 0.0, 1.0, hi_open=True)
    checks.check_in_range(r, "repetition_penalty", 0.0, np.inf, lo_open=True, hi_open=True)
    strategy = Strategy(sample=bool((t > 0).any()), top_k=bool((k > 0).any()),
                        top_p=bool((p < 1).any()), min_p=bool((m > 0).any()),
                        penalty=bool((r != 1).any()))
    return SamplingParams(t, k, p, m, r), strategy


def start_decoding(model: nn.Module, params, prompts_BP, lengths_B, cache_len: int, beams: int = 1):
    """Prefill: the cache after the decoder prompt and the logits of the first new token.

    Decoder-only: the prompts, each row at its own length. Encoder-decoder: encode the
    sources and project cross-attention K/V once, then feed the start token. With `beams`
    the self-attention cache is made for B * beams rows (cross K/V stay B rows).
    """
    cfg = model.config
    variables = {"params": params}
    B = prompts_BP.shape[0]
    if cfg.is_encoder_decoder:
        cache = model.apply(variables, prompts_BP, cache_len, beams, method="init_cache")
        start_B1 = jnp.full((B * beams, 1), cfg.bos_id, jnp.int32)
        logits_B1V, cache = model.apply(
            variables, start_B1, jnp.ones((B * beams,), jnp.int32), cache, method="prefill")
        return logits_B1V[:, 0], cache
    cache = KVCache.create(cfg, B, cache_len)
    logits_BPV, cache = model.apply(variables, prompts_BP, lengths_B, cache, method="prefill")
    logits_BV = jnp.take_along_axis(logits_BPV, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
    if beams > 1:  # row b * beams + w is beam w of prompt b
        rows = jnp.repeat(jnp.arange(B), beams)
        logits_BV, cache = logits_BV[rows], cache.take_rows(rows)
    return logits_BV, cache


def model_step_fn(model: nn.Module, params):
    """The model as the loop's `step_fn(tokens_B, cache) -> (logits_BV, cache)`."""
    return lambda tokens_B, cache: model.apply({"params": params}, tokens_B, cache, method="step")


def _prompt_seen(cfg, prompts_BP, lengths_B):
    """bool[B, V]: the decoder-prompt tokens, for the repetition penalty."""
    B, P = prompts_BP.shape
    if cfg.is_encoder_decoder:
        return jnp.zeros((B, cfg.vocab_size), bool).at[:, cfg.bos_id].set(True)
    valid_BP = jnp.arange(P)[None, :] < lengths_B[:, None]
    rows_BP = jnp.broadcast_to(jnp.arange(B)[:, None], (B, P))
    return jnp.zeros((B, cfg.vocab_size), bool).at[rows_BP, prompts_BP].max(valid_BP)


@functools.partial(
    jax.jit,
    static_argnames=("model", "max_new_tokens", "cache_len", "eos_ids", "strategy", "loop"))
def _generate(model, params, prompts_BP, lengths_B, rng, sampling: SamplingParams, *,
              max_new_tokens, cache_len, eos_ids, strategy, loop) -> DecodeOutput:
    cfg = model.config
    logits_BV, cache = start_decoding(model, params, prompts_BP, lengths_B, cache_len)
    seen = _prompt_seen(cfg, prompts_BP, lengths_B) if strategy.penalty else None
    state: LoopState = decode_loop(
        model_step_fn(model, params), initial_state(logits_BV, cache, rng, max_new_tokens, seen),
        eos_ids=eos_ids, pad_id=cfg.pad_id, params=sampling, strategy=strategy,
        while_loop=loop == "while")
    return DecodeOutput(state.tokens, state.lengths, state.logprobs, state.cache.lengths,
                        cache_len)


def generate(
    model: nn.Module,
    params,
    prompts,
    lengths,
    *,
    max_new_tokens: int,
    rng: jax.Array | None = None,
    temperature=0.0,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    repetition_penalty=1.0,
    eos_id: int | tuple[int, ...] | None = 1,
    cache_len: int | None = None,
    loop: str = "scan",
) -> DecodeOutput:
    """Autoregressive decoding with a KV cache, as one jitted computation.

    Args:
        model: a `models.build(...)` module; params: its parameters.
        prompts: int[B, P] right-padded prompts (decoder-only) or sources (encoder-decoder),
            pad id 0; lengths: int[B] their true lengths.
        max_new_tokens: N, the tokens to generate per row (static).
        rng: PRNG key, required when any temperature > 0.
        temperature: 0 is greedy. top_k (0 off), top_p (1 off), min_p (0 off),
            repetition_penalty (1 off): each a scalar or one value per row, traced.
        eos_id: an end id, several, or None to always generate N tokens.
        cache_len: decoder cache slots; default the decoder prompt width + N.
        loop: "scan" (default; differentiable) or "while" (stops once all rows are done).

    Returns:
        A `DecodeOutput`.

    Raises:
        ValueError: naming the argument, its value and the limit it breaks.

    `generate.lower(...)` takes the same arguments and returns the `jax.stages.Lowered`
    computation instead of running it (ahead-of-time compilation, cost analysis, or a look
    at the one `while` loop the scan becomes).
    """
    args, static = _checked_arguments(
        model=model, params=params, prompts=prompts, lengths=lengths,
        max_new_tokens=max_new_tokens, rng=rng, temperature=temperature, top_k=top_k,
        top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty, eos_id=eos_id,
        cache_len=cache_len, loop=loop)
    return _generate(*args, **static)


def _lower(*args, **kwargs) -> jax.stages.Lowered:
    """`generate`'s computation for these arguments (the same ones), lowered and not run."""
    bound = inspect.signature(generate).bind(*args, **kwargs)
    bound.apply_defaults()
    call_args, static = _checked_arguments(**bound.arguments)
    return _generate.lower(*call_args, **static)


generate.lower = _lower


def _checked_arguments(*, model, params, prompts, lengths, max_new_tokens, rng, temperature,
                       top_k, top_p, min_p, repetition_penalty, eos_id, cache_len, loop):
    """The jitted function's (traced args, static kwargs), every value checked first."""
    cfg = model.config
    prompts, lengths = checks.check_prompts(cfg, prompts, lengths)
    max_new_tokens = checks.check_positive_int(max_new_tokens, "max_new_tokens")
    cache_len = checks.check_cache_len(cfg, prompts.shape[1], max_new_tokens, cache_len)
    eos_ids = checks.check_eos(cfg, eos_id)
    if loop not in LOOPS:
        raise ValueError(f"loop={loop!r} must be one of {LOOPS}")
    sampling, strategy = sampling_arguments(
        cfg, prompts.shape[0], temperature, top_k, top_p, min_p, repetition_penalty)
    if strategy.sample and rng is None:
        raise ValueError("rng is required when temperature > 0 (sampling)")
    rng = jax.random.key(0) if rng is None else rng
    return ((model, params, prompts, lengths, rng, sampling),
            dict(max_new_tokens=max_new_tokens, cache_len=cache_len, eos_ids=eos_ids,
                 strategy=strategy, loop=loop))
