"""The measuring sections of `python -m bench.accelerator`, each run in a process of its own:

    python -m bench.accelerator_sections device|train|decode|memory [--dry-run] [--int8]

Each prints JSON lines as it measures (so a section stopped at its time limit keeps what it
had) and ends with one line `{"section": NAME, "result": {...}}`. The orchestrator
(`bench.accelerator`) reads them; its docstring says what each section measures.
`--dry-run` runs the same code on tiny shapes (a CPU in seconds).

Shapes: the Llama-1B shape of `bench.lora` (Llama 3.2 1B's: D 2048, 16 layers, 32 heads of
64, 8 kv heads, MLP 8192, V 128,256, tied embeddings) for training and decoding; the
long-sequence model of `bench.memory` (4 layers, D 512) for gradient memory.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.metadata
import json
import math
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import decode
import models
from bench import chips
from bench.common import StepSettings, compile_step, make_state_fn, make_wrapper, step_memory
from bench.decode import timed
from bench.lora import SHAPES
from bench.train import make_batch, measured_peak, model_flops
from models.errors import UserError
from models.quant import nbytes

SECTIONS = ("device", "train", "decode", "memory")


def emit(line: dict) -> dict:
    print(json.dumps(line), flush=True)
    return line


def llama_1b(dry: bool, **fields) -> models.TransformerConfig:
    """The Llama-1B shape (`bench.lora.SHAPES`), or llama-tiny for a dry run."""
    shape = dict(SHAPES["llama-tiny" if dry else "llama-1b"])
    return models.get_config(shape.pop("name"), **shape, **fields)


# --- device --------------------------------------------------------------------------

def _versions() -> dict:
    names = ("jax", "jaxlib", "flax", "optax", "chex", "orbax-checkpoint")
    out = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"] or ""
        if name.lower() in names or (name.startswith("jax-cuda") or name.startswith("jax_cuda")):
            out[name.lower()] = dist.version
    return out


def copy_bandwidth(n_bytes: int, repeats: int = 5) -> float:
    """Bytes/s read and written by `x * 2` over an array of `n_bytes` (bfloat16), the best
    of `repeats`: the most bandwidth a plain elementwise pass gets here."""
    x = jnp.ones((n_bytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda x: x * 2)
    f(x).block_until_ready()
    best = min(timed(lambda: f(x))[1] for _ in range(repeats))
    return 2 * x.nbytes / best


def device_section(dry: bool) -> dict:
    """What the machine is: the device's kind, memory and platform, the versions, the
    datasheet figures (`bench.chips`), and the measured copy bandwidth and bf16 matmul
    rate."""
    d = jax.devices()[0]
    stats = d.memory_stats() or {}
    chip = chips.find(d.device_kind)
    test_platform = "cpu"
    if d.platform == "gpu":
        version = getattr(getattr(d, "client", None), "platform_version", "") or ""
        test_platform = "rocm" if "rocm" in version.lower() else "cuda"
    elif d.platform != "cpu":
        test_platform = d.platform
    return {
        "kind": d.device_kind, "platform": d.platform, "test_platform": test_platform,
        "device_count": jax.device_count(), "memory_bytes": stats.get("bytes_limit"),
        "python": platform.python_version(), "versions": _versions(),
        "chip": chip.name if chip else None,
        "chip_bf16_flops": chip.bf16_flops if chip else None,
        "chip_hbm_bytes_per_s": chip.hbm_bytes_per_s if chip else None,
        "measured_copy_bytes_per_s": round(copy_bandwidth(2 ** 20 if dry else 2 ** 31)),
        "measured_bf16_matmul_flops": round(measured_peak("bfloat16", 256 if dry else 8192)),
    }


# --- train ---------------------------------------------------------------------------

class WithoutSegments:
    """`model` called without the segment ids and positions the trainer passes.

    Under `python -m train` every batch carries segment ids (packing), so the model's
    attention description has them and `attention_impl="cudnn"` refuses it (cuDNN's kernel
    takes lengths, not segments). The benchmark's rows are whole and unpacked (segment ids
    all 1, positions 0..T-1): dropping both computes the same thing, and shows what cuDNN
    would give the trainer if unpacked rows reached the model without them.
    """

    def __init__(self, model):
        self.model = model
        self.config = model.config

    def apply(self, variables, tokens, *, segment_ids=None, positions=None, **kwargs):
        del segment_ids, positions
        return self.model.apply(variables, tokens, **kwargs)


# (attention_impl, remat policy or None, the rows as the trainer passes them or unpacked)
TRAIN_CANDIDATES = (
    ("chunked", None, "trainer"), ("chunked", "dots", "trainer"),
    ("chunked", "full", "trainer"), ("xla", None, "trainer"), ("xla", "dots", "trainer"),
    ("cudnn", "dots", "trainer"),
    ("cudnn", None, "unpacked"), ("cudnn", "dots", "unpacked"), ("cudnn", "full", "unpacked"),
)
COMPILE_THREADS = 3
# A dry run's: each way a candidate can go on a CPU (timed as the trainer runs it, timed
# unpacked, refused), in a third of the compiling.
DRY_TRAIN_CANDIDATES = (("chunked", "dots", "trainer"), ("xla", None, "unpacked"),
                        ("cudnn", "dots", "trainer"))


def _candidate_config(base, impl, policy):
    remat = dict(remat=True, remat_policy=policy) if policy else dict(remat=False)
    return base.replace(attention_impl=impl, **remat)


def _compile_candidate(base, candidate, settings, shapes, memory_limit):
    """(wrapper, tx, compiled, line) of one candidate; compiled None where it is refused
    or does not fit the device's memory (the line says which)."""
    impl, policy, rows = candidate
    line = {"impl": impl, "remat": policy or "none", "rows": rows}
    model = models.build(_candidate_config(base, impl, policy))
    stepped = WithoutSegments(model) if rows == "unpacked" else model
    wrapper, tx = make_wrapper(stepped, settings, rows=shapes["targets"][0])
    try:
        compiled, seconds, batch_bytes = compile_step(wrapper, model, tx, shapes)
    except UserError as e:
        return wrapper, tx, None, {**line, "status": "refused", "why": str(e)}
    except Exception as e:          # a compiler's failure is a finding here
        return wrapper, tx, None, {**line, "status": "error", "why": _first_line(e)}
    memory = step_memory(compiled, batch_bytes)
    line.update(compile_s=round(seconds, 1), per_device_bytes=memory.get("per_device_bytes"))
    if memory_limit and memory.get("per_device_bytes", 0) > 0.95 * memory_limit:
        return wrapper, tx, None, {**line, "status": "does not fit"}
    return wrapper, tx, compiled, {**line, "status": "compiled"}


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}" if str(
        error).strip() else type(error).__name__


def _steps(wrapper, compiled, state, batch, n: int) -> tuple[object, list[float]]:
    """The state after `n` timed steps, and their seconds (the batch placed in each)."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        state, metrics = compiled(state, wrapper.put_batch(batch))
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    return state, times


def train_section(dry: bool, peak_flops: float | None = None) -> dict:
    """Model FLOP utilisation of the trainer's step (adamw behind clipping, label
    smoothing; bfloat16 compute, float32 parameters; scanned layers) on the Llama-1B
    shape: the candidates of `TRAIN_CANDIDATES` compiled `COMPILE_THREADS` at a time in
    threads (XLA's compiler releases the GIL), each that fits timed for a few steps from
    one shared state, the fastest timed again for the figure. MFU divides by `peak_flops`
    or the chip's datasheet peak (none on a CPU)."""
    rows, length = (2, 64) if dry else (4, 2048)
    base = llama_1b(dry, dtype="bfloat16", max_len=length, scan_layers=True)
    settings = StepSettings()
    shapes = {k: (rows, length) for k in
              ("targets", "targets_segmentation", "targets_position")}
    limit = jax.devices()[0].memory_stats() or {}
    candidates = DRY_TRAIN_CANDIDATES if dry else TRAIN_CANDIDATES
    # XLA's GPU compiler times kernels on the device while it compiles (autotuning): a few
    # compilations at once, not all, so their timings disturb each other little.
    with concurrent.futures.ThreadPoolExecutor(max_workers=COMPILE_THREADS) as pool:
        built = list(pool.map(lambda c: _compile_candidate(base, c, settings, shapes,
                                                           limit.get("bytes_limit")),
                              candidates))
    flops = model_flops(base, rows, length, length)["model_flops_per_step"]
    chip = chips.find(jax.devices()[0].device_kind)
    peak = peak_flops or (chip.bf16_flops if chip else None)
    measured = measured_peak("bfloat16", 256 if dry else 8192)
    batch = make_batch(base, jax.local_device_count(), rows, (length, length))
    state, lines = None, []
    for wrapper, tx, compiled, line in built:
        if compiled is not None:
            if state is None:       # one state for all: no candidate changes a parameter
                state = wrapper.init_state(make_state_fn(models.build(base), tx))
            try:
                state, _ = _steps(wrapper, compiled, state.replace(tx=tx), batch, 1)
                state, times = _steps(wrapper, compiled, state, batch, 2 if dry else 4)
                line.update(status="timed", step_s=round(min(times), 4))
            except Exception as e:  # out of memory at run time, say
                line.update(status="error", why=_first_line(e))
                state = None        # donated to the failed step: made again for the next
        lines.append(emit({"what": "train_candidate", **line}))
    timed_lines = [x for x in lines if x["status"] == "timed"]
    result = {"model": "llama-tiny" if dry else "llama-1b", "params": _params(base),
              "rows": rows, "length": length, "tokens_per_step": rows * length,
              "model_flops_per_step": flops, "peak_bf16_flops": peak,
              "peak_source": "--peak-tflops" if peak_flops else (chip.name if chip else None),
              "measured_bf16_matmul_flops": round(measured), "candidates": lines,
              "best": None, "best_as_trained": None}

    def mfu(step_s):
        return round(flops / step_s / peak, 4) if peak else None

    if timed_lines:
        best = min(timed_lines, key=lambda x: x["step_s"])
        wrapper, tx, compiled, _ = built[lines.index(best)]
        if state is None:
            state = wrapper.init_state(make_state_fn(models.build(base), tx))
        state, times = _steps(wrapper, compiled, state.replace(tx=tx), batch,
                              3 if dry else 10)
        step_s = statistics.median(times)
        result["best"] = {
            "impl": best["impl"], "remat": best["remat"], "rows": best["rows"],
            "step_s_median": round(step_s, 4), "step_s_best": round(min(times), 4),
            "tokens_per_s": round(rows * length / step_s), "mfu": mfu(step_s),
            "mfu_vs_measured_matmul": round(flops / step_s / measured, 4)}
        trainer = [x for x in timed_lines if x["rows"] == "trainer"]
        if trainer:
            fastest = min(trainer, key=lambda x: x["step_s"])
            result["best_as_trained"] = {"impl": fastest["impl"], "remat": fastest["remat"],
                                         "step_s": fastest["step_s"],
                                         "mfu": mfu(fastest["step_s"])}
    return result


def _params(cfg) -> int:
    args, method = models.axes.init_args(cfg)
    shapes = jax.eval_shape(lambda *a: models.build(cfg).init(jax.random.key(0), *a,
                                                              method=method), *args)
    return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes["params"]))


# --- decode --------------------------------------------------------------------------

def decode_row(model, params, *, weights: str, batch: int, prompt: int, new: int,
               bandwidth: float) -> dict:
    """Greedy decoding of `new` tokens after `prompt` random ones, per step, against the
    memory bound: (the weights' bytes + the filled cache's, averaged over the run) /
    `bandwidth`. The step time is the best run's time / `new` (the prefill is in it: one
    pass over the prompt, about 1% of the run here)."""
    cfg = model.config
    prompts = jax.random.randint(jax.random.key(1), (batch, prompt), 3, cfg.vocab_size)
    lengths = jnp.full((batch,), prompt, jnp.int32)

    def run():
        return decode.generate(model, params, prompts, lengths, max_new_tokens=new,
                               eos_id=None).tokens
    _, first = timed(run)
    seconds = min(timed(run)[1] for _ in range(3))
    cache = jax.eval_shape(lambda: models.KVCache.create(cfg, batch, prompt + new))
    per_slot = nbytes((cache.k, cache.v)) / (batch * (prompt + new))
    kv = batch * (prompt + (new - 1) / 2) * per_slot
    weight_bytes = nbytes(params)
    bound = (weight_bytes + kv) / bandwidth
    step = seconds / new
    return {"what": "decode", "weights": weights, "batch": batch, "prompt": prompt,
            "new_tokens": new, "weight_bytes": weight_bytes, "kv_bytes_per_step": round(kv),
            "first_call_s": round(first, 2), "s_per_step": round(step, 6),
            "bound_s_per_step": round(bound, 6), "fraction_of_bound": round(bound / step, 3),
            "tokens_per_s": round(batch / step, 1)}


def decode_section(dry: bool, bandwidth: float | None, int8: bool) -> dict:
    """Greedy decoding of the Llama-1B shape (bfloat16 weights and compute; with `int8`
    also `models.quantize(..., "int8", embeddings=True)`'s weights: every projection, the
    token table and the head in int8 with per-channel scales) at batch 1 and 8 against
    the HBM bound: the datasheet bandwidth
    (`bench.chips`) or `bandwidth`; without either (a CPU), the measured copy bandwidth."""
    prompt, new = (8, 8) if dry else (64, 256)
    cfg = llama_1b(dry, dtype="bfloat16", param_dtype="bfloat16", max_len=prompt + new)
    chip = chips.find(jax.devices()[0].device_kind)
    if bandwidth is not None:
        source = "--bandwidth"
    elif chip is not None:
        bandwidth, source = chip.hbm_bytes_per_s, f"{chip.name} datasheet"
    else:
        bandwidth, source = copy_bandwidth(2 ** 20 if dry else 2 ** 30), "measured copy"
    model = models.build(cfg)
    params = jax.jit(model.init)(jax.random.key(0), jnp.ones((1, 8), jnp.int32))["params"]
    trees = {"bfloat16": params}
    if int8:          # the tables and head too, as bench.quantize's speed lines: a step
        trees["int8"] = models.quantize(params, cfg, "int8", embeddings=True)  # reads all
    rows = []
    for weights, tree in trees.items():
        for batch in (1, 8):
            rows.append(emit(decode_row(model, tree, weights=weights, batch=batch,
                                        prompt=prompt, new=new, bandwidth=bandwidth)))
    return {"model": "llama-1b" if not dry else "llama-tiny", "params": _params(cfg),
            "bandwidth_bytes_per_s": bandwidth, "bandwidth_source": source,
            "int8": "measured" if int8 else "not in the plan (bench.accelerator.INT8_READY)",
            "rows": rows}


# --- memory --------------------------------------------------------------------------

def memory_section(dry: bool) -> dict:
    """Gradient memory (XLA's temp bytes of the compiled gradient) and time of the
    long-sequence model in bfloat16 at T 8k and 32k, cuDNN against chunked attention
    (`bench.memory.grad_line`: scanned layers, full remat)."""
    from bench.memory import grad_line
    rows = []
    for T in ((64,) if dry else (8192, 32768)):       # a dry run: one length, compiling is slow
        for impl in ("cudnn", "chunked"):
            try:
                line = grad_line(T, impl=impl, policy="full", scan=True, timed=True,
                                 dtype="bfloat16")
            except UserError as e:
                line = {"case": "grad", "T": T, "impl": impl, "refused": str(e)}
            except Exception as e:  # a kernel's failure is a finding here
                line = {"case": "grad", "T": T, "impl": impl, "error": _first_line(e)}
            rows.append(emit(line))
    return {"model": "bench.memory's (4 layers, D 512, 8 heads), bfloat16, batch 1",
            "rows": rows}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.accelerator_sections",
                                description=__doc__.split("\n")[0])
    p.add_argument("section", choices=SECTIONS)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--bandwidth", type=float, default=None, help="bytes/s (decode)")
    p.add_argument("--int8", action="store_true",
                   help="int8 weights too (decode; `models.quantize`)")
    p.add_argument("--peak-flops", type=float, default=None,
                   help="dense bf16 FLOP/s for MFU (train; default the datasheet's)")
    args = p.parse_args(argv)
    if args.section == "device":
        result = device_section(args.dry_run)
    elif args.section == "train":
        result = train_section(args.dry_run, args.peak_flops)
    elif args.section == "decode":
        result = decode_section(args.dry_run, args.bandwidth, args.int8)
    else:
        result = memory_section(args.dry_run)
    emit({"section": args.section, "result": result})


if __name__ == "__main__":
    sys.exit(main())
