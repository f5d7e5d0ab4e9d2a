"""The request `python -m decode` generates with: a directory's defaults, then its flags.

    strategy = checked_strategy(args, gen)               # refusals and the unapplied warning
    gen = with_new_tokens(args, gen)                     # the number of new tokens settled
    limit = input_limit(args, gen, cfg)                  # the longest input (or --truncate)
    request = request_for(args, gen, cfg, prompt_len)    # per batch: its longest input

Each batch's `decode.DecodeRequest` is the directory's generation defaults
(`DecodeRequest.from_generation`, read as transformers reads generation_config.json), then
decode's own beam settings (beam size 4, GNMT's alpha 0.6) where the directory names
none, then the flags given: an unset flag is None and leaves its field as it is. A
decoder-only model's max_length counts the prompt, so the request is a function of the
batch's longest input. `args` is the parsed command line (`decode.__main__.build_parser`).
"""

from __future__ import annotations

import argparse
import dataclasses

from decode.defaults import generation_strategy, unapplied
from decode.request import DecodeRequest
from decode.source import note
from decode.text import LengthLimit, length_limit
from models.cache_int8 import KV_CACHE_DTYPES
from models.config import TransformerConfig
from models.errors import UserError
from models.pretrained.generation import GenerationDefaults

DEFAULT_NEW_TOKENS = 32        # when neither the command line nor the directory gives one
# decode's own beam settings (beam size 4, GNMT's alpha 0.6) where the directory names none.
DEFAULTS = DecodeRequest()


def checked_strategy(args, gen: GenerationDefaults) -> str:
    """The strategy (--strategy, else the directory's), after refusing a flag it does not
    read; the directory's settings it leaves unapplied are named in one warning."""
    strategy = args.strategy or generation_strategy(gen)
    if strategy == "beam" and args.repetition_penalty is not None:
        raise UserError("--repetition-penalty applies to greedy decoding and sampling; beam "
                        "search has none")
    skipped = unapplied(gen, strategy=strategy)
    if skipped:
        note(f"warning: generation settings not applied: {', '.join(skipped)}")
    return strategy


def with_new_tokens(args, gen: GenerationDefaults) -> GenerationDefaults:
    """The directory's defaults with the number of new tokens the command line decodes:
    --max-new-tokens, else the directory's max_new_tokens, else (no max_length either)
    32. Like max_new_tokens in transformers, it wins over max_length."""
    n = args.max_new_tokens or gen.max_new_tokens
    if n is None and gen.max_length is None:
        n = DEFAULT_NEW_TOKENS
    return dataclasses.replace(gen, max_new_tokens=n)


def input_limit(args, gen: GenerationDefaults, cfg: TransformerConfig) -> LengthLimit:
    """The longest input the model takes with the new tokens (`gen` from
    `with_new_tokens`, whose max_new_tokens is None only where max_length is set):
    refused, or cut with a warning under --truncate."""
    if cfg.is_encoder_decoder and gen.max_new_tokens is None and gen.max_length <= 1:
        raise UserError(f"the directory's max_length={gen.max_length} leaves no new token "
                        "after the start token; pass --max-new-tokens")
    limit = length_limit(cfg, gen.max_new_tokens, max_length=gen.max_length)
    return dataclasses.replace(limit, overlong="cut" if args.truncate else "refuse",
                               advice="shorten it or pass --truncate")


def add_cache_flags(parser: argparse.ArgumentParser) -> None:
    """The KV cache's flag (`decode.__main__.build_parser` adds it with the others)."""
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                        help="the KV cache's keys and values: auto (default: the model's "
                             "dtype) or int8 (a scale per token per kv head: about a quarter "
                             "of float32's bytes, docs/decoding.md)")


def add_language_flags(parser: argparse.ArgumentParser) -> None:
    """A translation model's languages, by the codes its tokenizer names."""
    parser.add_argument("--target-lang", default=None, metavar="CODE",
                        help="the language to translate into: its code (NLLB spa_Latn, "
                             "M2M-100 es, mBART-50 es_XX) forced as the first new token")
    parser.add_argument("--source-lang", default=None, metavar="CODE",
                        help="the inputs' language: its code around each input, as the "
                             "tokenizer's src_lang puts it (default: the one it was saved "
                             "with)")


def with_languages(args, tokenizer, gen: GenerationDefaults, cfg: TransformerConfig):
    """(the tokenizer, the generation defaults) with --source-lang and --target-lang
    applied: the source language's tokens around each input, the target language's token
    as the forced first new token."""
    if args.target_lang is None and args.source_lang is None:
        return tokenizer, gen
    flag = "--target-lang" if args.target_lang is not None else "--source-lang"
    if not cfg.is_encoder_decoder:
        raise UserError(f"{flag} is for a translation model (an encoder-decoder)")
    if not hasattr(tokenizer, "languages"):
        raise UserError(f"{flag} needs the model directory's Hugging Face tokenizer, which "
                        "names its language codes; give --forced-bos-id ID instead")
    if args.target_lang is not None:
        if getattr(args, "forced_bos_id", None) is not None:
            raise UserError("--target-lang and --forced-bos-id both name the first new "
                            "token: give one")
        gen = dataclasses.replace(gen, forced_bos_id=tokenizer.language_id(args.target_lang))
    if args.source_lang is not None:
        tokenizer = tokenizer.for_source_language(args.source_lang)
    return tokenizer, gen


def _given_ids(args) -> dict:
    """The id flags given, as request fields: "none" / no value turn a default off."""
    changes = {}
    if args.eos_id is not None:
        changes["eos_id"] = tuple(args.eos_id) or None
    for name in ("forced_bos_id", "forced_eos_id"):
        value = getattr(args, name)
        if value is not None:
            changes[name] = None if value < 0 else value
    if args.banned_ids is not None:
        changes["banned_ids"] = tuple(args.banned_ids)
    return changes


def stopping_rule(text: str):
    """beam only: a source stops once its beams have all finished (true), once the worst
    finished beam beats the best alive one (false), or only when no alive beam can still
    improve on them (never); default: the directory's rule, else never"""
    rules = {"true": True, "false": False, "never": "never"}
    if text not in rules:
        raise argparse.ArgumentTypeError(f"{text!r} must be true, false or never")
    return rules[text]


def _early_stopping(args, gen: GenerationDefaults, request: DecodeRequest):
    """The flag's rule, else the directory's (transformers' False when the directory sets
    beam settings but no rule), else decode's own exact stop ("never")."""
    if args.early_stopping is not None:
        return args.early_stopping
    from_file = (gen.num_beams is not None or gen.length_penalty is not None
                 or gen.early_stopping is not None)
    return request.early_stopping if from_file else DEFAULTS.early_stopping


def request_for(args, gen: GenerationDefaults, cfg: TransformerConfig,
                prompt_len: int) -> DecodeRequest:
    """The request for a batch whose longest input has `prompt_len` tokens: the
    directory's (`DecodeRequest.from_generation`), then decode's own beam settings where
    the directory names none, then the flags given (`gen` is `with_new_tokens`').

        file {num_beams: 4, length_penalty: 2.0, max_length: 20}, flags --beam-size 2, an
        encoder-decoder -> strategy "beam", beam_size 2, length_penalty 2.0,
        length_normalization "hf", max_new_tokens 19 (max_length counts the start token)
    """
    request = DecodeRequest.from_generation(gen, cfg, prompt_len=prompt_len)
    from_file = gen.num_beams is not None or gen.length_penalty is not None
    norm = args.length_normalization or ("hf" if from_file else "gnmt")
    alpha = request.length_penalty if norm == "hf" else DEFAULTS.length_penalty
    beams = gen.num_beams if gen.num_beams and gen.num_beams > 1 else DEFAULTS.beam_size
    request = request.replace(
        strategy=args.strategy or generation_strategy(gen), length_normalization=norm,
        length_penalty=alpha if args.length_penalty is None else args.length_penalty,
        beam_size=args.beam_size or beams, early_stopping=_early_stopping(args, gen, request),
        **_given_ids(args))
    request = request.override(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, min_new_tokens=args.min_new_tokens,
        no_repeat_ngram_size=args.no_repeat_ngram_size, kv_cache_dtype=args.kv_cache_dtype)
    if request.strategy == "beam" and request.beam_size > cfg.vocab_size:
        given = "--beam-size" if args.beam_size else "the directory's num_beams"
        raise UserError(f"{given} {request.beam_size} exceeds the vocabulary "
                        f"({cfg.vocab_size} tokens)")
    return request
