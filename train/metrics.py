"""Where step metrics go: metrics.jsonl, TensorBoard, the progress bar, and test hooks."""

from __future__ import annotations

import json
import math
import os
import time

from train import step as step_lib


class MetricWriter:
    """metrics.jsonl, plus TensorBoard event files (tensorboardX, no TensorFlow).

    Inert when not `enabled` (every process but the lead)."""

    def __init__(self, workdir: str, enabled: bool):
        self.enabled = enabled
        if enabled:
            from tensorboardX import SummaryWriter
            self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a")
            self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def write(self, step: int, prefix: str, metrics: dict) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps({"step": step, "split": prefix, **metrics}) + "\n")
        self._jsonl.flush()
        for k, v in metrics.items():
            if isinstance(v, (int, float)):
                self._tb.add_scalar(f"{prefix}/{k}", v, step)
        self._tb.flush()

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            self._tb.close()


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
