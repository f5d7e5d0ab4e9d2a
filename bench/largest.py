"""The largest model a per-device memory budget holds, under pmap and under FSDP.

    python -m bench.train --fake-devices 4 --memory-budget 8GiB [--search-width 2048]

`--memory-budget SIZE` (4GiB, 3.5GB, 1e9) runs a search instead: the largest Llama-style
model (RMSNorm, RoPE, SwiGLU, grouped-query attention; at `--search-width` 2048: 16 heads of
128, 8 kv heads, MLP 5632, V 32,000, length 128, one row per device; layers scanned, so
compile time does not grow with depth), by number of layers, whose train step compiles
within SIZE of `per_device_bytes` under pmap (state replicated) and under FSDP over every
device (mesh 1 -1 1). Steps are lowered from abstract shapes and compiled, never run:
nothing is allocated. One `probe` line per compilation, then a `largest_under_budget`
line: both layer and parameter counts, their ratios, and the bytes each layer adds.
"""

from __future__ import annotations

import argparse
import math
import re

import jax

import models
from bench.common import bench_settings, compile_step, make_wrapper, param_count, step_memory


def parse_bytes(text: str) -> int:
    """'4GiB', '512MiB', '3.5GB', '1e9' or '1000' as a number of bytes."""
    units = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
             "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if not m or m.group(2) not in units:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 4GiB, 512MiB, "
                                         f"3.5GB or 1e9")
    return int(float(m.group(1)) * units[m.group(2)])


def search_config(d_model: int, num_layers: int, vocab_size: int = 32_000, length: int = 128,
                  dtype: str = "float32") -> models.TransformerConfig:
    """A Llama-style model (`llama-small`'s kind) of width `d_model` scaled as Llama is:
    heads of 128 (at least 4 heads), half as many kv heads, MLP 8/3 D rounded up to a
    multiple of 256 (D 2048: 16 heads, 8 kv heads, MLP 5632); layers scanned."""
    heads = max(4, d_model // 128)
    return models.get_config(
        "llama-small", d_model=d_model, num_heads=heads, num_kv_heads=heads // 2,
        mlp_dim=256 * math.ceil(8 * d_model / 3 / 256), vocab_size=vocab_size,
        num_layers=num_layers, max_len=length, scan_layers=True, dtype=dtype)


def largest_fitting(measure, budget: float, limit: int = 4096) -> tuple[int, dict]:
    """The largest n in [1, limit] with `measure(n) <= budget` (0 if none), for a measure
    that grows with n, and every measurement made: {n: measure(n)}.

    Memory grows nearly linearly with layers, so each probe is where the line through the
    largest fitting n and its nearest other measurement meets the budget, kept strictly
    inside the bracket (else the bracket's midpoint). With an exact line that is four
    probes: 1, 2, the prediction n, then n + 1.

        measure = lambda n: 10 + 3 * n, budget 40   ->  probes 1, 2, 10, 11  ->  10
    """
    seen: dict[int, float] = {}

    def fits(n: int) -> bool:
        if n not in seen:
            seen[n] = measure(n)
        return seen[n] <= budget

    if not fits(1):
        return 0, seen
    lo, hi = 1, limit + 1                      # lo fits; hi does not (or is past the limit)
    while hi - lo > 1:
        others = [n for n in seen if n != lo]
        guess = lo + 1
        if others:
            near = min(others, key=lambda n: abs(n - lo))
            slope = (seen[near] - seen[lo]) / (near - lo)
            guess = lo + int((budget - seen[lo]) // slope) if slope > 0 else 2 * lo
        n = max(guess, lo + 1) if guess < hi else (lo + hi) // 2
        if fits(n):
            lo = n
        else:
            hi = n
    return lo, seen


def largest_models(budget: int, *, d_model: int = 2048, vocab_size: int = 32_000,
                   length: int = 128, rows: int | None = None, dtype: str = "float32",
                   max_layers: int = 4096, report=None) -> dict:
    """The largest `search_config` models (by layers) whose train step compiles within
    `budget` per-device bytes under pmap and under FSDP over every device (mesh 1 -1 1).

    Args:
        rows: the global batch (default one row per device), `length` tokens each.
        max_layers: the most layers tried (a count at the limit is marked `at_limit`).
        report: called with a dict per compilation (the `probe` lines).

    Returns:
        The `largest_under_budget` line's fields: layers, parameters and per-device bytes of
        each winner, their ratios (fsdp / pmap), and each side's bytes per added layer.
    """
    devices = jax.device_count()
    rows = rows or devices
    settings = bench_settings()
    shapes = {k: (rows, length) for k in ("targets", "targets_segmentation", "targets_position")}
    out = {"budget_bytes": budget, "d_model": d_model}

    for name, mesh_shape in (("pmap", None), ("fsdp", (1, -1, 1))):
        params = {}

        def measure(n, name=name, mesh_shape=mesh_shape, params=params):
            cfg = search_config(d_model, n, vocab_size, length, dtype)
            model = models.build(cfg)
            wrapper, tx = make_wrapper(model, settings, mesh_shape=mesh_shape, rows=rows)
            compiled, seconds, batch_bytes = compile_step(wrapper, model, tx, shapes)
            mem = step_memory(compiled, batch_bytes)
            params[n] = param_count(model)
            if report:
                report({"what": "probe", "parallel": name, "layers": n, "params": params[n],
                        "compile_s": round(seconds, 2), **mem,
                        "fits": mem["per_device_bytes"] <= budget})
            return mem["per_device_bytes"]

        layers, seen = largest_fitting(measure, budget, max_layers)
        per_layer = (seen[2] - seen[1]) if 2 in seen else None
        out[name] = {"layers": layers, "params": params.get(layers, 0),
                     "per_device_bytes": seen.get(layers), "bytes_per_layer": per_layer,
                     "at_limit": layers == max_layers, "compilations": len(seen)}
    pm, fs = out["pmap"], out["fsdp"]
    out["fsdp_devices"] = devices
    out["layers_ratio"] = round(fs["layers"] / pm["layers"], 3) if pm["layers"] else None
    out["params_ratio"] = round(fs["params"] / pm["params"], 3) if pm["params"] else None
    out["bytes_per_layer_ratio"] = (round(pm["bytes_per_layer"] / fs["bytes_per_layer"], 3)
                                    if pm["bytes_per_layer"] and fs["bytes_per_layer"] else None)
    return out
