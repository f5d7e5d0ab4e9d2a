"""Autoregressive decoding over an explicit KV cache: `generate` and `beam_search`.

Both are single jitted computations (prefill, then a `lax.scan`), take right-padded int32
prompts (decoder-only) or sources (encoder-decoder) with their lengths, and return arrays.
They run eagerly, inside your own `jax.jit` and (`generate`, `loop="scan"`) under
`jax.grad`, with parameters on one device or sharded over a device mesh (the tokens are
the same). The logits processors are public so they can be used on any logits.

How to decode is one value, a `DecodeRequest` (strategy, sampling values, token
constraints, beam settings, new tokens), which `generate` and `beam_search` take beside
their keyword arguments (a keyword wins over the request's field) and which `run` decodes
whatever its strategy. A model directory's generation_config.json gives one:

    pre = models.load(path)
    request = decode.DecodeRequest.from_generation(pre.generation, pre.config)
    out = decode.run(pre.model, pre.params, prompts, lengths, request)   # best sequences
    decode.TextDecoder(pre.model, pre.params, pre.tokenizer).decode(texts, request)

Ahead of time: `generate.lower(...)` and `beam_search.lower(...)` take a call's arguments
and return the lowered computation (`.compile()`, `.cost_analysis()`, `.as_text()`);
`generate_arguments(...)` and `beam_search_arguments(...)` return the checked `(args,
static)` the jitted computation takes.

Modules:
    request     `DecodeRequest`; `defaults` reads a directory's generation defaults as its
                fields (`DecodeRequest.from_generation`) and names what none applies
                (`unapplied`)
    generate, beam   the two public calls, each a `setup.DecodeCall` over one jitted
                computation; `runner` (`run`) chooses between them by strategy
    setup       their shared set-up (checks, a request merged with keywords, placement)
                and the callable-and-lowerable call object; `trace_cache` keeps their
                traced programs once per machine when the compilation cache is on
    sampling, checks   their arguments, checked
    loop        the sampling loop, model-free; `beam_steps` beam search's steps
    processors  logits processors, the token constraints among them; `ngrams` the
                history that bans repeated n-grams
    model_fns   the model as the loops see it; `placement` the KV cache split like
                sharded parameters' kv heads
    text        the text service `TextDecoder` (tokenise, check lengths, bucket, decode,
                detokenise: one output per input) behind `python -m decode` and training's
                evaluation
    encoder     encoder-only models, which do not generate: `fill_mask` and `classify` on
                arrays and lists of ids; `encoder_text` (`fill_mask_text`, `classify_text`)
                on text; `encoder_cli` their command line (`--fill-mask`, `--classify`)
    whisper     Whisper transcription (`transcribe`: the checkpoint's prompt and suppressed
                tokens, greedy or beam search as transformers runs it); `whisper_cli` its
                command line (`--audio`)
    source      the model `python -m decode` names (--config, --model, --workdir,
                --draft-model); `cli_request` its request: a directory's defaults, then
                the flags given
    __main__    `python -m decode`: argument parsing over `source`, `cli_request`, `text`,
                `encoder_cli`, `whisper_cli`
"""

from decode.beam import BeamOutput, beam_search, beam_search_arguments
from decode.beam_steps import gnmt_penalty, hf_penalty, length_penalty
from decode.defaults import generation_strategy, unapplied
from decode.encoder import FillMaskOutput, classify, fill_mask
from decode.encoder_text import Classified, classify_text, fill_mask_text
from decode.generate import DecodeOutput, bucket_width, generate, generate_arguments, pad_prompts
from decode.loop import LoopState, decode_loop
from decode.processors import (
    Constraints,
    Strategy,
    apply_repetition_penalty,
    apply_temperature,
    ban_end_before,
    ban_tokens,
    constrain_logits,
    force_token,
    min_p_filter,
    top_k_filter,
    top_p_filter,
)
from decode.request import DecodeRequest
from decode.runner import Decoded, Draft, run
from decode.text import Batching, LengthLimit, TextDecoder, length_limit

__all__ = [
    "BeamOutput", "beam_search", "beam_search_arguments", "gnmt_penalty", "hf_penalty",
    "length_penalty", "Classified", "FillMaskOutput", "classify", "classify_text", "fill_mask",
    "fill_mask_text", "DecodeOutput", "LoopState", "Constraints", "Strategy",
    "apply_repetition_penalty", "apply_temperature", "ban_end_before", "ban_tokens",
    "bucket_width", "constrain_logits", "decode_loop", "force_token", "generate",
    "generate_arguments", "min_p_filter", "pad_prompts", "top_k_filter", "top_p_filter",
    "DecodeRequest", "generation_strategy", "unapplied", "Decoded", "Draft", "run", "Batching",
    "LengthLimit", "TextDecoder", "length_limit",
]
