"""The Markdown table `python -m bench.accelerator` prints: one line naming the device and
the run, then one row per figure, in the rows of docs/benchmarks.md's "On a GPU" table.

    print(markdown(report))      # report: bench.accelerator.run_plan's dict

A section that did not run, or stopped, says so in its rows (skipped and why, a time-out,
an error) instead of a figure; nothing is left blank.
"""

from __future__ import annotations

# The rows' names, in order: docs/benchmarks.md's table has the same first column.
ROWS = (
    "GPU tests: attention (cuDNN against XLA), decoding, LoRA",
    "training MFU, Llama-1B shape, bf16 (best implementation and remat)",
    "the same as the trainer passes rows (segment ids)",
    "decode step, Llama-1B shape, bf16 weights, batch 1",
    "decode step, bf16 weights, batch 8",
    "decode step, int8 weights, batch 1",
    "decode step, int8 weights, batch 8",
    "gradient memory and step at T 8k, cuDNN / chunked",
    "gradient memory and step at T 32k, cuDNN / chunked",
    "Whisper, tiny's shape, beam 4, 8 x 30 s",
    "serving 16 requests, GPT-2 small shape",
)


def _gb(n) -> str:
    return "?" if n is None else f"{n / 1e9:.2f} GB"


def _ms(s) -> str:
    return "?" if s is None else f"{s * 1e3:.3g} ms"


def _pct(x) -> str:
    return "?" if x is None else f"{100 * x:.1f}%"


def _not_run(entry: dict | None) -> str | None:
    """Why a section has no figures (None when it has them)."""
    if entry is None:
        return "not run"
    status = entry.get("status")
    if status == "skipped":
        return f"skipped: {entry['reason']}"
    if status == "timeout" and not entry.get("result"):
        return f"stopped at its {entry['budget_s']:.0f} s budget"
    if status == "error" and not entry.get("result"):
        return "failed to run (the JSON's stderr_tail)"
    return None


def tests_row(entry: dict, dry: bool) -> str:
    r = entry["result"]
    if dry:
        return f"{r['collected']} collected from {len(r['files'])} files (a dry run runs none)"
    counts = r["counts"]
    text = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "none ran"
    if not r["finished"]:
        text += f" (stopped at its {entry['budget_s']:.0f} s budget)"
    if r["failing"]:
        text += "; failing: " + ", ".join(f"`{x}`" for x in r["failing"][:5])
    return f"{text} ({entry['seconds']:.0f} s)"


def _candidate(c: dict) -> str:
    name = f"{c['impl']}/{c['remat']}" + (" unpacked" if c["rows"] == "unpacked" else "")
    if c["status"] == "timed":
        return f"{name} {c['step_s']:.3g} s"
    return f"{name} {c['status']}"


def train_rows(entry: dict) -> tuple[str, str]:
    r = entry["result"]
    if r.get("partial"):
        done = [x for x in r["lines"] if x.get("what") == "train_candidate"]
        text = "stopped before its figure; candidates: " + ", ".join(map(_candidate, done))
        return text, "see above"
    best = r["best"]
    if best is None:
        return "no candidate ran: " + ", ".join(map(_candidate, r["candidates"])), "-"
    mfu = (f"**{_pct(best['mfu'])}** of {r['peak_bf16_flops'] / 1e12:.0f} TFLOP/s "
           f"({r['peak_source']})" if r["peak_bf16_flops"] else
           "MFU not known (no datasheet peak: --peak-tflops)")
    first = (f"{mfu}: {best['impl']} attention, remat "
             f"{best['remat']}{', rows unpacked' if best['rows'] == 'unpacked' else ''}; "
             f"{best['tokens_per_s']:,} tokens/s, {r['rows']} x {r['length']} tokens a step "
             f"({_pct(best['mfu_vs_measured_matmul'])} of the measured bf16 matmul); "
             "candidates: " + ", ".join(map(_candidate, r["candidates"])))
    trained = r.get("best_as_trained")
    if trained is None:
        second = "no candidate with the trainer's rows ran"
    elif best["rows"] == "trainer":
        second = "the same (cuDNN refuses segment ids, so the trainer never runs it)"
    else:
        second = (f"{_pct(trained['mfu'])}: {trained['impl']}, remat {trained['remat']}, "
                  f"{trained['step_s']:.3g} s a step (cuDNN refuses segment ids)")
    return first, second


def _bandwidth(b) -> str:
    return f"{b / 1e12:.3g} TB/s" if b >= 1e11 else f"{b / 1e9:.3g} GB/s"


def decode_cell(r: dict, row: dict | None) -> str:
    if row is None:
        return "not measured"
    return (f"{_ms(row['s_per_step'])}: **{row['fraction_of_bound']:.2f}** of the HBM bound "
            f"({_ms(row['bound_s_per_step'])} at {_bandwidth(r['bandwidth_bytes_per_s'])}, "
            f"{r['bandwidth_source']}); {row['tokens_per_s']:,.0f} tokens/s")


def decode_rows(entry: dict, int8_ready: bool) -> list[str]:
    r = entry["result"]
    rows = r["rows"] if not r.get("partial") else [x for x in r["lines"]
                                                   if x.get("what") == "decode"]
    if r.get("partial"):
        r = {"bandwidth_bytes_per_s": float("nan"), "bandwidth_source": "stopped"}
    by = {(x["weights"], x["batch"]): x for x in rows}
    cells = [decode_cell(r, by.get(("bfloat16", b))) for b in (1, 8)]
    for b in (1, 8):
        cells.append(decode_cell(r, by.get(("int8", b))) if int8_ready else
                     "not in the plan yet: `models.quantize` (bench.accelerator.INT8_READY)")
    return cells


def memory_cell(lines: list[dict], T: int) -> str:
    by = {x["impl"]: x for x in lines if x.get("T") == T}
    parts = []
    for impl in ("cudnn", "chunked"):
        x = by.get(impl)
        if x is None:
            parts.append(f"{impl}: not measured")
        elif "refused" in x:
            parts.append(f"{impl}: refused ({x['refused'].split(': ', 1)[-1]})")
        elif "error" in x:
            parts.append(f"{impl}: failed ({x['error']})")
        else:
            parts.append(f"{impl} {_gb(x['temp_bytes'])}, {_ms(x.get('step_s'))}")
    return "; ".join(parts)


def whisper_cell(entry: dict) -> str:
    r = entry["result"]
    if not r:
        return "no result (the JSON's stderr_tail)"
    return (f"**{r['speedup']}x** transformers' generate on torch "
            f"{r.get('transformers_device', 'cpu')} ({r['ours_audio_s_per_s']} audio s/s; "
            f"same tokens: {'yes' if r['same_tokens'] else 'no'}; batch {r['batch']}, "
            f"beam {r['beams']})")


def serve_cell(entry: dict) -> str:
    summaries = entry["result"]["summaries"]
    if not summaries:
        return "no summary (stopped or failed: the JSON)"
    s = summaries[-1]
    return (f"**{s['throughput_vs_static']}x** static batching, "
            f"**{s['throughput_vs_serial']}x** one at a time; time to first token p99 "
            f"{s['ttft_p99_s']} s, between tokens p99 {s['itl_p99_s']} s ({s['model']})")


def _device_line(report: dict) -> str:
    d = report["device"]
    if not d:
        return "The device section did not run: no device named."
    versions = d.get("versions", {})
    plugins = ", ".join(f"{k} {v}" for k, v in sorted(versions.items())
                        if k.startswith("jax-cuda") or k.startswith("jax_cuda"))
    memory = (f"{d['memory_bytes'] / 2 ** 30:.1f} GiB" if d.get("memory_bytes")
              else "memory not reported")
    line = (f"**{d['kind']}** ({memory}; {d.get('chip') or 'no datasheet entry'}), JAX "
            f"{versions.get('jax', '?')}, jaxlib {versions.get('jaxlib', '?')}"
            + (f", {plugins}" if plugins else "")
            + f"; `{report['command'].strip()}` on {report['date']}, "
            f"{report['elapsed_s']:.0f} s of a {report['budget_s']:.0f} s budget.")
    if report["dry_run"]:
        line += " A dry run: tiny shapes on the CPU, not measurements."
    return line


def markdown(report: dict) -> str:
    """The device line and the table (see the module docstring)."""
    s = report["sections"]
    cells: dict[str, str] = {}

    def fill(names, section, make):
        why = _not_run(s.get(section))
        values = [why] * len(names) if why else make()
        if isinstance(values, str):
            values = [values]
        for name, value in zip(names, values, strict=True):
            cells[name] = value

    fill(ROWS[0:1], "tests", lambda: tests_row(s["tests"], report["dry_run"]))
    fill(ROWS[1:3], "train", lambda: list(train_rows(s["train"])))
    fill(ROWS[3:7], "decode", lambda: decode_rows(s["decode"], report["int8_ready"]))

    def memory():
        r = s["memory"]["result"]
        lines = r["rows"] if not r.get("partial") else r["lines"]
        Ts = sorted({x["T"] for x in lines if "T" in x})
        return [memory_cell(lines, T) for T in (Ts + [None, None])[:2]]
    fill(ROWS[7:9], "memory", memory)
    fill(ROWS[9:10], "whisper", lambda: whisper_cell(s["whisper"]))
    fill(ROWS[10:11], "serve", lambda: serve_cell(s["serve"]))
    out = [_device_line(report), "", "| what | figure |", "|---|---|"]
    out += [f"| {name} | {cells[name]} |" for name in ROWS]
    return "\n".join(out)
