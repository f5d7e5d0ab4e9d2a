"""`python -m bench.accelerator`: its dry run (the same plan on the CPU, tiny shapes) writes
every section's entry and the README's table; the table of a full report has a figure in
every row; pytest's output is counted even when a run is stopped; mistakes exit 2."""

import json
import os
import subprocess
import sys

import pytest

from bench import accelerator, accelerator_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _table_rows(text: str) -> dict[str, str]:
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ")]
    return {r[0][2:]: r[1].rstrip(" |") for r in rows[1:]}


@pytest.mark.slow
def test_the_dry_run_writes_every_section_and_the_table(tmp_path):
    """device and decode run, the other sections are skipped by --only, saying so."""
    out = tmp_path / "accelerator.json"
    run = subprocess.run([sys.executable, "-m", "bench.accelerator", "--dry-run", "--only",
                          "decode", "--budget", "120", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    assert set(report) >= {"command", "dry_run", "date", "budget_s", "elapsed_s",
                           "int8_ready", "device", "sections", "markdown"}
    assert report["dry_run"] is True and report["budget_s"] == 120
    device = report["device"]
    assert device["platform"] == "cpu" and device["versions"]["jax"]
    assert {"kind", "memory_bytes", "chip", "measured_copy_bytes_per_s"} <= set(device)
    sections = report["sections"]
    assert list(sections) == list(accelerator.NAMES)
    assert sections["device"]["status"] == sections["decode"]["status"] == "ok"
    decode = sections["decode"]["result"]
    assert decode["bandwidth_source"] == "measured copy"
    weights = ("bfloat16", "int8") if accelerator.INT8_READY else ("bfloat16",)
    assert [(r["weights"], r["batch"]) for r in decode["rows"]] == [
        (w, b) for w in weights for b in (1, 8)]
    by = {(r["weights"], r["batch"]): r for r in decode["rows"]}
    for row in decode["rows"]:
        assert row["s_per_step"] > 0 and row["fraction_of_bound"] > 0
    if accelerator.INT8_READY:          # int8 values and scales: about half bf16's bytes
        assert 0.4 < by["int8", 1]["weight_bytes"] / by["bfloat16", 1]["weight_bytes"] < 0.7
    for name in ("tests", "train", "memory", "whisper", "serve"):
        assert sections[name] == {"budget_s": sections[name]["budget_s"],
                                  "status": "skipped", "reason": "not in --only"}
    assert report["markdown"] in run.stdout
    rows = _table_rows(report["markdown"])
    assert list(rows) == list(accelerator_table.ROWS) and all(rows.values())
    assert "of the HBM bound" in rows["decode step, bf16 weights, batch 8"]
    assert ("of the HBM bound" if accelerator.INT8_READY else "not in the plan") in rows[
        "decode step, int8 weights, batch 1"]
    assert rows["training MFU, Llama-1B shape, bf16 (best implementation and remat)"] == \
        "skipped: not in --only"
    assert "A dry run" in report["markdown"].splitlines()[0]


def test_a_section_runs_only_when_chosen_equipped_and_within_the_budget():
    serve, device = accelerator.PLAN[-1], accelerator.PLAN[0]
    chosen = accelerator.check_only(["serve"])
    assert chosen == ("device", "serve")
    assert accelerator.why_skipped(serve, chosen, left=100, budget=480, own=90) is None
    assert accelerator.why_skipped(serve, chosen, left=42.4, budget=480, own=90) == \
        "42 s of the 480 s budget left; it needs about 90 s"
    assert accelerator.why_skipped(device, chosen, left=0, budget=480, own=30) is None
    assert accelerator.why_skipped(accelerator.PLAN[2], chosen, left=400, budget=480,
                                   own=150) == "not in --only"
    lacking = accelerator.Section("x", 1, 1, needs=("no_such_package_here",))
    assert accelerator.why_skipped(lacking, ("x",), left=400, budget=480, own=1) == \
        "needs no_such_package_here, which this Python lacks"


def _full_report() -> dict:
    """A report of every section done, in the shapes the sections write."""
    def ok(result):
        return {"status": "ok", "budget_s": 60, "seconds": 10.0, "result": result}
    decode_row = dict(s_per_step=9e-4, bound_s_per_step=7.4e-4, fraction_of_bound=0.82,
                      tokens_per_s=1111.0)
    return {
        "command": "python -m bench.accelerator ", "dry_run": False, "date": "2026-12-01",
        "budget_s": 480, "elapsed_s": 401.0, "int8_ready": True,
        "device": {"kind": "NVIDIA H100 80GB HBM3", "memory_bytes": 79 * 2 ** 30,
                   "chip": "H100 SXM", "versions": {"jax": "0.11.2", "jaxlib": "0.11.2",
                                                    "jax-cuda13-plugin": "0.11.2"}},
        "sections": {
            "device": ok({}),
            "tests": ok({"counts": {"passed": 120, "skipped": 2}, "failing": [],
                         "finished": True}),
            "train": ok({"rows": 4, "length": 2048, "peak_bf16_flops": 989e12,
                         "peak_source": "H100 SXM",
                         "candidates": [dict(impl="cudnn", remat="none", rows="unpacked",
                                             status="timed", step_s=0.2),
                                        dict(impl="chunked", remat="dots", rows="trainer",
                                             status="timed", step_s=0.3),
                                        dict(impl="cudnn", remat="dots", rows="trainer",
                                             status="refused")],
                         "best": dict(impl="cudnn", remat="none", rows="unpacked",
                                      step_s_median=0.2, tokens_per_s=40960, mfu=0.45,
                                      mfu_vs_measured_matmul=0.55),
                         "best_as_trained": dict(impl="chunked", remat="dots", step_s=0.3,
                                                 mfu=0.30)}),
            "decode": ok({"bandwidth_bytes_per_s": 3.35e12, "bandwidth_source": "H100 SXM",
                          "rows": [dict(decode_row, weights=w, batch=b)
                                   for w in ("bfloat16", "int8") for b in (1, 8)]}),
            "memory": ok({"rows": [dict(T=T, impl=i, temp_bytes=1e9, step_s=0.05)
                                   for T in (8192, 32768) for i in ("cudnn", "chunked")]}),
            "whisper": ok({"speedup": 7.5, "transformers_device": "cuda",
                           "ours_audio_s_per_s": 900.0, "same_tokens": True, "batch": 8,
                           "beams": 4}),
            "serve": {"status": "timeout", "budget_s": 90, "seconds": 135.0,
                      "result": {"lines": [], "summaries": []}},
        },
    }


def test_a_full_reports_table_has_a_figure_in_every_row():
    text = accelerator_table.markdown(_full_report())
    first = text.splitlines()[0]
    assert "NVIDIA H100 80GB HBM3" in first and "79.0 GiB" in first and "0.11.2" in first
    rows = _table_rows(text)
    assert list(rows) == list(accelerator_table.ROWS)
    assert rows["GPU tests: attention (cuDNN against XLA), decoding, LoRA"] == \
        "120 passed, 2 skipped (10 s)"
    train = rows["training MFU, Llama-1B shape, bf16 (best implementation and remat)"]
    assert train.startswith("**45.0%** of 989 TFLOP/s (H100 SXM): cudnn attention, remat "
                            "none, rows unpacked")
    assert "cudnn/dots refused" in train
    assert rows["the same as the trainer passes rows (segment ids)"].startswith(
        "30.0%: chunked, remat dots")
    assert rows["decode step, int8 weights, batch 8"].startswith(
        "0.9 ms: **0.82** of the HBM bound (0.74 ms at 3.35 TB/s")
    assert rows["gradient memory and step at T 32k, cuDNN / chunked"] == \
        "cudnn 1.00 GB, 50 ms; chunked 1.00 GB, 50 ms"
    assert rows["Whisper, tiny's shape, beam 4, 8 x 30 s"].startswith("**7.5x**")
    assert rows["serving 16 requests, GPT-2 small shape"] == \
        "no summary (stopped or failed: the JSON)"


# pytest -n 4 -vv's lines, cut off by the time limit after three tests.
STOPPED = """\
tests/test_generate.py::test_a
[gw0] [  1%] PASSED tests/test_generate.py::test_a
[gw1] [  2%] FAILED tests/test_attention_cudnn.py::test_b[causal-2]
[gw2] [  3%] SKIPPED tests/test_lora_decode.py::test_c[bart]
"""


def test_pytest_outcomes_are_counted_per_test_and_from_the_summary():
    stopped = accelerator.parse_pytest(STOPPED, dry=False)
    assert stopped == {"counts": {"passed": 1, "failed": 1, "skipped": 1},
                       "failing": ["tests/test_attention_cudnn.py::test_b[causal-2]"],
                       "finished": False}
    done = accelerator.parse_pytest(
        STOPPED + "FAILED tests/test_attention_cudnn.py::test_b[causal-2] - AssertionError\n"
        "=== 1 failed, 97 passed, 1 skipped, 2 errors in 80.1s ===\n", dry=False)
    assert done["counts"] == {"failed": 1, "passed": 97, "skipped": 1, "errors": 2}
    assert done["finished"]
    collected = accelerator.parse_pytest("tests/test_a.py::test_x\ntests/test_b.py::test_y[1]\n"
                                         "\n2 tests collected in 1.0s\n", dry=True)
    assert collected == {"collected": 2, "files": ["tests/test_a.py", "tests/test_b.py"]}


@pytest.mark.parametrize("argv,message", [
    (["--only", "tests", "bogus"], "error: --only 'bogus' is not a section; the sections "
                                   "are device, tests, train, decode, memory, whisper, serve"),
    (["--bandwidth", "0"], "error: --bandwidth 0.0 must be a number > 0"),
])
def test_a_mistake_is_one_error_line_and_exit_2(argv, message, capsys):
    assert accelerator.main(["--dry-run", *argv]) == 2
    assert capsys.readouterr().err.strip() == message
