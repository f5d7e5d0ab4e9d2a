"""python -m decode --model DIR | --workdir RUN | --config PRESET [options] [TEXT ...]

Decodes (for an encoder-only model: fills in masks, or classifies) each TEXT (or each line
of stdin when no TEXT is given) and prints exactly one output line per input line, in
order: a blank input gives a blank output, and a line break inside an output is written
as \\n.

--model reads a model directory (a Hugging Face one, or a training run's export): text in,
text out with its tokenizer, which adds its own special tokens (GPT-2 none, Llama a leading
BOS, a run's encoder-decoder export a trailing EOS). A directory without tokenizer files,
and --config (a preset with random weights, seeded by --seed), take and print
space-separated token ids. --workdir RUN is --model RUN/model.

The directory's generation_config.json fills in what the command line does not give: the
end tokens, the strategy (beam search when num_beams > 1), the beam size, the length
penalty (with transformers' normalisation, --length-normalization hf, when the file sets
num_beams or length_penalty), the number of new tokens (max_new_tokens, or max_length
less the decoder's prompt), the forced first and last tokens, the banned ids, the minimum
length and no_repeat_ngram_size. Flags win. Settings the file has that would change
transformers' output and that are not applied here are named in one warning on stderr.

    python -m decode --model runs/default/model "the dog sees a cat ."
    python -m decode --model path/to/opus-mt-en-de "An English sentence."   # beam 4 (file)
    echo "5 6 7" | python -m decode --config transformer-tiny --strategy beam --beam-size 4

Encoder-only models (BERT, RoBERTa) do not generate; one of two flags says what to do
with them (and a model without the one it needs is refused, naming the flag that fits):

--fill-mask: a masked-LM model (num_labels=0) predicts each mask token of the input (the
tokenizer's own: [MASK] for BERT and the project's tokenizers, <mask> for RoBERTa). One
line per input: for each mask in order, MASKi: then its --top-k best fillers (default 5)
with their probabilities, best first, "|" between fillers and "; " between masks. A filler
that is empty or holds whitespace, "|" or ";" is quoted ('...'), a special token or a lone
byte shows as its piece ([SEP], <0xC3>).

    python -m decode --model path/to/bert --fill-mask "The cat sat on the [MASK] ."
    [MASK]1: mat 0.4120 | floor 0.2010 | bed 0.0830 | rug 0.0410 | couch 0.0270
    python -m decode --model path/to/roberta --fill-mask --top-k 2 "<mask> and <mask> ."
    <mask>1: Salt 0.3100 | Bread 0.1200; <mask>2: pepper 0.5500 | butter 0.0900

--classify: a classifier (num_labels=C > 0) prints label<TAB>probability of the likeliest
label (config.json's id2label names, else LABEL_i); a directory without tokenizer files
takes space-separated token ids.

    python -m decode --model path/to/sst2-bert --classify "a fine film" "dull"
    pos\t0.9312
    neg\t0.8107

Both read stdin lines when no TEXT is given, with the tokenizer's special tokens added
([CLS] x [SEP], <s> x </s>), and refuse an input longer than the model's max_len (no
--truncate) and the flags only generation reads (--strategy, --max-new-tokens, ...).

Exit status: 0 when every input was decoded; 2 for a bad argument or input (one `error:`
line on stderr; --verbose shows the traceback).
"""

from __future__ import annotations

import argparse
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import decode
import models
from decode import encoder, encoder_text
from models.errors import UserError
from models.pretrained.generation import GenerationDefaults


class UsageError(UserError):
    """A mistake in the command line or its input, reported as one `error:` line."""


DEFAULT_NEW_TOKENS = 32        # when neither the command line nor the directory gives one
DEFAULT_BEAM_SIZE = 4
DEFAULT_FILLERS = 5            # --fill-mask's fillers per mask when --top-k is not given


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


NONE = "none"


def _id_or_none(text: str):
    """A token id >= 0, or "none" (-1 internally: turn a directory's default off)."""
    return -1 if text == NONE else _non_negative_int(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m decode", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    p.add_argument("text", nargs="*", help="inputs; stdin lines when none")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a model directory (Hugging Face layout)")
    source.add_argument("--workdir", help="a training run: its export, RUN/model")
    source.add_argument("--config",
                        help=f"a preset with random weights: {', '.join(models.list_configs())}")
    p.add_argument("--seed", type=int, default=0, help="weights and sampling seed")
    task = p.add_mutually_exclusive_group()
    task.add_argument("--fill-mask", action="store_true",
                      help="encoder-only masked-LM model: the --top-k best fillers (default "
                           f"{DEFAULT_FILLERS}) of each mask token")
    task.add_argument("--classify", action="store_true",
                      help="encoder-only classifier: label<TAB>probability of each input")
    p.add_argument("--strategy", choices=("greedy", "sample", "beam"), default=None,
                   help="default: beam when the directory's num_beams > 1, else greedy")
    p.add_argument("--max-new-tokens", type=_positive_int, default=None,
                   help=f"default: the directory's max_new_tokens or max_length, else "
                        f"{DEFAULT_NEW_TOKENS}")
    p.add_argument("--temperature", type=float, default=1.0, help="sample only")
    p.add_argument("--top-k", type=int, default=None,
                   help="sample: keep the k best tokens (default 0, off); --fill-mask: the "
                        f"fillers shown per mask (default {DEFAULT_FILLERS})")
    p.add_argument("--top-p", type=float, default=1.0, help="sample only; 1 is off")
    p.add_argument("--min-p", type=float, default=0.0, help="sample only; 0 is off")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="greedy and sample; 1 is off (default: the directory's, else 1)")
    p.add_argument("--beam-size", type=_positive_int, default=None,
                   help=f"beam only (default: the directory's num_beams, else "
                        f"{DEFAULT_BEAM_SIZE})")
    p.add_argument("--length-penalty", type=float, default=None,
                   help="beam only: alpha (default: the directory's length_penalty, else "
                        "1.0 with hf normalisation, 0.6 with gnmt)")
    p.add_argument("--length-normalization", choices=("gnmt", "hf"), default=None,
                   help="beam only: gnmt, log-prob / ((5 + len) / 6) ** alpha; hf, log-prob "
                        "/ len ** alpha (default: hf when the directory sets num_beams or "
                        "length_penalty, else gnmt)")
    p.add_argument("--eos-id", type=int, nargs="*", default=None,
                   help="end token id(s); default the model's; give none to never stop")
    p.add_argument("--forced-bos-id", type=_id_or_none, default=None, metavar="ID|none",
                   help="the first new token (default: the directory's forced_bos_token_id)")
    p.add_argument("--forced-eos-id", type=_id_or_none, default=None, metavar="ID|none",
                   help="the last new token (default: the directory's forced_eos_token_id)")
    p.add_argument("--banned-ids", type=int, nargs="*", default=None,
                   help="ids never generated (default: the directory's bad_words_ids); "
                        "give none to ban nothing")
    p.add_argument("--min-new-tokens", type=_non_negative_int, default=None,
                   help="no end token before this many (default: the directory's minimum)")
    p.add_argument("--no-repeat-ngram-size", type=_non_negative_int, default=None,
                   help="no n-gram of this size twice; 0 is off (default: the directory's)")
    p.add_argument("--batch-size", type=_positive_int, default=16,
                   help="inputs decoded together")
    p.add_argument("--truncate", action="store_true",
                   help="cut an input longer than the model takes (with a warning) instead "
                        "of stopping")
    p.add_argument("--verbose", action="store_true", help="tracebacks with errors")
    return p


def _one_line(text: str) -> str:
    """Keeps one output per line: line breaks a model generates are written as \\n, \\r."""
    return text.replace("\n", "\\n").replace("\r", "\\r")


def _note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _load(args):
    """(model, params, tokenizer or None, the decoding defaults) of the chosen source."""
    if args.config:
        try:
            cfg = models.get_config(args.config)
        except ValueError as e:
            raise UsageError(str(e)) from None
        model = models.build(cfg)
        dummy = jnp.full((1, 4), 3, jnp.int32)
        params = jax.jit(model.init)(jax.random.key(args.seed),
                                     *((dummy, dummy) if cfg.is_encoder_decoder else (dummy,)))
        eos = None if cfg.eos_id is None else (cfg.eos_id,)
        return model, params["params"], None, GenerationDefaults(eos_ids=eos)
    path = args.model or f"{args.workdir.rstrip('/')}/model"
    try:
        pre = models.load(path)
    except FileNotFoundError as e:
        hint = (f" (a run exports it when it finishes; python -m train.export --workdir "
                f"{args.workdir} writes it from a checkpoint)" if args.workdir else "")
        raise UsageError(f"{e}{hint}") from None
    _note(f"# {path}: {pre.model_type}, {pre.config.architecture}"
          + ("" if pre.tokenizer else "; no tokenizer: token ids in and out"))
    return pre.model, pre.params, pre.tokenizer, pre.generation


def _strategy(args, gen: GenerationDefaults) -> str:
    if args.strategy is not None:
        return args.strategy
    return "beam" if gen.num_beams is not None and gen.num_beams > 1 else "greedy"


def _new_tokens(args, gen: GenerationDefaults, cfg) -> int | None:
    """The number of new tokens, or None when it depends on each batch's prompt (a
    decoder-only model's max_length counts the prompt)."""
    if args.max_new_tokens is not None:
        return args.max_new_tokens
    if gen.max_new_tokens is not None:
        return gen.max_new_tokens
    if gen.max_length is not None:
        if cfg.is_encoder_decoder:
            if gen.max_length < 2:
                raise UsageError(f"the directory's max_length={gen.max_length} leaves no new "
                                 "token after the start token; pass --max-new-tokens")
            return gen.max_length - 1
        return None
    return DEFAULT_NEW_TOKENS


def decoding_options(args, gen: GenerationDefaults, cfg, strategy: str,
                     prompt_len: int) -> dict:
    """The keyword arguments of `decode.generate` / `decode.beam_search` for one batch whose
    longest input has `prompt_len` tokens: the directory's defaults, then the flags given.

        file {num_beams: 4, length_penalty: 2.0, max_length: 20}, flags --beam-size 2, an
        encoder-decoder -> beam_size 2, length_penalty 2.0, length_normalization "hf",
        max_new_tokens 19 (max_length counts the start token)
    """
    beam = strategy == "beam"
    options = (gen.beam_options if beam else gen.generate_options)(cfg, prompt_len)
    n = _new_tokens(args, gen, cfg)
    options["max_new_tokens"] = options["max_new_tokens"] if n is None else n
    if args.eos_id is not None:
        options["eos_id"] = tuple(args.eos_id) or None
    for flag, key in (("forced_bos_id", "forced_bos_id"), ("forced_eos_id", "forced_eos_id")):
        value = getattr(args, flag)
        if value is not None:
            options[key] = None if value < 0 else value
    if args.banned_ids is not None:
        options["banned_ids"] = tuple(args.banned_ids)
    if args.min_new_tokens is not None:
        options["min_new_tokens"] = args.min_new_tokens
    if args.no_repeat_ngram_size is not None:
        options["no_repeat_ngram_size"] = args.no_repeat_ngram_size
    if beam:
        from_file = gen.num_beams is not None or gen.length_penalty is not None
        norm = args.length_normalization or ("hf" if from_file else "gnmt")
        if args.length_penalty is not None:
            alpha = args.length_penalty
        elif norm == "hf":
            alpha = 1.0 if gen.length_penalty is None else gen.length_penalty
        else:
            alpha = 0.6
        size = args.beam_size or (gen.num_beams if gen.num_beams and gen.num_beams > 1
                                  else DEFAULT_BEAM_SIZE)
        options.update(beam_size=size, length_penalty=alpha, length_normalization=norm)
        return options
    sample = strategy == "sample"
    options.update(temperature=args.temperature if sample else 0.0,
                   top_k=(args.top_k or 0) if sample else 0, top_p=args.top_p if sample else 1.0,
                   min_p=args.min_p if sample else 0.0)
    if args.repetition_penalty is not None:
        options["repetition_penalty"] = args.repetition_penalty
    return options


def _encode(line: str, number: int, tok, cfg) -> list[int]:
    if tok is not None:
        return tok.encode(line, add_special_tokens=True)
    try:
        ids = [int(t) for t in line.split()]
    except ValueError:
        raise UsageError(f"input {number}: {line!r} is not a list of space-separated token "
                         "ids") from None
    bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
    if bad:
        raise UsageError(f"input {number}: token id {bad[0]} is outside [0, vocab_size="
                         f"{cfg.vocab_size})")
    return ids


def _limit(cfg, max_new_tokens: int | None, max_length: int | None = None) -> tuple[int, str]:
    """The longest input the model takes with `max_new_tokens` more (None: a decoder-only
    model's `max_length` counts the input and leaves at least one new token), and the rule
    that sets it, for error messages."""
    if cfg.is_encoder_decoder:
        if 1 + max_new_tokens > cfg.max_len:
            raise UsageError(f"max new tokens {max_new_tokens} + the start token exceeds the "
                             f"model's max_len {cfg.max_len}")
        return cfg.max_len, "max_len"
    if max_new_tokens is None:
        if max_length > cfg.max_len:
            raise UsageError(f"the directory's max_length={max_length} exceeds the model's "
                             f"max_len {cfg.max_len}; pass --max-new-tokens")
        return max_length - 1, "the directory's max_length - 1"
    if max_new_tokens >= cfg.max_len:
        raise UsageError(f"max new tokens {max_new_tokens} leaves no room for a prompt in "
                         f"the model's max_len {cfg.max_len}")
    return cfg.max_len - max_new_tokens, "max_len - max_new_tokens"


def _inputs(lines: list[str], tok, cfg, args, limit: int, rule: str) -> list[list[int] | None]:
    """Token ids of every line (None for a blank one), each checked against the model's
    length limit before anything is decoded."""
    out = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            out.append(None)
            continue
        ids = _encode(line, number, tok, cfg)
        if not ids:
            raise UsageError(f"input {number} gives no tokens")
        if len(ids) > limit:
            if not args.truncate:
                raise UsageError(
                    f"input {number} is {len(ids)} tokens long; the model takes at most "
                    f"{limit} ({rule}); shorten it or pass --truncate")
            _note(f"warning: input {number} cut from {len(ids)} to {limit} tokens")
            ids = ids[:limit]
        out.append(ids)
    return out


def _decode_batch(model, params, batch: list[list[int]], limit: int, options_for, key):
    """The new tokens of each input of `batch`, as lists."""
    width = min(decode.bucket_width(max(len(ids) for ids in batch)), limit)
    prompts, lengths = decode.pad_prompts(batch, width=width)
    strategy, options = options_for(max(len(ids) for ids in batch))
    if strategy == "beam":
        out = decode.beam_search(model, params, prompts, lengths, **options)
        tokens, n = np.asarray(out.tokens[:, 0]), np.asarray(out.lengths[:, 0])
    else:
        out = decode.generate(model, params, prompts, lengths, rng=key, **options)
        tokens, n = np.asarray(out.tokens), np.asarray(out.lengths)
    return [row[:length].tolist() for row, length in zip(tokens, n, strict=True)]


# --------------------------------------------------------------------------------------------
# Encoder-only models: --fill-mask and --classify.

# What only generation reads: refused with --fill-mask / --classify (--top-k with --classify).
_GENERATION_FLAGS = ("strategy", "max_new_tokens", "temperature", "top_p", "min_p",
                     "repetition_penalty", "beam_size", "length_penalty",
                     "length_normalization", "eos_id", "forced_bos_id", "forced_eos_id",
                     "banned_ids", "min_new_tokens", "no_repeat_ngram_size", "truncate")


def _task_flag(args) -> str | None:
    return "--fill-mask" if args.fill_mask else "--classify" if args.classify else None


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _source(args) -> str:
    if args.config:
        return f"the preset {args.config}"
    return args.model or f"{args.workdir.rstrip('/')}/model"


def _check_encoder_flags(args) -> None:
    """--fill-mask / --classify with a flag they do not read is a usage error, raised
    before any input is read or any model loaded."""
    task = _task_flag(args)
    if task is None:
        return
    defaults = build_parser()
    given = [d for d in _GENERATION_FLAGS if getattr(args, d) != defaults.get_default(d)]
    if given:
        flags = ", ".join(map(_flag, given))
        raise UsageError(f"{flags} appl{'ies' if len(given) == 1 else 'y'} to generation, "
                         f"not {task}")
    if args.classify and args.top_k is not None:
        raise UsageError("--top-k applies to sampling and --fill-mask, not --classify")


def _check_model_fits_flags(args, cfg) -> None:
    """An encoder-only model needs --fill-mask (masked-LM head) or --classify (classifier);
    any other model needs neither."""
    task, source = _task_flag(args), _source(args)
    if cfg.architecture != "encoder_only":
        if task:
            raise UsageError(f"{task} needs an encoder-only model (BERT, RoBERTa); {source} "
                             f"is {cfg.architecture}: without {task} it generates")
        return
    if cfg.num_labels:
        kind = (f"an encoder-only classifier (num_labels={cfg.num_labels}: "
                f"{', '.join(encoder.label_names(cfg))})")
        fits = "--classify"
    else:
        kind, fits = "an encoder-only masked-LM model (num_labels=0)", "--fill-mask"
    if task is None:
        raise UsageError(f"{source} is {kind}: it does not generate; pass {fits}")
    if task != fits:
        need = ("a masked-LM model (num_labels=0)" if task == "--fill-mask"
                else "a classifier (num_labels > 0)")
        raise UsageError(f"{task} needs {need}; {source} is {kind}: pass {fits}")


def _shown_token(token: str) -> str:
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
        f"{_shown_token(token)} {p:.4f}" for token, p in found)
        for m, found in enumerate(fillers, start=1))


def _encoder_inputs(args, lines: list[str], tok, cfg) -> list[list[int] | None]:
    """Token ids of every line (None for a blank one), special tokens added and checked
    against max_len (and, for --fill-mask, for a mask token) before anything runs."""
    out = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            out.append(None)
        elif tok is None:                  # --classify on a directory without a tokenizer
            ids = _encode(line, number, None, cfg)
            if len(ids) > cfg.max_len:
                raise UsageError(f"input {number} is {len(ids)} tokens long; the model takes "
                                 f"at most {cfg.max_len} (max_len)")
            out.append(ids)
        else:
            out.append(encoder_text.encode_text(tok, cfg, line, name=f"input {number}",
                                           need_mask=args.fill_mask))
    return out


def _run_encoder(args, model, params, tok, lines: list[str]) -> None:
    cfg = model.config
    if args.fill_mask:
        mask_id, mask_token = encoder_text.mask_token_of(tok, _source(args))
        k = DEFAULT_FILLERS if args.top_k is None else args.top_k
        if not 1 <= k <= cfg.vocab_size:
            raise UsageError(f"--top-k {k} must be in [1, vocab_size={cfg.vocab_size}] (the "
                             "fillers shown per mask)")
    inputs = _encoder_inputs(args, lines, tok, cfg)
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
        print("" if ids is None else _one_line(next(results)), flush=True)


def run(args) -> None:
    _check_encoder_flags(args)
    lines = args.text or sys.stdin.read().splitlines()
    model, params, tok, gen = _load(args)
    cfg = model.config
    _check_model_fits_flags(args, cfg)
    if args.fill_mask or args.classify:
        _run_encoder(args, model, params, tok, lines)
        return
    strategy = _strategy(args, gen)
    if strategy == "beam" and args.repetition_penalty is not None:
        raise UsageError("--repetition-penalty applies to greedy decoding and sampling; beam "
                         "search has none")
    unapplied = gen.unapplied(beam=strategy == "beam")
    if unapplied:
        _note(f"warning: generation settings not applied: {', '.join(unapplied)}")
    limit, rule = _limit(cfg, _new_tokens(args, gen, cfg), gen.max_length)
    inputs = _inputs(lines, tok, cfg, args, limit, rule)

    def options_for(prompt_len: int):
        options = decoding_options(args, gen, cfg, strategy, prompt_len)
        if strategy == "beam" and options["beam_size"] > cfg.vocab_size:
            given = "--beam-size" if args.beam_size else "the directory's num_beams"
            raise UsageError(f"{given} {options['beam_size']} exceeds the vocabulary "
                             f"({cfg.vocab_size} tokens)")
        return strategy, options

    todo = [i for i, ids in enumerate(inputs) if ids is not None]
    if todo:              # the options' mistakes before anything is decoded
        options_for(max(len(inputs[i]) for i in todo))
    outputs: dict[int, list[int]] = {}
    key = jax.random.key(args.seed)
    try:
        for start in range(0, len(todo), args.batch_size):
            rows = todo[start:start + args.batch_size]
            new = _decode_batch(model, params, [inputs[i] for i in rows], limit, options_for,
                                jax.random.fold_in(key, start))
            outputs.update(zip(rows, new, strict=True))
    except ValueError as e:          # decode names the argument and the limit
        raise UsageError(str(e)) from None
    for i, ids in enumerate(inputs):
        if ids is None:
            print("", flush=True)
        else:
            text = tok.decode(outputs[i]) if tok else " ".join(map(str, outputs[i]))
            print(_one_line(text), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except (UsageError, ValueError, OSError, ImportError) as e:
        if args.verbose:
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
