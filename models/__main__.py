"""python -m models --config NAME [--batch B] [--length T] [--KEY=VALUE ...]

Builds a preset, initialises it, runs the teacher-forced forward pass under jit and prints
the parameter count, the shapes and the forward time (compile, then the mean of 5 calls).
"""

from __future__ import annotations

import argparse
import ast
import math
import time

import jax

import models


def _parse_overrides(pairs: list[str]) -> dict:
    overrides = {}
    for pair in pairs:
        if not pair.startswith("--") or "=" not in pair:
            raise SystemExit(f"override {pair!r} must look like --KEY=VALUE")
        k, v = pair[2:].split("=", 1)
        try:
            overrides[k] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            overrides[k] = v
    return overrides


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m models",
                                     description=__doc__.split("\n")[2])
    parser.add_argument("--config", default="transformer-tiny",
                        help=f"one of {models.list_configs()}")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    args, rest = parser.parse_known_args(argv)
    cfg = models.get_config(args.config, **_parse_overrides(rest))
    model = models.build(cfg)
    key = jax.random.key(0)
    tokens = jax.random.randint(key, (args.batch, args.length), 3, cfg.vocab_size)
    src = tokens if cfg.audio is None else jax.random.normal(   # an audio encoder's features
        key, (args.batch, cfg.audio.num_mel_bins, cfg.audio.num_frames))
    inputs = (src, tokens) if cfg.is_encoder_decoder else (tokens,)
    params = jax.jit(model.init)(key, *inputs)["params"]
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    forward = jax.jit(lambda p, *xs: model.apply({"params": p}, *xs))
    t0 = time.perf_counter()
    logits = forward(params, *inputs).block_until_ready()
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(5):
        logits = forward(params, *inputs)
    logits.block_until_ready()
    step_s = (time.perf_counter() - t0) / 5
    print(f"config      {args.config}: {cfg.architecture}, L={cfg.decoder_layers}, "
          f"D={cfg.d_model}, N={cfg.num_heads}, K={cfg.num_kv_heads}, positions={cfg.positions}, "
          f"norm={cfg.norm}/{cfg.norm_position}, activation={cfg.activation}")
    print(f"parameters  {n_params:,}")
    print(f"inputs      {' + '.join(str(x.shape) for x in inputs)} -> logits {logits.shape} "
          f"{logits.dtype}")
    print(f"forward     compile {compile_s:.2f} s, then {step_s * 1e3:.2f} ms per call "
          f"({args.batch * args.length / step_s:,.0f} tokens/s) on {jax.devices()[0].platform}")


if __name__ == "__main__":
    main()
