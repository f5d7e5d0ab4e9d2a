"""Autoregressive decoding over an explicit KV cache: `generate` and `beam_search`.

Both are single jitted computations (prefill, then a `lax.scan`), take right-padded int32
prompts (decoder-only) or sources (encoder-decoder) with their lengths, and return arrays.
The logits processors are public so they can be used on any logits.
"""

from decode.beam import BeamOutput, beam_search, gnmt_penalty
from decode.generate import DecodeOutput, bucket_width, generate, pad_prompts
from decode.loop import LoopState, decode_loop
from decode.processors import (
    apply_repetition_penalty,
    apply_temperature,
    min_p_filter,
    top_k_filter,
    top_p_filter,
)

__all__ = [
    "BeamOutput", "beam_search", "gnmt_penalty", "DecodeOutput", "LoopState",
    "apply_repetition_penalty", "apply_temperature",
    "bucket_width", "decode_loop", "generate", "min_p_filter", "pad_prompts", "top_k_filter",
    "top_p_filter",
]
