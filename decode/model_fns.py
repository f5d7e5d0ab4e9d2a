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

from decode.loop import SplitStep
from decode.placement import constrain_cache
from models import BeamKVCache, KVCache, prefill_in_chunks
from models.attention import fuse_qkv

# Prompts longer than this are prefilled this many tokens at a time: no attention over the
# whole prompt at once, whatever its length (`models.prefill_in_chunks`).
PREFILL_CHUNK = 512

# How beam search keeps its beams' keys and values. "table" (the default): a
# `models.BeamKVCache`, whose keys and values never move; an ancestry table follows the
# beams, and each beam's attention reads every region of its source (W times the attention
# arithmetic of a row of its own, on the same bytes). "gathered": each beam its own rows of
# a `models.KVCache`, gathered by parent beam every step (the whole self-attention cache
# read and written twice a step). Measured with beam 4, batch 8 (bench/decode.py's
# decoder-only shape, 2 CPU cores): 44 ms a step with the table, 57 ms gathered.
BEAM_CACHES = ("table", "gathered")


def start_decoding(model: nn.Module, params, prompts_BP, lengths_B, cache_len: int, *,
                   beams: int = 1, beam_cache: str = "table", cache_sharding=None,
                   kv_cache_dtype: str = "auto"):
    """Prefill: the cache after the decoder prompt and the logits of the first new token.

    Decoder-only: the prompts, each row at its own length (in chunks of `PREFILL_CHUNK`
    tokens when longer, `models.prefill_in_chunks`; only each row's last token gets
    logits). Encoder-decoder: encode the sources (masked by their lengths) and project
    cross-attention K/V once, then feed the start token. With `beams` > 1 the prompt is
    prefilled once per source and copied to its beams' rows (cross K/V stay B rows); row
    b * beams + w is beam w of prompt b, so with B = 2, beams = 3 the rows are the prompts
    [0, 0, 0, 1, 1, 1]. `beam_cache` says how those rows are kept (`BEAM_CACHES`).

    Args:
        model: a `models.build(...)` module.
        params: its parameters.
        prompts_BP: int32[B, P] right-padded prompts (decoder-only) or sources.
        lengths_B: int32[B] their true lengths.
        cache_len: the decoder cache's size in slots (static).
        beams: the rows made per prompt (static).
        beam_cache: "table" (a `models.BeamKVCache`, whose ancestry table follows the
            beams) or "gathered" (a `models.KVCache` of B * beams rows, which beam search
            gathers by parent beam every step); static.
        cache_sharding: the cache's K/V sharding (`decode.placement.cache_sharding`,
            static); None leaves it to the compiler.
        kv_cache_dtype: the self-attention cache's, "auto" (the config's dtype) or "int8"
            (`models.cache_int8`); static.

    Returns:
        (logits float32[B * beams, V] of the first new token, the cache of B * beams rows).
    """
    cfg = model.config
    variables = {"params": params}
    B, P = prompts_BP.shape
    if cfg.is_encoder_decoder:
        cache = model.apply(variables, prompts_BP, cache_len, src_lengths=lengths_B,
                            kv_cache_dtype=kv_cache_dtype, method="init_cache")
        cache = constrain_cache(cache, cache_sharding)
        start_B1 = jnp.full((B, 1), cfg.bos_id, jnp.int32)
        ones_B = jnp.ones((B,), jnp.int32)
        logits_BV, cache = model.apply(variables, start_B1, ones_B, cache, ones_B - 1,
                                       method="prefill")
    else:
        cache = constrain_cache(KVCache.create(cfg, B, cache_len, dtype=kv_cache_dtype),
                                cache_sharding)
        if P > PREFILL_CHUNK:
            logits_BV, cache = prefill_in_chunks(model, params, prompts_BP, lengths_B, cache,
                                                 chunk=PREFILL_CHUNK)
        else:
            logits_BV, cache = model.apply(variables, prompts_BP, lengths_B, cache,
                                           lengths_B - 1, method="prefill")
    if beams > 1:  # row b * beams + w is beam w of prompt b
        logits_BV = jnp.repeat(logits_BV, beams, axis=0)
        cache = (BeamKVCache.from_cache(cache, beams) if beam_cache == "table"
                 else cache.take_rows(jnp.repeat(jnp.arange(B), beams)))
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


def model_step_fn(model: nn.Module, params, cache_sharding=None) -> SplitStep:
    """The model as the loops' step, in two parts (`decode.loop.SplitStep`): the model's
    `read_step`, which reads the cache, and the cache's `commit` of the new keys and
    values; called whole it is `step_fn(tokens_B, cache) -> (logits_BV, cache)`. The cache
    goes in and comes back on `cache_sharding` (None: wherever the compiler puts it).

    The step reads each self-attention's query, key and value kernels as one
    (`models.attention.fuse_qkv`, copied here, once per call of the loop that takes the
    step): one matrix product instead of three, 1.03x per batch-1 step on a CPU (`bench.
    step_overhead`; within the machine's noise in other runs). Not when
    the parameters split their kv heads over a mesh (`cache_sharding`), where the joined
    kernel would not be split like the three."""
    if cache_sharding is None:
        params = fuse_qkv(params)

    def read(tokens_B, cache):
        cache = constrain_cache(cache, cache_sharding)
        return model.apply({"params": params}, tokens_B, cache, method="read_step")

    def commit(cache, update, active_B):
        return constrain_cache(cache.commit(update, active_B), cache_sharding)

    return SplitStep(read, commit)


def output_pad_id(config) -> int:
    """The id written after each row's end token: the config's pad_id, 0 when it has none
    (GPT-2 has no pad token)."""
    return 0 if config.pad_id is None else config.pad_id
