"""The model as the decoding loops see it: a prefill that starts decoding, and a step.

`decode.loop` and `decode.beam` know nothing about models; `generate` and `beam_search`
hand them these two functions of a `models.build(...)` module and its parameters:

    logits_BV, cache = start_decoding(model, params, prompts_BP, lengths_B, cache_len)
    step_fn = model_step_fn(model, params)       # step_fn(tokens_B, cache) -> (logits_BV, cache)
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from models import KVCache


def start_decoding(model: nn.Module, params, prompts_BP, lengths_B, cache_len: int, beams: int = 1):
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

    Returns:
        (logits float32[B * beams, V] of the first new token, the cache of B * beams rows).
    """
    cfg = model.config
    variables = {"params": params}
    B = prompts_BP.shape[0]
    if cfg.is_encoder_decoder:
        cache = model.apply(variables, prompts_BP, cache_len, beams, src_lengths=lengths_B,
                            method="init_cache")
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


def decoder_prefix(config, prompts_BP, lengths_B):
    """The decoder's input before the first new token, as (int32[B, P'], lengths int32[B]):
    a decoder-only model's prompts, or an encoder-decoder's start token (P' = 1).

        encoder-decoder, bos_id 2, B = 2  ->  [[2], [2]], lengths [1, 1]
    """
    if config.is_encoder_decoder:
        B = prompts_BP.shape[0]
        return jnp.full((B, 1), config.bos_id, jnp.int32), jnp.ones((B,), jnp.int32)
    return prompts_BP, lengths_B


def model_step_fn(model: nn.Module, params):
    """The model as the loops' `step_fn(tokens_B, cache) -> (logits_BV, cache)`."""
    return lambda tokens_B, cache: model.apply({"params": params}, tokens_B, cache, method="step")


def output_pad_id(config) -> int:
    """The id written after each row's end token: the config's pad_id, 0 when it has none
    (GPT-2 has no pad token)."""
    return 0 if config.pad_id is None else config.pad_id
