"""python -m bench.load [--repeats 5]

Seconds and peak host memory to load and to save a gpt2-small-sized checkpoint, ours
(`models.load` / `models.save`) against transformers (`AutoModelForCausalLM.from_pretrained`
/ `save_pretrained`) on the same files, one JSON line per measurement, all measured in one
run (about 3 minutes on 2 CPU cores):

- `checkpoint`: a random `GPT2LMHeadModel(GPT2Config())` (vocab 50257, D 768, 12 layers,
  12 heads, 1024 positions: 124M parameters, a tied head) made by transformers with a fixed
  torch seed and saved with `save_pretrained` as float32 and as bfloat16 (`.to(bfloat16)`);
  its bytes on disk. Both sides read these same files, from a warm page cache.
- `load`: the directory into float32 parameters (ours: `models.load(dir)` and
  `block_until_ready` on every leaf; theirs: `from_pretrained(dir, dtype=torch.float32)`),
  so a bfloat16 file is read and cast by both.
- `save`: the directory loaded in its own dtype, then only `models.save` /
  `save_pretrained` into a fresh directory is timed (a bfloat16 checkpoint writes bfloat16).

Every operation runs in a fresh subprocess (`--worker`), so its peak is its own and no
import, trace or compile cache carries over; `--repeats` runs each, keeping the best time
and the largest memory. A worker imports what it needs and starts the JAX or torch runtime,
notes its RSS (the baseline), resets the kernel's high-water mark (/proc/self/clear_refs)
just before the timed operation (the parent imports neither library, so no child inherits
a large mark), runs it and reports:

- `seconds`: wall time of the operation; `peak_rss_bytes`: `getrusage(RUSAGE_SELF).ru_maxrss`
  after it; `peak_increase_bytes`: that peak over the baseline (the ratios compare these);
  `peak_over_params`: the increase over the bytes of the parameters the worker holds
  (float32 for a load). For a save the increase includes the loaded model, which is in
  memory throughout; `save_extra_bytes` is what the save adds on top of it.
- loads also: `touch_s` and `used_increase_bytes`, the time to read one byte of every page
  of every parameter after the load, and the RSS increase then. transformers maps the
  file and hands out tensors backed by the mapping, so its float32 load costs little until
  the weights are first read; the `used` figures compare the two once they have been (a
  save worker reads them so before its save). `second_s`: the same load again in the same
  process (warm caches), which separates one-time tracing and compilation from reading and
  converting. (Saves have no second run: a second 500 MB write right after the first meets
  the kernel's dirty-page throttling, which says more about the disk than the code.)

The last line is the summary: ours / transformers for time and peak increase, for each
dtype on disk. Host memory only: the workers run JAX on the CPU (JAX_PLATFORMS=cpu), as
torch does. Linux only (reads /proc/self).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import metadata

from models.errors import UserError

# The standard library only at the top: the parent imports neither JAX nor torch, so the
# workers it starts inherit no large high-water mark and it holds no memory of its own.

DTYPES = ("float32", "bfloat16")
SIDES = ("ours", "theirs")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = 4096


# ---------------------------------------------------------------------------------------------
# The worker: one operation in a fresh process.

def rss_bytes() -> int:
    """The current resident set size (VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def reset_peak() -> int:
    """Resets the high-water mark that ru_maxrss reports to the current RSS; returns it."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss_bytes()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024     # KiB on Linux


class Ours:
    """models.load / models.save; parameters are a tree of jax arrays."""

    def __init__(self):
        import jax

        import models
        self.jax, self.models = jax, models
        jax.devices()                                   # start the runtime before the baseline

    def load(self, path: str, dtype: str):
        pre = self.models.load(path, param_dtype=dtype)
        self.jax.block_until_ready(pre.params)
        return pre

    def leaves(self, pre):
        import numpy as np
        return [np.asarray(x) for x in self.jax.tree.leaves(pre.params)]

    def save(self, pre, path: str) -> None:
        self.models.save(path, pre.config, pre.params, model_type=pre.model_type,
                         generation=pre.generation)


class Theirs:
    """transformers' from_pretrained / save_pretrained into torch."""

    def __init__(self):
        import torch
        import transformers
        from transformers.models.gpt2 import modeling_gpt2  # noqa: F401  (not a timed import)
        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
        self.torch, self.transformers = torch, transformers
        torch.zeros(1).sum()                            # start the runtime before the baseline

    def load(self, path: str, dtype: str):
        return self.transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=getattr(self.torch, dtype))

    def leaves(self, model):
        return [p.detach().numpy() if p.dtype != self.torch.bfloat16
                else p.detach().view(self.torch.int16).numpy() for p in model.parameters()]

    def save(self, model, path: str) -> None:
        model.save_pretrained(path, safe_serialization=True)


def touch(arrays) -> float:
    """Reads one byte of every page of every array (faults in a mapped file); seconds."""
    import numpy as np
    t0 = time.perf_counter()
    for a in arrays:
        np.ascontiguousarray(a).reshape(-1).view(np.uint8)[::PAGE].sum()
    return time.perf_counter() - t0


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def worker(side: str, op: str, path: str, dtype: str) -> dict:
    """Runs one load or save of the directory `path` in this process, as described in the
    module docstring; returns its measurements."""
    lib = Ours() if side == "ours" else Theirs()
    out = {"side": side, "op": op, "param_dtype": dtype}
    if op == "load":
        baseline = reset_peak()
        t0 = time.perf_counter()
        obj = lib.load(path, dtype)
        seconds = time.perf_counter() - t0
        peak = peak_rss_bytes()
        arrays = lib.leaves(obj)
        param_bytes = sum(a.nbytes for a in arrays)
        out.update(touch_s=round(touch(arrays), 4),
                   used_increase_bytes=rss_bytes() - baseline)
        del arrays, obj
        t0 = time.perf_counter()
        lib.load(path, dtype)
        out["second_s"] = round(time.perf_counter() - t0, 4)
    elif op == "save":
        baseline = rss_bytes()
        obj = lib.load(path, dtype)
        arrays = lib.leaves(obj)
        param_bytes = sum(a.nbytes for a in arrays)
        touch(arrays)                       # a mapped load's pages in before the save
        with tempfile.TemporaryDirectory(prefix="bench_load_save_") as tmp:
            target = os.path.join(tmp, "out")
            os.sync()                       # no earlier writes still being flushed
            before = reset_peak()           # the load's own peak is not the save's
            t0 = time.perf_counter()
            lib.save(obj, target)
            seconds = time.perf_counter() - t0
            peak = peak_rss_bytes()
            out.update(saved_bytes=dir_bytes(target), save_extra_bytes=max(peak - before, 0))
    else:
        raise UserError(f"unknown operation {op!r}")
    return {**out, "seconds": round(seconds, 4), "baseline_rss_bytes": baseline,
            "peak_rss_bytes": peak, "peak_increase_bytes": max(peak - baseline, 0),
            "param_bytes": param_bytes,
            "peak_over_params": round(max(peak - baseline, 0) / param_bytes, 3)}


def make_checkpoints(directory: str) -> dict:
    """The random gpt2-small checkpoint, saved by transformers as float32 and bfloat16."""
    import torch
    import transformers
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    model.save_pretrained(os.path.join(directory, "float32"), safe_serialization=True)
    model.to(torch.bfloat16).save_pretrained(os.path.join(directory, "bfloat16"),
                                             safe_serialization=True)
    return {"params": sum(p.numel() for p in model.parameters())}


# ---------------------------------------------------------------------------------------------
# The parent: starts the workers and compares.

def run_worker(*args: str) -> dict:
    """Runs `python -m bench.load --worker ...` in a fresh process; its last stdout line."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "bench.load", "--worker", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"worker {' '.join(args)} failed ({proc.returncode}):\n"
                         f"{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def best_of(runs: list[dict]) -> dict:
    """One line from repeated runs: the best of each time, the largest of each memory."""
    out = dict(runs[0])
    out["seconds_all"] = [r["seconds"] for r in runs]
    for key in out:
        if key.endswith("_s") or key == "seconds":
            out[key] = min(r[key] for r in runs)
        elif key.endswith("_bytes") and key != "param_bytes":
            out[key] = max(r[key] for r in runs)
    out["peak_over_params"] = round(out["peak_increase_bytes"] / out["param_bytes"], 3)
    return out


def ratios(lines: dict) -> dict:
    """ours / transformers, for each dtype on disk: time and peak increase of a load and a
    save, and the RSS increase of a load once every parameter has been read (`used`)."""
    out = {}
    for disk in DTYPES:
        ours = {op: lines[(disk, op, "ours")] for op in ("load", "save")}
        theirs = {op: lines[(disk, op, "theirs")] for op in ("load", "save")}
        r = {}
        for op in ("load", "save"):
            r[f"{op}_time_ratio"] = round(ours[op]["seconds"] / theirs[op]["seconds"], 3)
            r[f"{op}_peak_ratio"] = round(ours[op]["peak_increase_bytes"]
                                          / max(theirs[op]["peak_increase_bytes"], PAGE), 3)
        r["load_used_ratio"] = round(ours["load"]["used_increase_bytes"]
                                     / max(theirs["load"]["used_increase_bytes"], PAGE), 3)
        r["ours_load_peak_over_params"] = ours["load"]["peak_over_params"]
        out[disk] = r
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.load",
        description="Seconds and peak host memory to load and to save a gpt2-small checkpoint, "
                    "ours against transformers (see the module docstring).")
    p.add_argument("--repeats", type=int, default=5, help="fresh processes per measurement")
    p.add_argument("--worker", nargs=2, metavar=("KIND", "PATH"),
                   help="internal: run one measurement (KIND: ours_load, ours_save, "
                        "theirs_load, theirs_save, or make) and print it as JSON")
    p.add_argument("--param-dtype", default="float32", choices=DTYPES,
                   help="internal: the dtype a worker loads into")
    args = p.parse_args(argv)
    if args.worker:
        kind, path = args.worker
        if kind == "make":
            print(json.dumps(make_checkpoints(path)), flush=True)
            return
        side, _, op = kind.partition("_")
        if side not in SIDES or op not in ("load", "save"):
            raise SystemExit(f"unknown worker {kind!r}: ours_load, ours_save, theirs_load, "
                             "theirs_save or make")
        print(json.dumps(worker(side, op, path, args.param_dtype)), flush=True)
        return

    versions = {name: metadata.version(name)
                for name in ("jax", "flax", "safetensors", "torch", "transformers")}
    directory = tempfile.mkdtemp(prefix="bench_load_")
    try:
        t0 = time.perf_counter()
        made = run_worker("make", directory)
        os.sync()
        make_s = round(time.perf_counter() - t0, 2)
        for disk in DTYPES:
            print(json.dumps({"what": "checkpoint", "model": "gpt2 (GPT2Config defaults)",
                              "disk_dtype": disk, "params": made["params"],
                              "bytes": dir_bytes(os.path.join(directory, disk)),
                              "make_s": make_s, **versions}), flush=True)
        lines = {}
        for disk in DTYPES:
            for op in ("load", "save"):
                loaded = "float32" if op == "load" else disk
                for side in SIDES:
                    runs = [run_worker(f"{side}_{op}", os.path.join(directory, disk),
                                       "--param-dtype", loaded) for _ in range(args.repeats)]
                    line = {"what": op, "disk_dtype": disk, **best_of(runs)}
                    del line["op"]
                    lines[(disk, op, side)] = line
                    print(json.dumps(line), flush=True)
        print(json.dumps({"what": "summary", "ours_over": "transformers", **ratios(lines)}),
              flush=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
