"""python -m bench.train [--model transformer-base] [--batch 16] [--lengths 64 64] [--dtype D]

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
"""

from __future__ import annotations

import argparse
import json
import statistics

import jax
import jax.numpy as jnp
import numpy as np

import models
from bench.decode import best_of, timed
from models.layers import GATED
from train import configs, parallel, state as state_lib, step as step_lib

# Dense (no sparsity) datasheet peaks, FLOP/s, by device kind substring and dtype.
CHIP_PEAKS = {
    "H100": {"bfloat16": 989e12, "float32": 67e12},
    "H200": {"bfloat16": 989e12, "float32": 67e12},
    "A100": {"bfloat16": 312e12, "float32": 19.5e12},
}


def chip_peak(dtype: str) -> float | None:
    kind = jax.devices()[0].device_kind
    for name, peaks in CHIP_PEAKS.items():
        if name in kind:
            return peaks.get(dtype)
    return None


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


def make_batch(cfg, devices: int, batch: int, src_len: int, tgt_len: int, seed: int = 0):
    """Full rows of random tokens, `[R, batch / R, W]`, with the pipeline's keys."""
    r = np.random.default_rng(seed)
    out = {}
    sides = (("inputs", src_len), ("targets", tgt_len)) if cfg.is_encoder_decoder else \
        (("targets", tgt_len),)
    for side, w in sides:
        out[side] = r.integers(4, cfg.vocab_size, (batch, w)).astype(np.int32)
        out[f"{side}_segmentation"] = np.ones((batch, w), np.int32)
        out[f"{side}_position"] = np.tile(np.arange(w, dtype=np.int32), (batch, 1))
    return {k: v.reshape(devices, batch // devices, -1) for k, v in out.items()}


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
    p.add_argument("--parallel", default="pmap", choices=("pmap", "shard_map"))
    p.add_argument("--dropout", type=float, default=None, help="default: the preset's")
    args = p.parse_args(argv)

    accel = jax.default_backend() != "cpu"
    dtype = args.dtype or ("bfloat16" if accel else "float32")
    devices = jax.local_device_count()
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
    common = dict(backend=jax.default_backend(), device=jax.devices()[0].device_kind,
                  devices=devices, dtype=dtype)
    print(json.dumps({"what": "peak", **common, "measured_matmul_flops_per_s": round(peak),
                      "chip_peak_flops_per_s": chip}), flush=True)

    config = configs.get("default")
    config.update(num_train_steps=1000, warmup_steps=100, parallel=args.parallel)
    model = models.build(cfg)
    batch = make_batch(cfg, devices, args.batch, src_len, tgt_len)
    first = jax.tree.map(lambda x: x[0], batch)
    init_args = ((first["inputs"], first["targets"]) if cfg.is_encoder_decoder
                 else (first["targets"],))
    params = jax.jit(model.init)(jax.random.key(0), *init_args)["params"]
    tx, schedule = state_lib.make_optimizer(config)
    dp = parallel.DataParallel(args.parallel, *step_lib.make_steps(model, config, schedule))
    state = dp.put_state(state_lib.TrainState.create(params, tx, 0))

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
        "params": int(sum(x.size for x in jax.tree.leaves(params))), **flops,
        "compile_s": round(first_call - median, 2), "step_s_best": round(best, 4),
        "step_s_median": round(median, 4), "target_tokens_per_s": round(tokens / best, 1),
        "model_flops_per_s": round(flops["model_flops_per_step"] / best),
        "mfu_vs_measured_peak": round(flops["model_flops_per_step"] / best / peak, 4),
        "mfu_vs_chip_peak": (round(flops["model_flops_per_step"] / best / chip, 4)
                             if chip else None),
    }), flush=True)


if __name__ == "__main__":
    main()
