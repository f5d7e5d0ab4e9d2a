"""kill -9 at random moments, at length (a script, not collected by pytest).

    python tests/kill_soak.py [--kills 20] [--steps 40] [--seed 0] [--data-dir DIR]

Trains `tiny_train_config` with a checkpoint after every step, so most kills that land in
training land inside a save (orbax writing, orbax finalising, or the integrity manifest).
Each worker (tests/train_worker.py, in a fresh interpreter) is SIGKILLed at a random moment
after it starts (3 times in 4 during or just after one of its saves, the others anywhere from
its start to its end: imports, restoring, compiling, training, evaluating, exporting),
then started again on the same workdir, until one finishes; then a new round begins in a
fresh workdir, until `--kills` kills are done. Every round must end with
the parameters, the validation loss and the metrics of an uninterrupted run, bit for bit,
with each train step logged once. Prints one line per kill (where it landed, what the next
start said) and a verdict; exits 1 if any round differs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# The suite's XLA flags (tests/conftest.py): fast compiles; the reference and the soak share them.
os.environ["XLA_FLAGS"] = ("--xla_backend_optimization_level=0 "
                           "--xla_cpu_use_fusion_emitters=false")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tests.train_helpers import train_metric_rows, worker  # noqa: E402

EVENT = re.compile(r"EVENT (save-start|save-end) (\d+)")


class Watched:
    """A worker whose output lines are read as they come, with their arrival times."""

    def __init__(self, workdir: str, data_dir: str, settings: dict, nth_save: int = 0):
        self.started = time.monotonic()
        self.proc = worker(workdir, data_dir, 4, **settings)
        self.lines: list[tuple[float, str]] = []
        self.nth_save, self.saves_seen = nth_save, 0
        self.reached = threading.Event()        # set once the nth save has started
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic() - self.started, line.rstrip("\n")))
            self.saves_seen += sum(kind == "save-start" for kind, _ in EVENT.findall(line))
            if self.nth_save and self.saves_seen >= self.nth_save:
                self.reached.set()
        self.reached.set()                      # the process ended first

    def wait(self, timeout: float) -> int | None:
        try:
            self.proc.wait(timeout=timeout)
        except Exception:
            return None
        self._reader.join()
        return self.proc.returncode

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self._reader.join()

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def where(lines: list[tuple[float, str]]) -> str:
    """Where a killed worker was, from its last lines."""
    # The progress bar's carriage returns share lines with the events: search, not match.
    events = [e for _, line in lines for e in EVENT.findall(line)]
    if not events:
        data = any("data: " in line for _, line in lines)
        return "setting up (compiling, restoring)" if data else "starting (imports, data)"
    kind, step = events[-1]
    return f"inside the save of step {step}" if kind == "save-start" else \
        f"training after the save of step {step}"


def params_of(workdir: str):
    from train import checkpoint
    return checkpoint.restore_model(workdir).params


def same_tree(a, b) -> bool:
    import jax
    import numpy as np
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(leaves_a) == len(leaves_b) and all(
        np.array_equal(x, y) for x, y in zip(leaves_a, leaves_b, strict=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    base = tempfile.mkdtemp(prefix="kill-soak-")
    data_dir = args.data_dir or os.path.join(base, "tfds")
    settings = {"num_train_steps": args.steps, "checkpoint_every_steps": 1, "trace": True}

    print(f"reference: {args.steps} steps, a checkpoint after each, uninterrupted", flush=True)
    reference_dir = os.path.join(base, "reference")
    ref = Watched(reference_dir, data_dir, settings)
    assert ref.wait(600) == 0, ref.text()[-3000:]
    ref_params, ref_rows = params_of(reference_dir), train_metric_rows(reference_dir)
    ref_summary = json.loads(ref.text().rsplit("SUMMARY ", 1)[1])
    # The worker's second run reuses the prepared data; time one to spread kills over it.
    timing = Watched(os.path.join(base, "timing"), data_dir, settings)
    assert timing.wait(600) == 0, timing.text()[-3000:]
    span = timing.lines[-1][0]
    events = [(t, kind) for t, line in timing.lines for kind, _ in EVENT.findall(line)]
    starts_ = [t for t, kind in events if kind == "save-start"]
    ends = [t for t, kind in events if kind == "save-end"]
    save_seconds = sum(e - b for b, e in zip(starts_, ends, strict=True)) / len(ends)
    print(f"an uninterrupted run takes {span:.1f} s; a save {save_seconds:.2f} s. 3 kills in 4 "
          f"come 0 to {1.5 * save_seconds:.2f} s after the start of a start's nth save (n in "
          f"1..8), the others 0 to {span:.1f} s after a start", flush=True)

    kills, rounds, failures, set_aside = 0, 0, [], 0
    landed: dict[str, int] = {}
    while kills < args.kills:
        rounds += 1
        workdir = os.path.join(base, f"round{rounds}")
        starts, summary = 0, None
        while kills < args.kills:
            starts += 1
            if rng.random() < 0.75:     # at the start of its nth save, or a little later
                w = Watched(workdir, data_dir, settings, nth_save=rng.randint(1, 8))
                w.reached.wait(600)
                delay = rng.uniform(0, 1.5 * save_seconds)
                moment = f"{delay:4.2f} s into save {w.nth_save} of this start"
            else:                       # anywhere from its start to its end
                w = Watched(workdir, data_dir, settings)
                delay = rng.uniform(0, span)
                moment = f"{delay:5.2f} s after its start"
            code = w.wait(delay)
            said = [line for _, line in w.lines if "unreadable" in line or "resumed from" in line
                    or line.startswith("error") or "Traceback" in line]
            set_aside += sum("unreadable" in line for line in said)
            if code is None:
                w.kill()                 # then every line printed before the kill is read
                spot = where(w.lines)
                kills += 1
                kind = re.sub(r"\d+", "N", spot)
                landed[kind] = landed.get(kind, 0) + 1
                print(f"kill {kills:2d} (round {rounds}, start {starts}), {moment}: "
                      f"{spot}" + (f"; on start: {' | '.join(said)}" if said else ""),
                      flush=True)
                continue
            if code == 0:
                summary = json.loads(w.text().rsplit("SUMMARY ", 1)[1])
                print(f"round {rounds}: finished on start {starts}"
                      + (f"; on start: {' | '.join(said)}" if said else ""), flush=True)
            else:
                failures.append(f"round {rounds}: a start exited with {code}:\n"
                                + w.text()[-3000:])
            break
        if summary is None and not any(f.startswith(f"round {rounds}:") for f in failures):
            final = Watched(workdir, data_dir, settings)     # the last kill ended the round
            if final.wait(600) != 0:
                failures.append(f"round {rounds}: the final start failed:\n"
                                + final.text()[-3000:])
                continue
            said = [line for _, line in final.lines if "unreadable" in line]
            set_aside += len(said)
            summary = json.loads(final.text().rsplit("SUMMARY ", 1)[1])
            print(f"round {rounds}: finished on start {starts + 1}"
                  + (f"; on start: {' | '.join(said)}" if said else ""), flush=True)
        if summary is None:
            continue
        ok_params = same_tree(params_of(workdir), ref_params)
        ok_rows = train_metric_rows(workdir) == ref_rows
        ok_val = summary["validation"] == ref_summary["validation"]
        print(f"round {rounds}: step {summary['step']}; parameters "
              f"{'equal' if ok_params else 'DIFFER'}, metrics rows "
              f"{'equal, each step once' if ok_rows else 'DIFFER'}, validation "
              f"{'equal' if ok_val else 'DIFFERS'}", flush=True)
        if not (ok_params and ok_rows and ok_val):
            failures.append(f"round {rounds}: the end differs from the uninterrupted run")

    print(f"\n{kills} kills in {rounds} rounds; where they landed: "
          + ", ".join(f"{k}: {v}" for k, v in sorted(landed.items()))
          + f"; {set_aside} checkpoints set aside on restart", flush=True)
    if failures:
        print("FAILED:\n" + "\n".join(failures), flush=True)
        return 1
    print(f"every round ended bit for bit as the uninterrupted run (workdirs in {base})",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
