"""python -m decode --workdir DIR | --config PRESET [--strategy greedy|sample|beam] [TEXT ...]

Decodes each TEXT (or each line of stdin when no TEXT is given) and prints one output per
line (a line break inside an output is written as \\n). With --workdir, the newest
checkpoint of a training run is restored (parameters only, on CPU) with its tokenizer, and
texts are text. With --config, the model is the preset with random weights (seeded by
--seed) and texts are space-separated token ids.

    python -m decode --workdir runs/default "the dog sees a cat ."
    echo "5 6 7" | python -m decode --config transformer-tiny --strategy beam --beam-size 4
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import decode
import models


def _parse_ids(line: str, lineno: int) -> list[int]:
    try:
        ids = [int(t) for t in line.split()]
    except ValueError:
        raise SystemExit(
            f"input {lineno}: {line!r} is not a list of space-separated token ids") from None
    if not ids:
        raise SystemExit(f"input {lineno} is empty")
    return ids


def _one_line(text: str) -> str:
    """Keeps one output per line: line breaks a model generates are written as \\n, \\r."""
    return text.replace("\n", "\\n").replace("\r", "\\r")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m decode", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    p.add_argument("text", nargs="*", help="inputs; stdin lines when none")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--workdir", help="a training run's directory (text in, text out)")
    source.add_argument("--config",
                        help=f"a preset with random weights: {', '.join(models.list_configs())}")
    p.add_argument("--seed", type=int, default=0, help="weights and sampling seed")
    p.add_argument("--strategy", choices=("greedy", "sample", "beam"), default="greedy")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0, help="sample only")
    p.add_argument("--top-k", type=int, default=0, help="sample only; 0 is off")
    p.add_argument("--top-p", type=float, default=1.0, help="sample only; 1 is off")
    p.add_argument("--min-p", type=float, default=0.0, help="sample only; 0 is off")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 is off")
    p.add_argument("--beam-size", type=int, default=4, help="beam only")
    p.add_argument("--length-penalty", type=float, default=0.6, help="beam only (GNMT alpha)")
    p.add_argument("--eos-id", type=int, nargs="*", default=None,
                   help="end token id(s); default the config's eos_id; give none to never stop")
    p.add_argument("--batch-size", type=int, default=16, help="inputs decoded together")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    lines = args.text or [line for line in sys.stdin.read().splitlines() if line.strip()]
    key = jax.random.key(args.seed)
    tok = None
    if args.workdir:
        import ml_collections

        from train.checkpoint import restore_for_decoding  # decode never needs train otherwise
        from train.model_config import model_config
        try:
            params, run_config, tok, step = restore_for_decoding(args.workdir)
        except FileNotFoundError as e:
            raise SystemExit(f"error: {e}") from None
        cfg = model_config(ml_collections.ConfigDict(run_config), tok.vocab_size)
        model = models.build(cfg)
        print(f"# {args.workdir}: step {step}, {cfg.architecture}", file=sys.stderr)
        inputs = [tok.encode(line) + [cfg.eos_id] if cfg.is_encoder_decoder
                  else [cfg.bos_id] + tok.encode(line) for line in lines]
    else:
        try:
            cfg = models.get_config(args.config)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        model = models.build(cfg)
        dummy = jnp.full((1, 4), 3, jnp.int32)
        params = jax.jit(model.init)(
            key, *((dummy, dummy) if cfg.is_encoder_decoder else (dummy,)))["params"]
        inputs = [_parse_ids(line, i + 1) for i, line in enumerate(lines)]
    eos = cfg.eos_id if args.eos_id is None else (tuple(args.eos_id) or None)
    try:
        for start in range(0, len(inputs), args.batch_size):
            prompts, lengths = decode.pad_prompts(inputs[start:start + args.batch_size])
            if args.strategy == "beam":
                out = decode.beam_search(
                    model, params, prompts, lengths, beam_size=args.beam_size,
                    max_new_tokens=args.max_new_tokens, length_penalty=args.length_penalty,
                    eos_id=eos)
                tokens, n = np.asarray(out.tokens[:, 0]), np.asarray(out.lengths[:, 0])
            else:
                sample = args.strategy == "sample"
                out = decode.generate(
                    model, params, prompts, lengths, max_new_tokens=args.max_new_tokens,
                    rng=jax.random.fold_in(key, start), eos_id=eos,
                    temperature=args.temperature if sample else 0.0,
                    top_k=args.top_k if sample else 0, top_p=args.top_p if sample else 1.0,
                    min_p=args.min_p if sample else 0.0,
                    repetition_penalty=args.repetition_penalty)
                tokens, n = np.asarray(out.tokens), np.asarray(out.lengths)
            for row, length in zip(tokens, n, strict=True):
                print(_one_line(tok.decode(row[:length])) if tok
                      else " ".join(str(t) for t in row[:length]), flush=True)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
