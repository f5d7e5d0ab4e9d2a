"""python -m bench.step_overhead [--quick] [--repeats N]

The fixed cost of batch-1 decoding on the opus-mt shape (D 512, 6+6 layers, MLP 2048,
V 32000, tied tables, float32; `bench.quantize.OPUS_MT`), all measured in one run, one JSON
line per measurement:

- `step`: one greedy step's time (the slope between 8 and 40 new tokens, best of
  `--repeats` runs, source 32), its bound (the decoder's parameter bytes at the bandwidth
  a plain product over a matrix of all of them reaches with one row, as in
  `bench.decode`), and `per_operation_share`: the step of the same program at widths
  D 64, MLP 128, V 512 (every operation, hardly any bytes) over the step. What a step
  costs besides reading its weights, operation by operation.
- `call`: a call's time with one new token (the encoder, the cross-attention keys and
  values, the first step), and the host's part of every call: `generate_arguments` (the
  checks and the cache placement) in microseconds, warm (as every call after a
  parameter structure's first) and with its per-structure cache emptied each time (as
  before this benchmark's round).
- `product`: the bandwidth a one-row product reaches over three [512, 512] matrices
  against one [512, 1536] (40 of each, distinct, so none stays in the cache).
- `joined_qkv`: the step with each self-attention's query, key and value kernels joined
  (`models.attention.fuse_qkv`, what `decode.model_fns.model_step_fn` does) over the
  step with the three apart (two programs, compiled apart; their tokens must agree).

`--quick`: tiny shapes and few runs, for the suite.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import time

import jax
import jax.numpy as jnp

import decode
import models
from bench.decode import best_of, matmul_bandwidth, step_param_bytes
from bench.quantize import OPUS_MT, TINY
from decode import model_fns, placement
from decode.generate import default_rng


class Case:
    """One shape's model, parameters and batch-1 source."""

    def __init__(self, fields: dict, src_len: int):
        self.config = models.TransformerConfig(**fields)
        self.model = models.build(self.config)
        tokens = jnp.full((1, 8), 3, jnp.int32)
        self.params = jax.jit(self.model.init)(jax.random.key(0), tokens, tokens)["params"]
        self.src = jax.random.randint(jax.random.key(1), (1, src_len), 3,
                                      self.config.vocab_size)
        self.lengths = jnp.array([src_len], jnp.int32)

    def run(self, new: int, joined: bool = True):
        """A greedy call of `new` tokens; `joined=False` keeps the three kernels apart."""
        def call():
            model_fns.fuse_qkv = _FUSE if joined else (lambda params: params)
            try:            # distinct cache lengths: the two programs compile apart
                return decode.generate(self.model, self.params, self.src, self.lengths,
                                       max_new_tokens=new, eos_id=None,
                                       cache_len=new + 2 + (not joined)).tokens
            finally:
                model_fns.fuse_qkv = _FUSE
        return call


_FUSE = model_fns.fuse_qkv


def step_times(case: Case, repeats: int, short: int, long: int,
               ways=(True, False)) -> dict[bool, float]:
    """Seconds per step, joined and apart (`ways`), interleaved run by run (a shared
    machine drifts). Both ways must give the same tokens, or the comparison is refused."""
    calls = {(joined, n): case.run(n, joined) for joined in ways for n in (short, long)}
    tokens = {key: jax.block_until_ready(call()) for key, call in calls.items()}
    if len(ways) > 1 and not (tokens[True, long] == tokens[False, long]).all():
        raise AssertionError("the joined and apart steps chose different tokens")
    best = dict.fromkeys(calls, math.inf)
    for _ in range(repeats):
        for key, call in calls.items():
            best[key] = min(best[key], best_of(call, 1))
    return {joined: (best[joined, long] - best[joined, short]) / (long - short)
            for joined in ways}


def host_us(case: Case, repeats: int) -> dict[str, float]:
    """`generate_arguments`' time per call: warm, and with its caches emptied each call."""
    def arguments():
        return decode.generate_arguments(case.model, case.params, case.src, case.lengths,
                                         max_new_tokens=8, eos_id=None)

    def cold():
        placement._KERNEL_INDICES.clear()
        default_rng.cache_clear()
        return arguments()

    out = {}
    for name, fn in (("warm", arguments), ("per_structure_cache_emptied", cold)):
        fn()
        out[name] = min(_timed_host(fn) for _ in range(repeats)) * 1e6
    return out


def _timed_host(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def product_bandwidths(rows: int, width: int, layers: int, repeats: int) -> dict[str, float]:
    """Bytes/s of one-row products over three [w, w] matrices a layer against one [w, 3w]."""
    keys = iter(jax.random.split(jax.random.key(2), 3 * layers))
    apart = [[jax.random.normal(next(keys), (width, width)) * 0.02 for _ in range(3)]
             for _ in range(layers)]
    joined = [jnp.concatenate(ws, axis=1) for ws in apart]

    def three(x, ws):
        for a, b, c in ws:
            x = jnp.tanh(x @ a + x @ b + x @ c)
        return x

    def one(x, ws):
        for w in ws:
            y = x @ w
            x = jnp.tanh(y[:, :width] + y[:, width:2 * width] + y[:, 2 * width:])
        return x

    x = jnp.ones((rows, width))
    n_bytes = layers * 3 * width * width * 4
    out = {}
    for name, fn, ws in (("three_products", three, apart), ("one_product", one, joined)):
        f = jax.jit(fn)
        jax.block_until_ready(f(x, ws))
        out[name] = n_bytes / best_of(functools.partial(f, x, ws), repeats)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.step_overhead",
                                     description=__doc__.split("\n")[2])
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes and few runs (a smoke test, not a measurement)")
    parser.add_argument("--repeats", type=int, default=9, help="timed runs of each call")
    args = parser.parse_args(argv)
    print(json.dumps({"device": jax.devices()[0].device_kind,
                      "platform": jax.devices()[0].platform, "jax": jax.__version__}),
          flush=True)
    repeats = 2 if args.quick else args.repeats
    full = dict(TINY, max_len=64) if args.quick else dict(OPUS_MT, max_len=128)
    narrow = dict(full, d_model=64, mlp_dim=128, vocab_size=512)
    short, long = (2, 6) if args.quick else (8, 40)
    src_len = 8 if args.quick else 32

    case = Case(full, src_len)
    steps = step_times(case, repeats, short, long)
    narrow_step = step_times(Case(narrow, src_len), repeats, short, long, (True,))[True]
    n_bytes = step_param_bytes(case.params)
    bound = n_bytes / matmul_bandwidth(n_bytes, 1)
    print(json.dumps(dict(
        section="step", shape="tiny" if args.quick else "opus-mt", batch=1,
        step_ms=round(steps[True] * 1e3, 3), bound_ms=round(bound * 1e3, 3),
        fraction_of_bound=round(bound / steps[True], 3),
        narrow_step_ms=round(narrow_step * 1e3, 3),
        per_operation_share=round(narrow_step / steps[True], 3))), flush=True)

    one_token = best_of(case.run(1), repeats)
    print(json.dumps(dict(section="call", one_new_token_ms=round(one_token * 1e3, 2),
                          **{f"host_us_{k}": round(v, 1)
                             for k, v in host_us(case, 5 * repeats).items()})), flush=True)

    width, layers = (64, 4) if args.quick else (512, 40)
    bandwidths = product_bandwidths(1, width, layers, repeats)
    print(json.dumps(dict(section="product", rows=1, width=width, layers=layers,
                          **{f"{k}_GB_per_s": round(v / 1e9, 2) for k, v in bandwidths.items()},
                          one_over_three=round(bandwidths["one_product"]
                                               / bandwidths["three_products"], 3))),
          flush=True)
    print(json.dumps(dict(section="joined_qkv", step_ms_apart=round(steps[False] * 1e3, 3),
                          step_ms_joined=round(steps[True] * 1e3, 3),
                          speedup=round(steps[False] / steps[True], 3))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
