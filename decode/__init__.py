"""Autoregressive decoding over an explicit KV cache: `generate` and `beam_search`.

Both are single jitted computations (prefill, then a `lax.scan`), take right-padded int32
prompts (decoder-only) or sources (encoder-decoder) with their lengths, and return arrays.
They run eagerly, inside your own `jax.jit` and (`generate`, `loop="scan"`) under
`jax.grad`. The logits processors are public so they can be used on any logits.

Ahead of time: `generate_arguments(...)` and `beam_search_arguments(...)` check a call's
arguments and return the `(args, static)` its jitted computation takes;
`generate.lower(...)` and `beam_search.lower(...)` take a call's arguments and return the
lowered computation (`.compile()`, `.cost_analysis()`, `.as_text()`).

Modules: `generate` and `beam` (the public calls), `sampling` and `checks` (their
arguments), `loop` (the sampling loop, model-free), `beam_steps` (beam search's steps),
`processors` (logits processors), `model_fns` (the model as the loops see it).
"""

from decode.beam import BeamOutput, beam_search, beam_search_arguments
from decode.beam_steps import gnmt_penalty
from decode.generate import DecodeOutput, bucket_width, generate, generate_arguments, pad_prompts
from decode.loop import LoopState, decode_loop
from decode.processors import (
    Strategy,
    apply_repetition_penalty,
    apply_temperature,
    min_p_filter,
    top_k_filter,
    top_p_filter,
)

__all__ = [
    "BeamOutput", "beam_search", "beam_search_arguments", "gnmt_penalty", "DecodeOutput",
    "LoopState", "Strategy", "apply_repetition_penalty", "apply_temperature", "bucket_width",
    "decode_loop", "generate", "generate_arguments", "min_p_filter", "pad_prompts",
    "top_k_filter", "top_p_filter",
]
