"""python -m bench.memory [--lengths 512 1024 ... 16384] [--time-up-to 2048] [--quick]

Memory and step time of long sequences against T, for each attention implementation
(`TransformerConfig.attention_impl`) and remat policy, one JSON line per measurement, all
measured in one run. The model is the long-sequence issue's: a Llama-style decoder (RoPE,
RMSNorm, SwiGLU) of 4 layers, D 512, 8 heads, MLP 1376, V 8192, float32, batch 1.

- `grad`: the gradient of the mean next-token log-likelihood, compiled (`jax.jit(...)
  .lower(...).compile()`, nothing allocated) for `memory_analysis()`: `temp_bytes` (XLA's
  scratch: activations kept for the backward pass, the attention's working arrays,
  gradients) and `argument_bytes` (parameters and tokens). Scanned layers with remat by
  default (`layers: "scan"`); `--looped` adds looped layers, whose remat XLA's CPU
  compiler undoes (it drops the optimisation barriers and merges the recomputation
  back), so they show what each layer keeps without it. `step_s` (the best of 3 runs
  after the compiling one) up to `--time-up-to`. `loss`: "whole" (the head makes the
  `[T, V]` logits, then their log-softmax) or, for the long-sequence configuration
  (`chunked` attention), also "sliced": the head and the loss in `loss_chunks` slices of
  `LOSS_SLICE` positions each, recomputed in the backward pass (`train.chunked_loss`,
  the run config's `loss_chunks`), and the MLP in as many slices (`mlp_chunks`).
- `prefill`: a prompt of T tokens into a cache of T slots: `one_block` (one prefill call,
  logits of every token) against `chunks` (`models.prefill_in_chunks`, 512 tokens at a
  time, the last token's logits only), for each implementation.
- `cache` lines: the decoding cache's bytes per token per row (the `KVCache` of T slots,
  built abstractly, bfloat16), for DeepSeek-V3's latent cache (`deepseek-v3`: 61 layers of
  one 512-wide latent and one 64-wide rotated key), the grouped-query cache a Llama of the
  same width and depth would keep (8 kv heads of 128), and the same model's keys and values
  expanded to its 128 heads (what a cache of the expanded attention would hold), with each
  one's ratio to the latent cache; at T 1k, 8k and 32k (the same per token: it grows
  linearly).
- `decode_state` lines: one row's decoding state of Qwen3-Next-80B-A3B (bfloat16): its 12
  attention layers' keys and values (grow with T) and its 36 linear layers' recurrent
  states and convolution windows (`KVCache.linear`: the same at every T), against the same
  model with every layer full attention, at T 1k, 8k and 32k.
- `summary` lines: `growth` (temp bytes per doubling of T, from 2048 up; linear memory is
  2.0), `ratio_at_4096` (chunked temp / xla temp, with the whole loss and with the sliced
  one, and `xla_over_best`: how many times below the materialised path the best
  long-sequence configuration is), `time_ratio_at_2048` (chunked step / xla step, likewise),
  and `auto`: what `attention_impl="auto"` runs at each timed T and whether it is the
  fastest measured there.

Times on a shared CPU are indicative; the ratios are what the README reports.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

import models
from models import kernels
from models.config_checks import LINEAR_SHAPE
from train import chunked_loss

MODEL = dict(architecture="decoder_only", vocab_size=8192, d_model=512, num_heads=8,
             mlp_dim=1376, num_layers=4, positions="rope", norm="rmsnorm",
             activation="swiglu", use_bias=False, tie_embeddings=False)
PREFILL_CHUNK = 512
LOSS_SLICE = 512          # positions per slice of the sliced loss: loss_chunks = T / 512


def config(T: int, *, impl: str, policy: str | None, scan: bool = True,
           block: int = 512, dtype: str = "float32",
           mlp_chunks: int = 1) -> models.TransformerConfig:
    remat = {} if policy is None else dict(remat=True, remat_policy=policy)
    return models.TransformerConfig(**MODEL, max_len=T, attention_impl=impl, scan_layers=scan,
                                    attention_block=block, dtype=dtype, mlp_chunks=mlp_chunks,
                                    **remat)


def _tokens(T: int):
    return jnp.asarray(np.random.default_rng(0).integers(3, MODEL["vocab_size"], (1, T)),
                       jnp.int32)


def _memory(compiled) -> dict:
    m = compiled.memory_analysis()
    return {"temp_bytes": int(m.temp_size_in_bytes),
            "argument_bytes": int(m.argument_size_in_bytes)}


def _best_of(fn, args, runs: int = 3) -> float:
    jax.block_until_ready(fn(*args))
    best = math.inf
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def grad_line(T: int, *, impl: str, policy: str | None, scan: bool, timed: bool,
              sliced: bool = False, dtype: str = "float32") -> dict:
    """Memory (and time) of one gradient of the model at length T; `sliced`: the loss in
    slices of `LOSS_SLICE` positions (`train.chunked_loss`), never the whole logits;
    computing in `dtype` (parameters float32; `python -m bench.accelerator` asks for
    bfloat16, which cuDNN needs)."""
    chunks = max(1, T // LOSS_SLICE) if sliced else 0
    cfg = config(T, impl=impl, policy=policy, scan=scan, dtype=dtype,
                 mlp_chunks=max(1, chunks))
    model = models.build(cfg)
    tokens = _tokens(T)

    def loss(params, tokens):
        if sliced:
            x_BTD = model.apply({"params": params}, tokens, method="hidden")
            weights_BT = jnp.ones(tokens[:, 1:].shape, jnp.float32)
            sums = chunked_loss.model_loss(model, params, x_BTD[:, :-1], tokens[:, 1:],
                                           weights_BT, chunks=chunks)
            return sums["loss"] / (T - 1)
        logits = model.apply({"params": params}, tokens)
        logp = jax.nn.log_softmax(logits[:, :-1])
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    params = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens)["params"])
    grad = jax.jit(jax.grad(loss))
    t0 = time.perf_counter()
    compiled = grad.lower(params, tokens).compile()
    out = {"case": "grad", "T": T, "impl": impl, "policy": policy, "dtype": dtype,
           "layers": "scan" if scan else "loop", "loss": "sliced" if sliced else "whole",
           "loss_chunks": chunks, "mlp_chunks": cfg.mlp_chunks,
           "compile_s": round(time.perf_counter() - t0, 2),
           **_memory(compiled)}
    if timed:
        real = jax.jit(model.init)(jax.random.key(0), tokens)["params"]
        out["step_s"] = round(_best_of(compiled, (real, tokens)), 4)
    return out


def prefill_line(T: int, *, impl: str, mode: str, timed: bool) -> dict:
    """Memory (and time) of prefilling a T-token prompt into a T-slot cache."""
    cfg = config(T, impl=impl, policy=None)
    model = models.build(cfg)
    tokens, lengths = _tokens(T), jnp.full((1,), T, jnp.int32)
    cache = jax.eval_shape(lambda: models.KVCache.create(cfg, 1, T))
    if mode == "chunks":
        def fn(params, tokens, lengths, cache):
            return models.prefill_in_chunks(model, params, tokens, lengths, cache,
                                            chunk=PREFILL_CHUNK)
    else:
        def fn(params, tokens, lengths, cache):
            return model.apply({"params": params}, tokens, lengths, cache, method="prefill")
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens[:, :8])["params"])
    compiled = jax.jit(fn).lower(params, tokens, lengths, cache).compile()
    out = {"case": "prefill", "T": T, "impl": impl, "mode": mode, **_memory(compiled)}
    if timed:
        real = jax.jit(model.init)(jax.random.key(0), tokens[:, :8])["params"]
        out["step_s"] = round(_best_of(compiled, (real, tokens, lengths,
                                                  models.KVCache.create(cfg, 1, T))), 4)
    return out


def summaries(lines: list[dict], lengths: list[int]) -> list[dict]:
    """The growth per doubling, the ratios at 4096 and 2048, and what `auto` chose."""
    grads = {(x["impl"], x["policy"], x["layers"], x["loss"], x["T"]): x for x in lines
             if x["case"] == "grad"}
    out = []
    for impl, policy, layers, loss in sorted({k[:4] for k in grads}, key=str):
        temps = [(T, grads[impl, policy, layers, loss, T]["temp_bytes"]) for T in lengths
                 if T >= 2048 and (impl, policy, layers, loss, T) in grads]
        if len(temps) >= 2:
            growth = [round(b / a, 2) for (_, a), (_, b) in zip(temps, temps[1:], strict=False)]
            out.append({"case": "summary", "what": "growth", "impl": impl, "policy": policy,
                        "layers": layers, "loss": loss, "per_doubling": growth})
    for what, T, key in (("ratio_at_4096", 4096, "temp_bytes"),
                         ("time_ratio_at_2048", 2048, "step_s")):
        xla = grads.get(("xla", "full", "scan", "whole", T), {})
        ratios = {f"chunked_{loss}_loss_over_xla": round(line[key] / xla[key], 3)
                  for loss in ("whole", "sliced")
                  if key in (line := grads.get(("chunked", "full", "scan", loss, T), {}))
                  and key in xla}
        if ratios:
            line = {"case": "summary", "what": what, **ratios}
            if key == "temp_bytes":
                line["xla_over_best"] = round(1 / min(ratios.values()), 2)
            out.append(line)
    for T in lengths:
        timed = {impl: grads[impl, "full", "scan", "whole", T]["step_s"]
                 for impl in ("xla", "chunked", "auto")
                 if "step_s" in grads.get((impl, "full", "scan", "whole", T), {})}
        if len(timed) == 3:
            shape = jax.ShapeDtypeStruct((1, T, 8, 64), jnp.float32)
            chose = kernels.choose("auto", shape, shape, models.MaskSpec())
            fastest = min(("xla", "chunked"), key=timed.get)
            out.append({"case": "summary", "what": "auto", "T": T, "runs": chose,
                        "fastest": fastest,
                        "auto_over_xla": round(timed["auto"] / timed["xla"], 3)})
    return out


def cache_lines(lengths=(1024, 8192, 32768)) -> list[dict]:
    """Bytes per token of the decoding cache of DeepSeek-V3 (latent), of a GQA Llama of its
    width and depth, and of its attention expanded to every head (see the docstring)."""
    latent = models.get_config("deepseek-v3", dtype="bfloat16")
    plain = dict(kv_lora_rank=None, q_lora_rank=None, qk_rope_head_dim=None, v_head_dim=None,
                 query_pre_attn_scalar=None)
    caches = {"deepseek_v3_latent": latent,
              "llama_gqa_8x128": latent.replace(**plain, head_dim=128, num_kv_heads=8),
              # keys of 192 and values of 128 per head: as two of 160
              "expanded_128_heads": latent.replace(**plain, head_dim=160)}
    lines = []
    for T in lengths:
        per = {}
        for name, cfg in caches.items():
            cache = jax.eval_shape(lambda cfg=cfg, T=T: models.KVCache.create(cfg, 1, T))
            per[name] = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache)
                            if x.ndim >= 4) // T
        for name, value in per.items():
            lines.append({"case": "cache", "model": name, "T": T, "layers": latent.num_layers,
                          "bytes_per_token": int(value),
                          "over_latent": round(value / per["deepseek_v3_latent"], 2)})
    return lines


def decode_state_lines(lengths=(1024, 8192, 32768)) -> list[dict]:
    """One row's decoding state of Qwen3-Next-80B-A3B (bfloat16: 12 attention layers'
    keys and values, which grow with T, and 36 linear layers' recurrent states, float32,
    and convolution windows, which do not) against the same model with every layer full
    attention, at each T; built abstractly (`KVCache.create` under `jax.eval_shape`)."""
    hybrid = models.get_config("qwen3-next-80b-a3b", dtype="bfloat16")
    full = hybrid.replace(layer_types=("full",) * hybrid.num_layers,
                          **dict.fromkeys(LINEAR_SHAPE))

    def parts(cfg, T) -> dict[str, int]:
        cache = jax.eval_shape(lambda: models.KVCache.create(cfg, 1, T))
        kv = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((cache.k, cache.v)))
        linear = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache.linear))
        return {"kv_bytes": int(kv), "linear_state_bytes": int(linear)}

    lines = []
    for T in lengths:
        ours, theirs = parts(hybrid, T), parts(full, T)
        total, full_total = sum(ours.values()), sum(theirs.values())
        lines.append({"case": "decode_state", "model": "qwen3-next-80b-a3b", "T": T, **ours,
                      "total_bytes": total, "all_full_attention_bytes": full_total,
                      "over_all_full_attention": round(total / full_total, 3)})
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+",
                   default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--time-up-to", type=int, default=2048,
                   help="time the steps of T up to this (memory is compiled at every T)")
    p.add_argument("--policies", nargs="+", default=["full", "dots", "names"])
    p.add_argument("--looped", action="store_true", help="also looped layers (xla, chunked)")
    p.add_argument("--quick", action="store_true", help="T 512 and 1024 only (the tests)")
    args = p.parse_args(argv)
    lengths = [512, 1024] if args.quick else args.lengths
    lines = []

    def emit(line):
        lines.append(line)
        print(json.dumps(line), flush=True)

    for T in lengths:
        timed = T <= args.time_up_to
        for impl in ("xla", "chunked", "auto"):
            emit(grad_line(T, impl=impl, policy="full", scan=True, timed=timed))
        emit(grad_line(T, impl="chunked", policy="full", scan=True, timed=timed, sliced=True))
        for policy in args.policies:
            if policy != "full":
                emit(grad_line(T, impl="chunked", policy=policy, scan=True, timed=timed))
        if args.looped:
            for impl in ("xla", "chunked"):
                emit(grad_line(T, impl=impl, policy="full", scan=False, timed=False))
        for impl in ("xla", "chunked"):
            for mode in ("one_block", "chunks"):
                emit(prefill_line(T, impl=impl, mode=mode, timed=timed))
    for line in summaries(lines, lengths):
        print(json.dumps(line), flush=True)
    for line in cache_lines() + decode_state_lines():
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
