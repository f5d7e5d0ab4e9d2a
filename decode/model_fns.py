"""The model as the decoding loops see it: a prefill that starts decoding, and a step.

`decode.loop` and `decode.beam` know nothing about models; `generate` and `beam_search`
hand them these two functions of a `models.build(...)` module and its parameters:

    logits_BV, cache = start_decoding(model, params, prompts_BP, lengths_B, cache_len)
    step_fn = model_step_fn(model, params)       # step_fn(tokens_B, cache) -> (logits_BV, cache)

With parameters sharded over kv heads both take the cache's sharding (a
`decode.placement.cache_sharding(params)`, static) and keep the cache split that way.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from decode.placement import constrain_cache
from models import KVCache


def start_decoding(model: nn.Module, params, prompts_BP, lengths_B, cache_len: int, *,
                   beams: int = 1, cache_sharding=None):
    """Prefill: the cache after the decoder prompt and the logits of the first new token.

    Decoder-only: the prompts, each row at its own length. Encoder-decoder: encode the
    sources (masked by their lengths) and project cross-attention K/V once, then feed the
    start token. With `beams`
    the self-attention cache is made for B * beams rows (cross K/V stay B rows); row
    b * beams + w is beam w of prompt b, so with B = 2, beams = 3 the rows are the prompts
    [0, 0, 0, 1, 1, 1].

    Args:
        model: a `models.build(...)` module.
        params: its parameters.
        prompts_BP: int32[B, P] right-padded prompts (decoder-only) or sources.
        lengths_B: int32[B] their true lengths.
        cache_len: the decoder cache's size in slots (static).
        beams: the rows made per prompt (static).
        cache_sharding: the cache's K/V sharding (`decode.placement.cache_sharding`,
            static); None leaves it to the compiler.

    Returns:
        (logits float32[B * beams, V] of the first new token, the cache of B * beams rows).
    """
    cfg = model.config
    variables = {"params": params}
    B = prompts_BP.shape[0]
    if cfg.is_encoder_decoder:
        cache = model.apply(variables, prompts_BP, cache_len, beams, src_lengths=lengths_B,
                            method="init_cache")
        cache = constrain_cache(cache, cache_sharding)
        start_B1 = jnp.full((B * beams, 1), cfg.bos_id, jnp.int32)
        logits_B1V, cache = model.apply(
            variables, start_B1, jnp.ones((B * beams,), jnp.int32), cache, method="prefill")
        return logits_B1V[:, 0], constrain_cache(cache, cache_sharding)
    cache = constrain_cache(KVCache.create(cfg, B, cache_len), cache_sharding)
    logits_BPV, cache = model.apply(variables, prompts_BP, lengths_B, cache, method="prefill")
    logits_BV = jnp.take_along_axis(logits_BPV, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
    if beams > 1:  # row b * beams + w is beam w of prompt b
        rows = jnp.repeat(jnp.arange(B), beams)
        logits_BV, cache = logits_BV[rows], cache.take_rows(rows)
    return logits_BV, constrain_cache(cache, cache_sharding)


def decoder_prefix(config, prompts_BP, lengths_B):
    """The decoder's input before the first new token, as (int32[B, P'], lengths int32[B]):
    a decoder-only model's prompts, or an encoder-decoder's start token (P' = 1).

        encoder-decoder, bos_id 2, B = 2  ->  [[2], [2]], lengths [1, 1]
    """
    if config.is_encoder_decoder:
        B = prompts_BP.shape[0]
        return jnp.full((B, 1), config.bos_id, jnp.int32), jnp.ones((B,), jnp.int32)
    return prompts_BP, lengths_B


def model_step_fn(model: nn.Module, params, cache_sharding=None):
    """The model as the loops' `step_fn(tokens_B, cache) -> (logits_BV, cache)`; the cache
    goes in and comes back on `cache_sharding` (None: wherever the compiler puts it)."""

    def step_fn(tokens_B, cache):
        cache = constrain_cache(cache, cache_sharding)
        logits_BV, cache = model.apply({"params": params}, tokens_B, cache, method="step")
        return logits_BV, constrain_cache(cache, cache_sharding)

    return step_fn


def output_pad_id(config) -> int:
    """The id written after each row's end token: the config's pad_id, 0 when it has none
    (GPT-2 has no pad token)."""
    return 0 if config.pad_id is None else config.pad_id
