"""python -m bench.compile_cache [--quick]

Compile once per machine: the first `decode.generate` and `decode.beam_search` calls in a
process that starts with an empty persistent compilation cache, then in a second process
with the same shapes that finds the first one's executables (`models.use_compile_cache`)
and traced programs (`decode.trace_cache`: it neither traces nor lowers the model again).
Each process is a fresh interpreter and times, per strategy, its first call (tracing,
compilation or a cache hit, and one run) and a second call (the run alone); the
difference, `start_s`, is what starting costs. One JSON line per process and strategy,
then per strategy the ratios second process / first of the first call and of `start_s`
(the goal is at most 0.25).

Two cases (`case_config`): the model `make demo` trains, decoding three sentences as its
command line does, and bench.decode's decoder-only shape at batch 8 (224 new tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

PROGRAM = """
import json, sys, time
import jax, jax.numpy as jnp
import models, decode
from bench.compile_cache import case_config
models.use_compile_cache(sys.argv[1])
cfg, batch, prompt, new = case_config(sys.argv[2])
model = models.build(cfg)
inputs = (jnp.zeros((1, 4), jnp.int32),) * (2 if cfg.is_encoder_decoder else 1)
params = model.init(jax.random.key(0), *inputs)["params"]
prompts = jax.random.randint(jax.random.key(1), (batch, prompt), 3, cfg.vocab_size)
lengths = jnp.full((batch,), prompt, jnp.int32)
calls = {
    "greedy": lambda: decode.generate(model, params, prompts, lengths, max_new_tokens=new,
                                      eos_id=None).tokens,
    "beam4": lambda: decode.beam_search(model, params, prompts, lengths, beam_size=4,
                                        max_new_tokens=new, eos_id=None).tokens,
}
for strategy, call in calls.items():
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - t0)
    print(json.dumps({"strategy": strategy, "first_call_s": times[0], "run_s": times[1],
                      "start_s": times[0] - times[1]}))
"""

CASES = ("default_model", "bench_decode")


def case_config(case: str):
    """(config, batch, prompt length, new tokens) of a case: `default_model` is the model
    `python -m train` makes (the encoder-decoder `make demo` translates with), decoding
    three sentences as the demo's command line does; `bench_decode` is bench.decode's
    decoder-only shape at batch 8; `quick` a tiny decoder-only model (the tests)."""
    import models
    if case == "default_model":
        return models.get_config("transformer-tiny", d_model=128, num_heads=4, mlp_dim=256,
                                 num_encoder_layers=2, num_decoder_layers=2, vocab_size=1024,
                                 dropout_rate=0.0, max_len=128), 3, 16, 32
    from bench.decode import DECODER_ONLY
    if case == "bench_decode":
        return models.TransformerConfig(**dict(DECODER_ONLY, max_len=256)), 8, 32, 224
    if case == "quick":
        return models.TransformerConfig(**dict(
            DECODER_ONLY, num_layers=2, d_model=64, num_heads=4, mlp_dim=128, vocab_size=256,
            max_len=64)), 2, 8, 16
    raise ValueError(f"unknown case {case!r}")


def one_process(cache_dir: str, case: str) -> list[dict]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", PROGRAM, cache_dir, case],
                          capture_output=True, text=True, check=True, cwd=root,
                          env={**os.environ, "PYTHONPATH": root})
    return [json.loads(line) for line in done.stdout.strip().splitlines()
            if line.startswith("{")]


def one_case(case: str) -> list[dict]:
    """Both processes' lines of `case`, then a ratio line per strategy."""
    lines, by_process = [], {}
    with tempfile.TemporaryDirectory(prefix="compile-cache-") as cache_dir:
        for process in ("first", "second"):
            by_process[process] = {}
            for measured in one_process(cache_dir, case):
                line = {"case": case, "process": process,
                        **{k: (round(v, 3) if isinstance(v, float) else v)
                           for k, v in measured.items()}}
                by_process[process][line["strategy"]] = line
                lines.append(line)
                print(json.dumps(line), flush=True)
    for strategy, first in by_process["first"].items():
        second = by_process["second"][strategy]
        ratio = {"case": case, "strategy": strategy,
                 "first_call_second_over_first": round(
                     second["first_call_s"] / first["first_call_s"], 3),
                 "start_second_over_first": round(
                     max(second["start_s"], 0.0) / first["start_s"], 3)}
        lines.append(ratio)
        print(json.dumps(ratio), flush=True)
    return lines


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m bench.compile_cache",
                                description=__doc__.split("\n")[2])
    p.add_argument("--quick", action="store_true", help="a tiny model (the tests)")
    args = p.parse_args(argv)
    lines = []
    for case in ("quick",) if args.quick else CASES:
        lines += one_case(case)
    return lines


if __name__ == "__main__":
    main()
