"""A model directory's generation defaults, as decoding reads them: a request's fields.

    pre = models.load("path/to/opus-mt-en-de")
    request = decode.DecodeRequest.from_generation(pre.generation, pre.config)
    decode.unapplied(pre.generation, strategy=request.strategy)   # what is not applied

`DecodeRequest.from_generation` makes the request of `request_fields`, which reads each
setting as transformers' generate does. P is the decoder's prompt length: 1 (the start
token) for an encoder-decoder, the prompt for a decoder-only model (transformers left-pads
a batch and counts the padding, so P is the batch's longest prompt):

    num_beams                strategy "beam" when > 1 (else "greedy"); beam_size (default 1)
    eos_token_id             eos_id (one id or several; none: never stops early)
    forced_bos_token_id      forced_bos_id (a decoder-only model's only when P = 1, as there)
    forced_eos_token_id      forced_eos_id (a list of one id; several are not applied)
    bad_words_ids            banned_ids: single tokens (an end id among them is dropped)
    suppress_tokens          banned_ids too
    max_new_tokens           max_new_tokens
    max_length               max_new_tokens = max_length - P (when max_new_tokens is unset)
    min_new_tokens           min_new_tokens
    min_length               min_new_tokens = max(0, min_length - P) (when min_new_tokens
                             is unset)
    no_repeat_ngram_size     no_repeat_ngram_size
    repetition_penalty       repetition_penalty (greedy and sampling: beam search has none)
    length_penalty           length_penalty with length_normalization "hf" (default 1.0)
    renormalize_logits       renormalize_logits (it changes only beam scores)
    early_stopping           early_stopping: true, false or "never" (default false, as in
                             transformers; a request's own default is "never")

`unapplied(gen, strategy=...)` names the settings that would change transformers' output
and that a request does not carry (sampling with do_sample, stop strings, group beam
search, ...): nothing is dropped silently. transformers' default of 20 new tokens when
neither max_length nor max_new_tokens is set is not a default here: the caller's stands.
"""

from __future__ import annotations

from models.config import TransformerConfig
from models.errors import UserError, is_int
from models.pretrained.generation import GenerationDefaults

STRATEGIES = ("greedy", "sample", "beam")


def request_fields(generation: GenerationDefaults, config: TransformerConfig, *,
                   prompt_len: int | None = None) -> dict:
    """The `decode.DecodeRequest` fields `generation` sets (the module docstring maps
    them), with transformers' defaults for the beam settings: beam size 1, length penalty
    1.0 under "hf" normalisation, early_stopping False. `DecodeRequest.from_generation`
    documents the arguments and the errors.

        encoder-decoder, max_length 142, min_length 56, forced_bos 0
        -> {"max_new_tokens": 141, "min_new_tokens": 55, "forced_bos_id": 0, ...}
    """
    g = generation
    fields: dict = dict(
        strategy=generation_strategy(g), eos_id=g.eos_ids, forced_eos_id=g.forced_eos_id,
        banned_ids=g.banned_ids, no_repeat_ngram_size=g.no_repeat_ngram_size or 0,
        repetition_penalty=1.0 if g.repetition_penalty is None else g.repetition_penalty,
        beam_size=g.num_beams or 1,
        length_penalty=1.0 if g.length_penalty is None else g.length_penalty,
        length_normalization="hf", renormalize_logits=bool(g.renormalize_logits),
        early_stopping=False if g.early_stopping is None else g.early_stopping)
    if g.forced_bos_id is not None:
        # transformers forces it when the decoder's input is one token long.
        if _prompt_len(config, prompt_len, "forced_bos_token_id") == 1:
            fields["forced_bos_id"] = g.forced_bos_id
    if g.max_new_tokens is not None:
        fields["max_new_tokens"] = g.max_new_tokens
    elif g.max_length is not None:
        p = _prompt_len(config, prompt_len, "max_length")
        if g.max_length <= p:
            raise UserError(f"max_length={g.max_length} leaves no new token after a decoder "
                            f"prompt of {p} tokens")
        fields["max_new_tokens"] = g.max_length - p
    if g.min_new_tokens:
        fields["min_new_tokens"] = g.min_new_tokens
    elif g.min_length:
        p = _prompt_len(config, prompt_len, "min_length")
        fields["min_new_tokens"] = max(0, g.min_length - p)
    return fields


def generation_strategy(generation: GenerationDefaults) -> str:
    """The strategy a directory's defaults ask for: "beam" when num_beams > 1, else
    "greedy" (do_sample is not applied: `unapplied` names it)."""
    beams = generation.num_beams
    return "beam" if beams is not None and beams > 1 else "greedy"


# Settings that change transformers' output and that no request carries, each with the
# value that means "off" (a setting at that value, or absent, changes nothing).
_UNAPPLIED_OFF = {
    "max_time": None, "stop_strings": None, "encoder_repetition_penalty": 1.0,
    "encoder_no_repeat_ngram_size": 0, "exponential_decay_length_penalty": None,
    "begin_suppress_tokens": None, "sequence_bias": None, "token_healing": False,
    "guidance_scale": None, "watermarking_config": None, "penalty_alpha": None,
    "dola_layers": None, "num_beam_groups": 1, "diversity_penalty": 0.0, "constraints": None,
    "force_words_ids": None, "forced_decoder_ids": None}
# Sampling settings: they matter only with do_sample.
_SAMPLING_OFF = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None, "top_h": None,
                 "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0}


def unapplied(generation: GenerationDefaults, *, strategy: str = "greedy") -> tuple[str, ...]:
    """The settings (as "name=value") that change transformers' output and that the
    request `from_generation` gives does not apply when it runs with `strategy`.

        {"do_sample": true, "temperature": 0.6, "top_p": 0.9} -> ("do_sample=True",
            "temperature=0.6", "top_p=0.9")
    """
    if strategy not in STRATEGIES:
        raise UserError(f"strategy={strategy!r} must be one of {STRATEGIES}")
    raw = generation.raw
    names = [k for k, off in _UNAPPLIED_OFF.items() if raw.get(k, off) not in (off, None)]
    if raw.get("do_sample"):
        names.append("do_sample")
        names += [k for k, off in _SAMPLING_OFF.items() if raw.get(k, off) not in (off, None)]
    forced_eos = raw.get("forced_eos_token_id")
    if isinstance(forced_eos, list) and len(forced_eos) > 1:
        names.append("forced_eos_token_id")
    if any(isinstance(w, list) and len(w) > 1 for w in raw.get("bad_words_ids") or ()):
        names.append("bad_words_ids")           # its single-token entries do apply
    if strategy == "beam":
        if generation.repetition_penalty not in (None, 1.0):
            names.append("repetition_penalty")
    return tuple(f"{k}={raw.get(k, getattr(generation, k, None))!r}" for k in names)


def _prompt_len(config: TransformerConfig, prompt_len, name: str) -> int:
    """P: 1 for an encoder-decoder (its start token), `prompt_len` for a decoder-only model."""
    if config.is_encoder_decoder:
        return 1
    if prompt_len is None:
        raise UserError(f"{name} counts a decoder-only model's prompt: pass prompt_len (the "
                        "batch's longest prompt, which transformers pads every row to)")
    if not is_int(prompt_len) or prompt_len < 1:
        raise UserError(f"prompt_len={prompt_len!r} must be a positive int")
    return int(prompt_len)


