"""python -m bench.accelerator [--dry-run] [--only SECTION ...] [--budget SECONDS]
                             [--out PATH] [--bandwidth TB_PER_S] [--peak-tflops TFLOP_PER_S]

Everything a machine with a GPU should check and measure, in one command within a time
budget (default 8 minutes): the GPU-relevant tests on the GPU, then the benchmarks. Writes
one JSON file (`--out`, default runs/accelerator.json) and prints a Markdown table for the
README (docs/benchmarks.md's "On a GPU" table has its rows). bench/accelerator.md says how
to run it on a lent machine and which wheels to carry.

Sections, in this order, each in a process of its own (a crash or an out-of-memory in one
leaves the others, and each has the whole GPU); one whose budget (`PLAN`) no longer fits in
what is left of the whole is skipped, one that runs is stopped at 1.5 times its budget (3
in a dry run) or at the end of the whole, keeping what it printed; the JSON and the table
say which:

    device   the device (`device_kind`, memory, platform, JAX and library versions), its
             datasheet figures (`bench.chips`), a measured copy bandwidth and bf16 matmul rate
    tests    pytest on the GPU (`ZOO_TEST_PLATFORM`, tests/conftest.py) over `GPU_TESTS`:
             attention implementations (cuDNN against the materialised core, forward and
             gradients; chunked against it), decoding, LoRA, and quantized decoding
             (`INT8_READY`); in a dry run only collected
    train    MFU of the trainer's bf16 step on the Llama-1B shape, for each attention
             implementation and remat policy (`bench.accelerator_sections.TRAIN_CANDIDATES`),
             the fastest timed again: model FLOPs (6N + attention, `bench.train.model_flops`)
             per second over the chip's dense bf16 peak (`--peak-tflops` overrides)
    decode   greedy decoding's step time on the Llama-1B shape at batch 1 and 8, bf16 weights
             and int8 weights (`INT8_READY`), against the HBM bound: (the weights' bytes
             + the filled KV cache's) / the datasheet bandwidth (`--bandwidth` overrides)
    memory   gradient memory and time at T 8k and 32k, cuDNN against chunked attention
             (`bench.memory`'s model, bf16)
    whisper  `python -m bench.whisper` (transformers on torch's GPU where it has one)
    serve    `python -m bench.serve --only gpt2 --requests 16`

`--dry-run` runs the same plan on the CPU with tiny shapes (about a minute; the suite runs
it: tests/test_bench_accelerator.py). User mistakes (an unknown --only section, a bandwidth
of 0) print one `error:` line and exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time

from bench.accelerator_table import markdown
from models.errors import UserError

# Quantized decoding in the plan: the int8 decoding rows (`--int8` to the decode section,
# `models.quantize(params, config, "int8")`) and the quantized tests (`INT8_TESTS`). Off,
# both leave the plan and the table says so (for a tree where models.quantize is absent).
INT8_READY = True

# The tests that can use an accelerator, run on it by the `tests` section (none needs the
# suite's four fake devices or a dataset).
GPU_TESTS = (
    "tests/test_attention_cudnn.py",     # cuDNN against the materialised core (GPU only)
    "tests/test_attention_impls.py",     # chunked against it, forward and gradients, parity
    "tests/test_attention.py",
    "tests/test_generate.py",            # decoding
    "tests/test_beam.py",
    "tests/test_lora.py",                # LoRA
    "tests/test_lora_decode.py",
)
# Quantized decoding's tests, run with `INT8_READY`.
INT8_TESTS = ("tests/test_quantize.py",)


def dry_xla_flags() -> str:
    """XLA_FLAGS of a dry run's processes, instead of the caller's (the suite's fake
    devices among them): compile fast (tiny shapes, nothing measured), as the suite does
    (tests/conftest.py); jaxlib 0.11 has no fusion-emitter switch, and an unknown flag is
    fatal."""
    jaxlib = tuple(int(x) for x in importlib.metadata.version("jaxlib").split(".")[:2])
    return "--xla_backend_optimization_level=0" + (
        " --xla_cpu_use_fusion_emitters=false" if jaxlib < (0, 11) else "")


@dataclasses.dataclass(frozen=True)
class Section:
    """One step of the plan: its name, what it shows, and its time budget in seconds on
    an accelerator (`budget_s`) and in a dry run (`dry_budget_s`)."""

    name: str
    budget_s: float
    dry_budget_s: float
    needs: tuple[str, ...] = ()          # Python packages without which it is skipped


# Budgets: guesses until a GPU run measures them (bench/accelerator.md); the dry run's
# from 2 CPU cores. Sections run in this order, the essentials first.
PLAN = (
    Section("device", 30, 10),
    Section("tests", 150, 20),
    Section("train", 150, 25),
    Section("decode", 60, 15),
    Section("memory", 45, 15),
    Section("whisper", 60, 25, needs=("torch", "transformers")),
    Section("serve", 90, 20),
)
NAMES = tuple(s.name for s in PLAN)


def check_only(only: list[str] | None) -> tuple[str, ...]:
    """The sections to run (`device` always, first).

    Raises:
        UserError: a name that is not a section, naming it and the sections.
    """
    if not only:
        return NAMES
    for name in only:
        if name not in NAMES:
            raise UserError(f"--only {name!r} is not a section; the sections are "
                            f"{', '.join(NAMES)}")
    return tuple(n for n in NAMES if n == "device" or n in only)


def positive(flag: str, value: float | None) -> float | None:
    if value is not None and not value > 0:
        raise UserError(f"{flag} {value!r} must be a number > 0")
    return value


# --- running one section -------------------------------------------------------------

@dataclasses.dataclass
class Ran:
    """A child process's outcome: its exit code (None: stopped at its time limit), the
    JSON lines it printed, its output, and its seconds."""

    code: int | None
    lines: list[dict]
    stdout: str
    stderr: str
    seconds: float


def run_child(argv: list[str], env: dict, timeout: float) -> Ran:
    """Runs `argv` in a session of its own (so a stop ends its workers too), keeping
    whatever it printed when stopped."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=max(timeout, 1.0))
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        code = None
    lines = []
    for text in out.splitlines():
        if text.startswith("{"):
            try:
                lines.append(json.loads(text))
            except json.JSONDecodeError:
                pass
    return Ran(code, lines, out, err, time.perf_counter() - t0)


def child_env(dry: bool, **extra) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
    if dry:
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=dry_xla_flags())
    return env


def tests_argv(dry: bool) -> list[str]:
    selection = list(GPU_TESTS) + (list(INT8_TESTS) if INT8_READY else [])
    if dry:
        return [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0",
                "--collect-only", *selection]
    # -vv: one line per finished test even under the project's -q (a stopped run counts).
    return [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "4", "-vv",
            "-rfE", *selection]


OUTCOME = re.compile(r"\b(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")
NODE = re.compile(r"(tests/\S+\.py::\S+)")
COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")


def parse_pytest(stdout: str, dry: bool) -> dict:
    """Counts and failing tests from pytest's -v output (per-test lines, so a run stopped
    at its limit still counts what finished); a dry run's collected ids."""
    if dry:
        ids = [x for x in stdout.splitlines() if NODE.fullmatch(x.strip())]
        return {"collected": len(ids), "files": sorted({x.split("::")[0] for x in ids})}
    outcomes: dict[str, str] = {}
    for text in stdout.splitlines():
        node, outcome = NODE.search(text), OUTCOME.search(text)
        if node and outcome and not text.startswith(("FAILED ", "ERROR ")):
            outcomes[node.group(1)] = outcome.group(1).lower()
    counts: dict[str, int] = {}
    for outcome in outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    summary = [x for x in stdout.splitlines() if re.search(r"\bin [\d.]+s\b", x)]
    if summary:                              # pytest's own totals, where it got that far
        counts = {("errors" if k.startswith("error") else k): int(n)
                  for n, k in COUNT.findall(summary[-1])}
    failing = sorted(n for n, o in outcomes.items() if o in ("failed", "error"))
    return {"counts": counts, "failing": failing, "finished": bool(summary)}


def section_argv(section: str, args, device: dict) -> list[str]:
    py = sys.executable
    if section == "tests":
        return tests_argv(args.dry_run)
    if section == "whisper":
        argv = [py, "-m", "bench.whisper"]
        if args.dry_run:
            return argv + ["--quick", "--batch", "1", "--beams", "2", "--new-tokens", "4",
                           "--repeats", "1"]
        return argv + (["--torch-device", "cuda"] if device.get("platform") == "gpu" else [])
    if section == "serve":
        return [py, "-m", "bench.serve"] + (["--quick", "--requests", "2"] if args.dry_run else
                                            ["--only", "gpt2", "--requests", "16"])
    argv = [py, "-m", "bench.accelerator_sections", section]
    if args.dry_run:
        argv.append("--dry-run")
    if section == "decode" and args.bandwidth:
        argv += ["--bandwidth", str(args.bandwidth * 1e12)]
    if section == "decode" and INT8_READY:
        argv.append("--int8")
    if section == "train" and args.peak_tflops:
        argv += ["--peak-flops", str(args.peak_tflops * 1e12)]
    return argv


def result_of(section: str, ran: Ran, dry: bool) -> dict:
    """What a section found, from its lines (or its partial lines, when stopped)."""
    if section == "tests":
        return parse_pytest(ran.stdout, dry)
    if section == "whisper":
        return next((x for x in ran.lines if x.get("case") == "whisper_beam"), {})
    if section == "serve":
        return {"lines": [x for x in ran.lines if "mode" in x or x.get("summary")],
                "summaries": [x for x in ran.lines if x.get("summary")]}
    final = next((x["result"] for x in ran.lines if x.get("section") == section), None)
    if final is not None:
        return final
    return {"partial": True, "lines": ran.lines}


def status_of(section: str, ran: Ran, result: dict, dry: bool) -> str:
    if ran.code is None:
        return "timeout"
    if section == "tests" and not dry:
        bad = result["counts"].get("failed", 0) + result["counts"].get("errors", 0)
        return "failed" if bad or ran.code not in (0, 1) or not result["finished"] else "ok"
    return "ok" if ran.code == 0 and not result.get("partial") else "error"


def why_skipped(section: Section, chosen, *, left: float, budget: float,
                own: float) -> str | None:
    """Why `section` does not run (None: it runs): not chosen, a package it needs is
    missing, or its budget `own` no longer fits in the `left` of the whole `budget`
    (`device` always runs)."""
    missing = [m for m in section.needs if importlib.util.find_spec(m) is None]
    if section.name not in chosen:
        return "not in --only"
    if missing:
        return f"needs {' and '.join(missing)}, which this Python lacks"
    if left < own and section.name != "device":
        return f"{left:.0f} s of the {budget:.0f} s budget left; it needs about {own:.0f} s"
    return None


def run_plan(args) -> dict:
    """Runs the chosen sections within the budget; the whole report (see the module
    docstring)."""
    start = time.perf_counter()
    budget = args.budget or (60.0 if args.dry_run else 480.0)
    chosen = check_only(args.only)
    sections: dict[str, dict] = {}
    device: dict = {}
    for section in PLAN:
        own = section.dry_budget_s if args.dry_run else section.budget_s
        left = budget - (time.perf_counter() - start)
        entry = {"budget_s": own}
        reason = why_skipped(section, chosen, left=left, budget=budget, own=own)
        if reason:
            entry.update(status="skipped", reason=reason)
        else:
            extra = {}
            if section.name in ("tests", "whisper"):     # several processes on one GPU
                extra["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
            if section.name == "tests" and not args.dry_run:
                extra["ZOO_TEST_PLATFORM"] = device.get("test_platform", "cpu")
            ran = run_child(section_argv(section.name, args, device),
                            child_env(args.dry_run, **extra),
                            min(own * (3 if args.dry_run else 1.5), left))
            result = result_of(section.name, ran, args.dry_run)
            entry.update(status=status_of(section.name, ran, result, args.dry_run),
                         seconds=round(ran.seconds, 1), result=result)
            if entry["status"] in ("error", "timeout", "failed"):
                entry["stderr_tail"] = ran.stderr[-3000:]
            if section.name == "device":
                device = result if entry["status"] == "ok" else {}
        sections[section.name] = entry
        print(f"[bench.accelerator] {section.name}: {entry['status']}"
              + (f" in {entry['seconds']} s" if "seconds" in entry else "")
              + (f" ({entry['reason']})" if "reason" in entry else ""),
              file=sys.stderr, flush=True)
    report = {
        "command": "python -m bench.accelerator " + " ".join(args.argv),
        "dry_run": args.dry_run, "date": datetime.date.today().isoformat(),
        "budget_s": budget, "elapsed_s": round(time.perf_counter() - start, 1),
        "int8_ready": INT8_READY, "device": device, "sections": sections,
    }
    report["markdown"] = markdown(report)
    return report


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python -m bench.accelerator",
                                description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--dry-run", action="store_true",
                   help="the same plan on the CPU with tiny shapes (about a minute)")
    p.add_argument("--only", nargs="+", metavar="SECTION",
                   help=f"these sections (and device): {' '.join(NAMES)}")
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="the whole run's time budget (default 480; 60 with --dry-run)")
    p.add_argument("--out", default=os.path.join("runs", "accelerator.json"),
                   help="the JSON report (default runs/accelerator.json)")
    p.add_argument("--bandwidth", type=float, default=None, metavar="TB_PER_S",
                   help="HBM bandwidth for the decode bound (default: the datasheet's)")
    p.add_argument("--peak-tflops", type=float, default=None, metavar="TFLOP_PER_S",
                   help="dense bf16 peak for MFU (default: the datasheet's)")
    args = p.parse_args(argv)
    args.argv = argv
    try:
        check_only(args.only)
        positive("--bandwidth", args.bandwidth)
        positive("--peak-tflops", args.peak_tflops)
        positive("--budget", args.budget)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = run_plan(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(report["markdown"])
    print(f"[bench.accelerator] wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
