"""python -m decode --model DIR | --workdir RUN | --config PRESET [options] [TEXT ...]

Decodes each TEXT (or each line of stdin when no TEXT is given) and prints exactly one
output line per input line, in order: a blank input gives a blank output, and a line break
inside an output is written as \\n.

--model reads a model directory (a Hugging Face one, or a training run's export): text in,
text out with its tokenizer, which adds its own special tokens (GPT-2 none, Llama a leading
BOS, a run's encoder-decoder export a trailing EOS); the end tokens default to the
directory's generation_config.json. A directory without tokenizer files, and --config (a
preset with random weights, seeded by --seed), take and print space-separated token ids.
--workdir RUN is --model RUN/model.

    python -m decode --model runs/default/model "the dog sees a cat ."
    echo "5 6 7" | python -m decode --config transformer-tiny --strategy beam --beam-size 4

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


class UsageError(ValueError):
    """A mistake in the command line or its input, reported as one `error:` line."""


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


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
    p.add_argument("--strategy", choices=("greedy", "sample", "beam"), default="greedy")
    p.add_argument("--max-new-tokens", type=_positive_int, default=32)
    p.add_argument("--temperature", type=float, default=1.0, help="sample only")
    p.add_argument("--top-k", type=int, default=0, help="sample only; 0 is off")
    p.add_argument("--top-p", type=float, default=1.0, help="sample only; 1 is off")
    p.add_argument("--min-p", type=float, default=0.0, help="sample only; 0 is off")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 is off")
    p.add_argument("--beam-size", type=_positive_int, default=4, help="beam only")
    p.add_argument("--length-penalty", type=float, default=0.6, help="beam only (GNMT alpha)")
    p.add_argument("--eos-id", type=int, nargs="*", default=None,
                   help="end token id(s); default the model's; give none to never stop")
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
    """(model, params, tokenizer or None, default end ids) of the chosen source."""
    if args.config:
        try:
            cfg = models.get_config(args.config)
        except ValueError as e:
            raise UsageError(str(e)) from None
        model = models.build(cfg)
        dummy = jnp.full((1, 4), 3, jnp.int32)
        params = jax.jit(model.init)(jax.random.key(args.seed),
                                     *((dummy, dummy) if cfg.is_encoder_decoder else (dummy,)))
        return model, params["params"], None, cfg.eos_id
    path = args.model or f"{args.workdir.rstrip('/')}/model"
    try:
        pre = models.load(path)
    except FileNotFoundError as e:
        hint = (f" (a run exports it when it finishes; python -m train.export --workdir "
                f"{args.workdir} writes it from a checkpoint)" if args.workdir else "")
        raise UsageError(f"{e}{hint}") from None
    _note(f"# {path}: {pre.model_type}, {pre.config.architecture}"
          + ("" if pre.tokenizer else "; no tokenizer: token ids in and out"))
    return pre.model, pre.params, pre.tokenizer, pre.generation.eos_ids


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


def _limit(cfg, max_new_tokens: int) -> int:
    """The longest input the model takes with `max_new_tokens` more."""
    if cfg.is_encoder_decoder:
        if 1 + max_new_tokens > cfg.max_len:
            raise UsageError(f"--max-new-tokens {max_new_tokens} + the start token exceeds the "
                             f"model's max_len {cfg.max_len}")
        return cfg.max_len
    if max_new_tokens >= cfg.max_len:
        raise UsageError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in "
                         f"the model's max_len {cfg.max_len}")
    return cfg.max_len - max_new_tokens


def _inputs(lines: list[str], tok, cfg, args) -> list[list[int] | None]:
    """Token ids of every line (None for a blank one), each checked against the model's
    length limit before anything is decoded."""
    limit = _limit(cfg, args.max_new_tokens)
    rule = "max_len" if cfg.is_encoder_decoder else "max_len - max_new_tokens"
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


def _decode_batch(model, params, batch: list[list[int]], limit: int, args, eos, key):
    """The new tokens of each input of `batch`, as lists."""
    width = min(decode.bucket_width(max(len(ids) for ids in batch)), limit)
    prompts, lengths = decode.pad_prompts(batch, width=width)
    if args.strategy == "beam":
        out = decode.beam_search(model, params, prompts, lengths, beam_size=args.beam_size,
                                 max_new_tokens=args.max_new_tokens,
                                 length_penalty=args.length_penalty, eos_id=eos)
        tokens, n = np.asarray(out.tokens[:, 0]), np.asarray(out.lengths[:, 0])
    else:
        sample = args.strategy == "sample"
        out = decode.generate(
            model, params, prompts, lengths, max_new_tokens=args.max_new_tokens, rng=key,
            eos_id=eos, temperature=args.temperature if sample else 0.0,
            top_k=args.top_k if sample else 0, top_p=args.top_p if sample else 1.0,
            min_p=args.min_p if sample else 0.0, repetition_penalty=args.repetition_penalty)
        tokens, n = np.asarray(out.tokens), np.asarray(out.lengths)
    return [row[:length].tolist() for row, length in zip(tokens, n, strict=True)]


def run(args) -> None:
    lines = args.text or sys.stdin.read().splitlines()
    model, params, tok, default_eos = _load(args)
    cfg = model.config
    if args.strategy == "beam" and args.beam_size > cfg.vocab_size:
        raise UsageError(f"--beam-size {args.beam_size} exceeds the vocabulary "
                         f"({cfg.vocab_size} tokens)")
    eos = default_eos if args.eos_id is None else (tuple(args.eos_id) or None)
    inputs = _inputs(lines, tok, cfg, args)
    limit = _limit(cfg, args.max_new_tokens)
    todo = [i for i, ids in enumerate(inputs) if ids is not None]
    outputs: dict[int, list[int]] = {}
    key = jax.random.key(args.seed)
    try:
        for start in range(0, len(todo), args.batch_size):
            rows = todo[start:start + args.batch_size]
            new = _decode_batch(model, params, [inputs[i] for i in rows], limit, args, eos,
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
