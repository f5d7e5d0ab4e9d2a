"""Where step metrics go: metrics.jsonl, TensorBoard, the progress bar, and test hooks."""

from __future__ import annotations

import json
import math
import os
import sys
import time

from train import step as step_lib
from train.workdir import WorkdirError, write_text


def _summary_writer():
    """tensorboardX's SummaryWriter, imported without importing torch: tensorboardX imports
    torch where it is installed only to accept torch tensors, which a run never logs (its
    scalars are Python numbers), and importing torch takes about 2 s of a run's start. A
    process that has torch already gets the usual import."""
    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None              # `import torch` raises ImportError meanwhile
    try:
        from tensorboardX import SummaryWriter
    finally:
        if sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    return SummaryWriter


class MetricWriter:
    """metrics.jsonl, plus TensorBoard event files (tensorboardX, no TensorFlow).

    Inert when not `enabled` (every process but the lead).

    Args:
        workdir: the run directory.
        enabled: this process writes (the lead).
        resume_step: the step the run goes on from (0 for a fresh start). What an earlier
            run logged past it is dropped, so each step is recorded once however often the
            run was killed: metrics.jsonl keeps its rows up to `resume_step` (rewritten
            whole, then renamed over the old file), and the new TensorBoard events file
            starts with a `SessionLog.START` at `resume_step + 1`, which tells TensorBoard
            to discard the older files' events from that step on (tensorboardX's
            `purge_step`).
    """

    def __init__(self, workdir: str, enabled: bool, resume_step: int = 0):
        self.enabled = enabled
        if not enabled:
            return
        SummaryWriter = _summary_writer()
        path = os.path.join(workdir, "metrics.jsonl")
        if os.path.exists(path):
            _keep_rows_up_to(path, resume_step)
        try:
            self._jsonl = open(path, "a")
        except OSError as e:
            raise WorkdirError(f"cannot write {path}: {e.strerror}") from e
        tb = os.path.join(workdir, "tensorboard")
        earlier = os.path.isdir(tb) and any("tfevents" in n for n in os.listdir(tb))
        # A name of its own: tensorboardX names files by the second and truncates an
        # existing file of the same name (a run resumed within the second would erase one).
        self._tb = SummaryWriter(tb, purge_step=resume_step + 1 if earlier else None,
                                 filename_suffix=f".{os.getpid()}.{time.time_ns() % 10**9}")

    def write(self, step: int, prefix: str, metrics: dict) -> None:
        if not self.enabled:
            return
        try:
            self._jsonl.write(json.dumps({"step": step, "split": prefix, **metrics}) + "\n")
            self._jsonl.flush()
        except OSError as e:
            raise WorkdirError(f"cannot write {self._jsonl.name}: {e.strerror}") from e
        for k, v in metrics.items():
            if isinstance(v, (int, float)):
                self._tb.add_scalar(f"{prefix}/{k}", v, step)
        self._tb.flush()

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            self._tb.close()


def _keep_rows_up_to(path: str, step: int) -> None:
    """Rewrites metrics.jsonl without its rows past `step` (and any line a kill cut short)."""
    kept, dropped = [], 0
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
                keep = line.endswith("\n") and row["step"] <= step
            except (ValueError, KeyError, TypeError):
                keep = False
            if keep:
                kept.append(line)
            else:
                dropped += 1
    if dropped:
        write_text(path, "".join(kept))


class StepLog:
    """Reads one step's summed metrics on the host, stops on a non-finite loss, and logs
    every `log_every` steps with the token rate since the last log.

    Args:
        writer: where logged steps go.
        progress: a tqdm bar (updated every step).
        log_every: steps between logged rows.
        hooks: callables `hook(step, metrics)` run after every step (tests send signals).
    """

    def __init__(self, writer: MetricWriter, progress, log_every: int, hooks=()):
        self.writer, self.progress, self.log_every, self.hooks = writer, progress, log_every, hooks
        self._tokens, self._since = 0.0, time.time()

    def __call__(self, step: int, host_sums: dict) -> None:
        m = step_lib.summarise(host_sums)
        if not math.isfinite(m["loss"]):
            raise FloatingPointError(f"loss is {m['loss']} at step {step}; stopping without "
                                     "saving it, the last good checkpoint is kept")
        self._tokens += m["tokens"]
        self.progress.update(1)
        if step % self.log_every == 0:
            now = time.time()
            m["tokens_per_s"] = self._tokens / max(now - self._since, 1e-9)
            self._tokens, self._since = 0.0, now
            self.writer.write(step, "train", m)
            self.progress.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{m['tokens_per_s']:.0f}")
        for hook in self.hooks:
            hook(step, m)
