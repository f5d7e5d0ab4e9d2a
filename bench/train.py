"""python -m bench.train [--model transformer-base] [--batch 16] [--lengths 64 64] [--dtype D]
       python -m bench.train --fake-devices 4 --parallel sharded --mesh 1 4 1 --mesh 1 2 2
       python -m bench.train --fake-devices 4 --memory-budget 8GiB [--search-width 2048]

Training throughput and model FLOP utilisation of the real train step (`train.step` under
`train.parallel`, adamw, clipping, label smoothing, dropout), one JSON line per measurement,
all measured in one run:

- `peak`: a square matmul in the step's dtype (the best of several runs), the most the
  machine gives the step's own kind of work; on a GPU with a known datasheet also the
  chip's dense peak for that dtype.
- `train`: compile time (first call, minus one step), the best and median step time over
  `--steps` steps, target tokens per second, and model FLOP utilisation against the
  measured peak (and the chip peak where known).

Model FLOPs per step are counted analytically, as is usual for MFU: 6 x (matmul parameters
each token passes through) x tokens, plus attention (QK^T and AV, 2 x 2 x T x S x N x H per
layer forward, times 3 with the backward). For an encoder-decoder, source tokens pass the
encoder and each decoder layer's cross-attention K/V projection; target tokens pass the
decoder layers and the output projection. Norms, softmax, dropout and the optimiser are not
counted (they are in the measured time), nor is the embedding lookup.

`--parallel sharded` (`train.sharding`: the step under `jax.jit` over a (data, fsdp,
tensor) mesh) measures the same model, initial state and batch under pmap first, then under
each `--mesh DATA FSDP TENSOR` (repeat the flag for several meshes; -1 is the devices the
others leave; default one mesh, 1 -1 1: FSDP over every device). Each step is compiled once
with `lower(...).compile()` (`compile_s`) and that executable is timed, the batch placed
anew each step as training does. Every `train` line of this mode adds the per-device
memory of the compiled step (`memory_analysis()`):

    state_bytes        arguments minus this device's batch rows: its part of the state
    temp_bytes         XLA's scratch: activations kept for the backward pass, gradients,
                       parameters all-gathered for use (fsdp), optimiser temporaries
    per_device_bytes   arguments + temp + outputs not aliased to a donated argument (the
                       state is donated, so only the metrics): what the step holds at once

and each sharded line its ratios to the pmap line of the same run: `step_time_ratio` (best
step times, sharded / pmap: below 1 is faster), `memory_ratio` (per_device_bytes) and
`state_ratio` (state_bytes).

`--memory-budget SIZE` runs the search of `bench/largest.py` instead (its docstring).

`--fake-devices N` runs on N CPU devices (`jax_num_cpu_devices`, set before JAX starts).
They share the host's cores, so their timings are indicative and only the ratios mean
anything; memory is XLA's CPU buffer assignment, close to a GPU's but not the same.
"""

from __future__ import annotations

import argparse
import json
import statistics

import jax
import jax.numpy as jnp
import numpy as np

import models
from bench import chips
from bench.common import (
    bench_settings,
    compile_step,
    make_state_fn,
    make_wrapper,
    param_count,
    step_memory,
)
from bench.decode import best_of, timed
from bench.largest import largest_models, parse_bytes
from models.layers import GATED


def chip_peak(dtype: str) -> float | None:
    """The device's dense datasheet peak for `dtype` (`bench.chips`), None if unknown."""
    chip = chips.find(jax.devices()[0].device_kind)
    return chip.peak(dtype) if chip else None


def measured_peak(dtype: str, n: int, repeats: int = 5) -> float:
    """FLOP/s of the best of `repeats` runs of an [n, n] @ [n, n] matmul."""
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda a, b: a @ b)
    f(a, a).block_until_ready()
    return 2 * n ** 3 / best_of(lambda: f(a, a), repeats)


def model_flops(cfg: models.TransformerConfig, batch: int, src_len: int, tgt_len: int) -> dict:
    """Analytic training FLOPs of one step (forward + backward = 3 x forward)."""
    nh = cfg.num_heads * cfg.head_dim
    q_o = 2 * cfg.d_model * nh                                  # query and output projections
    kv = 2 * cfg.d_model * cfg.num_kv_heads * cfg.head_dim      # key and value projections
    mlp = (3 if cfg.activation in GATED else 2) * cfg.d_model * cfg.mlp_dim
    out_proj = cfg.d_model * cfg.vocab_size

    def attn_qk_av(t, s):                                   # forward FLOPs, one layer, one row
        return 2 * 2 * t * s * nh

    if cfg.is_encoder_decoder:
        enc, dec = cfg.num_encoder_layers, cfg.num_decoder_layers
        # Source tokens: the encoder, and every decoder layer's cross-attention K/V.
        per_src = enc * (q_o + kv + mlp) + dec * kv
        # Target tokens: self-attention, cross-attention queries and outputs, MLP, logits.
        per_tgt = dec * (q_o + kv + q_o + mlp) + out_proj
        dense = 2 * batch * (src_len * per_src + tgt_len * per_tgt)
        attn = batch * (enc * attn_qk_av(src_len, src_len)
                        + dec * (attn_qk_av(tgt_len, tgt_len) + attn_qk_av(tgt_len, src_len)))
    else:
        per_src = 0
        per_tgt = cfg.num_layers * (q_o + kv + mlp) + out_proj
        dense = 2 * batch * tgt_len * per_tgt
        attn = batch * cfg.num_layers * attn_qk_av(tgt_len, tgt_len)
    return {"matmul_params_per_source_token": per_src,
            "matmul_params_per_target_token": per_tgt,
            "model_flops_per_step": 3 * (dense + attn), "attention_share": attn / (dense + attn)}


def make_batch(cfg, devices: int, batch: int, lengths: tuple[int, int], *, seed: int = 0):
    """Full rows of random tokens, `[R, batch / R, W]`, with the pipeline's keys; `lengths`
    are (source, target)."""
    r = np.random.default_rng(seed)
    out = {}
    src_len, tgt_len = lengths
    sides = (("inputs", src_len), ("targets", tgt_len)) if cfg.is_encoder_decoder else \
        (("targets", tgt_len),)
    for side, w in sides:
        out[side] = r.integers(4, cfg.vocab_size, (batch, w)).astype(np.int32)
        out[f"{side}_segmentation"] = np.ones((batch, w), np.int32)
        out[f"{side}_position"] = np.tile(np.arange(w, dtype=np.int32), (batch, 1))
    return {k: v.reshape(devices, batch // devices, -1) for k, v in out.items()}


def use_fake_devices(n: int) -> None:
    """Run on `n` CPU devices. Must come before JAX starts a backend; a JAX already started
    with `n` CPU devices (the test suite's) is accepted.

    Raises:
        SystemExit: JAX has already started with other devices (naming both).
    """
    try:
        jax.config.update("jax_num_cpu_devices", n)
        jax.config.update("jax_platforms", "cpu")
    except RuntimeError:
        pass                                        # already started: check what it has
    if jax.default_backend() != "cpu" or jax.device_count() != n:
        raise SystemExit(f"--fake-devices {n}: JAX has already started with "
                         f"{jax.device_count()} {jax.default_backend()} device(s)")


def time_compiled(wrapper, compiled, state, batch, steps: int) -> tuple[float, float]:
    """(best, median) seconds of `steps` steps of `compiled` after one untimed step; the
    batch is placed on the devices within each step, as in training."""
    def step():
        nonlocal state
        state, metrics = compiled(state, wrapper.put_batch(batch))
        return metrics

    step()
    times = [timed(step)[1] for _ in range(steps)]
    return min(times), statistics.median(times)


def compare_meshes(cfg, batch: dict, mesh_shapes, *, name: str, lengths: tuple[int, int],
                   steps: int, common: dict, peak: float, chip: float | None) -> list[dict]:
    """`train` lines for pmap, then for each mesh with its ratios to pmap (see the module
    docstring), each printed as it is measured.

    Args:
        batch: per-device rows `[R, B, W]` (`make_batch`); lengths: (source, target).

    Raises:
        SystemExit: a mesh that does not fit the devices, the model's heads or the batch.
    """
    model = models.build(cfg)
    settings = bench_settings()
    src_len, tgt_len = lengths
    rows = batch["targets"].shape[0] * batch["targets"].shape[1]
    shapes = {k: (rows, v.shape[2]) for k, v in batch.items()}
    flops = model_flops(cfg, rows, src_len, tgt_len)
    n_params = param_count(model)
    wrappers = []                       # all made first: a bad mesh stops before any work
    for mesh_shape in [None, *mesh_shapes]:
        try:
            wrappers.append(make_wrapper(model, settings, mesh_shape=mesh_shape, rows=rows))
        except ValueError as e:
            raise SystemExit(f"error: --mesh {' '.join(map(str, mesh_shape))}: {e}") from None
    lines = []
    for (wrapper, tx), mesh_shape in zip(wrappers, [None, *mesh_shapes], strict=True):
        compiled, compile_s, batch_bytes = compile_step(wrapper, model, tx, shapes)
        state = wrapper.init_state(make_state_fn(model, tx))
        best, median = time_compiled(wrapper, compiled, state, batch, steps)
        del state
        line = {
            "what": "train", **common, "parallel": "pmap" if mesh_shape is None else "sharded",
            "mesh": None if mesh_shape is None else {       # expert only where split
                k: v for k, v in wrapper.mesh.shape.items() if k != "expert" or v > 1},
            "model": name, "vocab_size": cfg.vocab_size,
            "batch": rows, "source_length": src_len if cfg.is_encoder_decoder else None,
            "target_length": tgt_len, "params": n_params, **flops,
            "compile_s": round(compile_s, 2), "step_s_best": round(best, 4),
            "step_s_median": round(median, 4),
            "target_tokens_per_s": round(rows * tgt_len / best, 1),
            "model_flops_per_s": round(flops["model_flops_per_step"] / best),
            "mfu_vs_measured_peak": round(flops["model_flops_per_step"] / best / peak, 4),
            "mfu_vs_chip_peak": (round(flops["model_flops_per_step"] / best / chip, 4)
                                 if chip else None),
            **step_memory(compiled, batch_bytes),
        }
        if lines:
            ref = lines[0]
            line["step_time_ratio"] = round(best / ref["step_s_best"], 3)
            for ratio, key in (("memory_ratio", "per_device_bytes"),
                               ("state_ratio", "state_bytes")):
                if key in line and key in ref:
                    line[ratio] = round(line[key] / ref[key], 4)
        print(json.dumps(line), flush=True)
        lines.append(line)
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.train", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="transformer-base", help="a preset name")
    p.add_argument("--vocab-size", type=int, default=None, help="default: the preset's")
    p.add_argument("--batch", type=int, default=16, help="global rows per step")
    p.add_argument("--lengths", type=int, nargs=2, default=(64, 64), metavar=("SRC", "TGT"))
    p.add_argument("--dtype", default=None,
                   help="compute dtype (parameters stay float32); default float32 on CPU, "
                        "bfloat16 on an accelerator")
    p.add_argument("--steps", type=int, default=10, help="timed steps after compilation")
    p.add_argument("--peak-size", type=int, default=None,
                   help="n of the peak matmul (default 2048 on CPU, 8192 on an accelerator)")
    p.add_argument("--parallel", default="pmap", choices=("pmap", "shard_map", "sharded"),
                   help="sharded: pmap, then the step under jit on each --mesh, with ratios")
    p.add_argument("--mesh", type=int, nargs=3, action="append", default=None,
                   metavar=("DATA", "FSDP", "TENSOR"),
                   help="a (data, fsdp, tensor) mesh for --parallel sharded; repeat for "
                        "several (-1: the devices the others leave; default 1 -1 1)")
    p.add_argument("--dropout", type=float, default=None, help="default: the preset's")
    p.add_argument("--fake-devices", type=int, default=None, metavar="N",
                   help="run on N CPU devices (timings indicative: compare ratios only)")
    p.add_argument("--memory-budget", type=parse_bytes, default=None, metavar="SIZE",
                   help="instead of timing: the largest Llama-style model whose step "
                        "compiles within SIZE per device (4GiB, 3.5GB, 1e9), pmap vs fsdp")
    p.add_argument("--search-width", type=int, default=2048, help="d_model of the search")
    p.add_argument("--search-vocab", type=int, default=32_000, help="vocabulary of the search")
    p.add_argument("--search-length", type=int, default=128, help="tokens per row, search")
    args = p.parse_args(argv)

    if args.fake_devices:
        use_fake_devices(args.fake_devices)
    if args.mesh and args.parallel != "sharded":
        raise SystemExit("error: --mesh needs --parallel sharded")
    accel = jax.default_backend() != "cpu"
    dtype = args.dtype or ("bfloat16" if accel else "float32")
    devices = jax.local_device_count()
    common = dict(backend=jax.default_backend(), device=jax.devices()[0].device_kind,
                  devices=devices, dtype=dtype)
    if args.memory_budget is not None:
        def report(line):
            print(json.dumps(line), flush=True)
        found = largest_models(args.memory_budget, d_model=args.search_width,
                               vocab_size=args.search_vocab, length=args.search_length,
                               dtype=dtype, report=report)
        print(json.dumps({"what": "largest_under_budget", **common, **found}), flush=True)
        return
    if args.batch % devices:
        raise SystemExit(f"--batch {args.batch} must be a multiple of the {devices} devices")
    src_len, tgt_len = args.lengths
    overrides = {"dtype": dtype, "max_len": max(src_len, tgt_len, 8)}
    if args.vocab_size:
        overrides["vocab_size"] = args.vocab_size
    if args.dropout is not None:
        overrides["dropout_rate"] = args.dropout
    try:
        cfg = models.get_config(args.model, **overrides)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None

    peak = measured_peak(dtype, args.peak_size or (8192 if accel else 2048))
    chip = chip_peak(dtype) if accel else None
    print(json.dumps({"what": "peak", **common, "measured_matmul_flops_per_s": round(peak),
                      "chip_peak_flops_per_s": chip}), flush=True)

    batch = make_batch(cfg, devices, args.batch, (src_len, tgt_len))
    if args.parallel == "sharded":
        compare_meshes(cfg, batch, [tuple(m) for m in args.mesh or [(1, -1, 1)]],
                       name=args.model, lengths=(src_len, tgt_len), steps=args.steps,
                       common=common, peak=peak, chip=chip)
        return
    model = models.build(cfg)
    dp, tx = make_wrapper(model, bench_settings(), rows=args.batch, parallel=args.parallel)
    state = dp.init_state(make_state_fn(model, tx))

    def step():
        nonlocal state
        state, metrics = dp.train_step(state, batch)
        return metrics

    first_call = timed(step)[1]
    times = [timed(step)[1] for _ in range(args.steps)]
    best, median = min(times), statistics.median(times)
    flops = model_flops(cfg, args.batch, src_len, tgt_len)
    tokens = args.batch * tgt_len
    print(json.dumps({
        "what": "train", **common, "model": args.model, "vocab_size": cfg.vocab_size,
        "batch": args.batch, "source_length": src_len if cfg.is_encoder_decoder else None,
        "target_length": tgt_len,
        "params": param_count(model), **flops,
        "compile_s": round(first_call - median, 2), "step_s_best": round(best, 4),
        "step_s_median": round(median, 4), "target_tokens_per_s": round(tokens / best, 1),
        "model_flops_per_s": round(flops["model_flops_per_step"] / best),
        "mfu_vs_measured_peak": round(flops["model_flops_per_step"] / best / peak, 4),
        "mfu_vs_chip_peak": (round(flops["model_flops_per_step"] / best / chip, 4)
                             if chip else None),
    }), flush=True)


if __name__ == "__main__":
    main()
