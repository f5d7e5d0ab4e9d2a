"""The encoder-only half of `python -m decode`: `--fill-mask` and `--classify`.

An encoder-only model (BERT, RoBERTa) does not generate; `python -m decode` hands it here
(`run`) after checking the flags (`check_flags`: no generation flag with either task) and
that the model has the head the task needs (`check_model_fits`). Each input line gives one
output line:

    --fill-mask   [MASK]1: mat 0.4120 | floor 0.2010; [MASK]2: ...    (`fillers_line`)
    --classify    pos<TAB>0.9312

The inputs are read with the tokenizer's special tokens (`decode.encoder_text.encode_text`), or
as space-separated ids without a tokenizer (`--classify` only), and checked against
max_len before anything runs; a blank line gives a blank line.
"""

from __future__ import annotations

import argparse

from decode import encoder, encoder_text
from decode.source import model_source
from decode.text import one_line, token_ids
from models.config import TransformerConfig
from models.errors import UserError

DEFAULT_FILLERS = 5            # --fill-mask's fillers per mask when --top-k is not given

# What only generation reads: refused with --fill-mask / --classify (--top-k with --classify).
GENERATION_FLAGS = ("strategy", "max_new_tokens", "temperature", "top_p", "min_p",
                    "repetition_penalty", "beam_size", "length_penalty",
                    "length_normalization", "early_stopping", "eos_id", "forced_bos_id",
                    "forced_eos_id", "banned_ids", "min_new_tokens", "no_repeat_ngram_size",
                    "kv_cache_dtype", "truncate", "target_lang", "source_lang")


def task_flag(args) -> str | None:
    """"--fill-mask", "--classify", or None (generation)."""
    return "--fill-mask" if args.fill_mask else "--classify" if args.classify else None


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_flags(args, parser: argparse.ArgumentParser) -> None:
    """--fill-mask / --classify with a flag they do not read (one set away from its
    default) is a usage error, raised before any input is read or any model loaded."""
    task = task_flag(args)
    if task is None:
        return
    given = [d for d in GENERATION_FLAGS if getattr(args, d) != parser.get_default(d)]
    if given:
        flags = ", ".join(map(_flag, given))
        raise UserError(f"{flags} appl{'ies' if len(given) == 1 else 'y'} to generation, "
                        f"not {task}")
    if args.classify and args.top_k is not None:
        raise UserError("--top-k applies to sampling and --fill-mask, not --classify")


def check_model_fits(args, config: TransformerConfig) -> None:
    """An encoder-only model needs --fill-mask (masked-LM head) or --classify (classifier);
    any other model needs neither."""
    task, source = task_flag(args), model_source(args)
    if config.architecture != "encoder_only":
        if task:
            raise UserError(f"{task} needs an encoder-only model (BERT, RoBERTa); {source} "
                            f"is {config.architecture}: without {task} it generates")
        return
    if config.num_labels:
        kind = (f"an encoder-only classifier (num_labels={config.num_labels}: "
                f"{', '.join(encoder.label_names(config))})")
        fits = "--classify"
    else:
        kind, fits = "an encoder-only masked-LM model (num_labels=0)", "--fill-mask"
    if task is None:
        raise UserError(f"{source} is {kind}: it does not generate; pass {fits}")
    if task != fits:
        need = ("a masked-LM model (num_labels=0)" if task == "--fill-mask"
                else "a classifier (num_labels > 0)")
        raise UserError(f"{task} needs {need}; {source} is {kind}: pass {fits}")


def shown_token(token: str) -> str:
    """A filler as one unambiguous word of the output line: quoted (Python's repr) when it
    is empty or holds whitespace, "|", ";" or an unprintable character."""
    plain = token and token.isprintable() and not any(
        c.isspace() or c in "|;" for c in token)
    return token if plain else repr(token)


def fillers_line(mask_token: str, fillers: list[list[tuple[str, float]]]) -> str:
    """One output line: each mask's (token, probability) fillers, in order.

        "[MASK]", [[("mat", 0.412), ("floor", 0.201)], [(".", 0.9), ("!", 0.05)]]
        -> "[MASK]1: mat 0.4120 | floor 0.2010; [MASK]2: . 0.9000 | ! 0.0500"
    """
    return "; ".join(f"{mask_token}{m}: " + " | ".join(
        f"{shown_token(token)} {p:.4f}" for token, p in found)
        for m, found in enumerate(fillers, start=1))


def _inputs(args, lines: list[str], tok, config: TransformerConfig) -> list[list[int] | None]:
    """Token ids of every line (None for a blank one), special tokens added and checked
    against max_len (and, for --fill-mask, for a mask token) before anything runs."""
    out = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            out.append(None)
        elif tok is None:                  # --classify on a directory without a tokenizer
            ids = token_ids(line, number, config)
            if len(ids) > config.max_len:
                raise UserError(f"input {number} is {len(ids)} tokens long; the model takes "
                                f"at most {config.max_len} (max_len)")
            out.append(ids)
        else:
            out.append(encoder_text.encode_text(tok, config, line, name=f"input {number}",
                                           need_mask=args.fill_mask))
    return out


def run(args, model, params, tok, lines: list[str]) -> None:
    """Prints one line per input line: its fillers (--fill-mask) or its label (--classify)."""
    cfg = model.config
    if args.fill_mask:
        mask_id, mask_token = encoder_text.mask_token_of(tok, model_source(args))
        k = DEFAULT_FILLERS if args.top_k is None else args.top_k
        if not 1 <= k <= cfg.vocab_size:
            raise UserError(f"--top-k {k} must be in [1, vocab_size={cfg.vocab_size}] (the "
                            "fillers shown per mask)")
    inputs = _inputs(args, lines, tok, cfg)
    todo = [ids for ids in inputs if ids is not None]
    if args.fill_mask:
        found = encoder.fill_mask_lists(model, params, todo, mask_id=mask_id, top_k=k,
                                        batch_size=args.batch_size)
        results = iter([fillers_line(mask_token, [list(zip(
            encoder_text.token_strings(tok, [i for i, _ in pairs]), [p for _, p in pairs],
            strict=True)) for pairs in masks]) for masks in found])
    else:
        probs = encoder.classify_lists(model, params, todo, batch_size=args.batch_size)
        results = iter([f"{c.label}\t{c.probability:.4f}"
                        for c in encoder_text.classified(cfg, probs)])
    for ids in inputs:
        print("" if ids is None else one_line(next(results)), flush=True)
