"""The training loop: steps, periodic evaluation and checkpoints, the summary.

    summary = train_and_evaluate(configs.get("default"), "runs/default")

Restarting with the same workdir resumes from the newest readable checkpoint, exactly (the
data position, RNG and optimiser state are all in it). At the end, and when SIGTERM or
Ctrl-C stops the run after saving, the model is exported to WORKDIR/model (the directory
`models.load` and `python -m decode --model` read); a stopped run's summary says
`"preempted": true` and `"stopped_by": "SIGTERM"` (the command line turns that into exit
status 128 + the signal's number). With `max_train_seconds`, the loop also stops after the
first step that ends that many seconds after the invocation's first step began, and the
run ends as at `num_train_steps` (a checkpoint, the export, the final evaluation; the
summary says `"stopped_by": "max_train_seconds"`); the same command resumes it for up to
that long again. With `average_last_checkpoints` > 1 the final evaluation and the export
are of the mean of the newest checkpoints' parameters (`train.checkpoint_average`).

A NaN or Inf loss, or parameters or optimiser state that are not finite when a checkpoint
is due, raise `FloatingPointError` naming the step (and the array), without saving. The
workdir is locked for the whole run (`train.workdir`). Setting up (lock, config, data,
tokenizer, model, objective, wrapper, state, restore) is `train.setup`.

Every evaluation scores the validation loss, accuracy and perplexity, plus what the run's
objective adds (`train.objectives.Objective.evaluate`: decoded exact match and BLEU for
translation); the final one also the test split where the objective scores one (decoded
for translation, loss and per-class F1 for classification).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time

import jax
import numpy as np

from train import checkpoint_average, evaluate
from train.metrics import StepLog
from train.setup import Run, start_run
from train.workdir import write_text


@contextlib.contextmanager
def _stop_signals():
    """Yields `should_stop(step) -> signal name | None`, checked between steps.

    One process: SIGTERM and SIGINT set a flag. Several processes: they must all stop after
    the same step, so SIGTERM goes through JAX's preemption service (a notice to any process
    reaches all of them and they agree on the step); SIGINT keeps its default there.
    """
    if jax.process_count() > 1 and jax.config.jax_enable_preemption_service:
        from jax.experimental import multihost_utils

        def synced(step: int) -> str | None:
            return "SIGTERM" if multihost_utils.reached_preemption_sync_point(step) else None
        yield synced
        return
    flag = {"signal": None}

    def handler(signum, frame):
        flag["signal"] = signal.Signals(signum).name

    old = {}
    # Signal handlers can only be installed from the main thread.
    if threading.current_thread() is threading.main_thread():
        old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield lambda step: flag["signal"]
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _out_of_time(limit: float, started: float):
    """`over() -> bool`: `limit` seconds (0: none) have passed since `started`. With several
    processes, process 0's clock decides for all, so they stop after the same step."""
    if not limit:
        return lambda: False

    def over() -> bool:
        late = time.time() - started >= limit
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            late = bool(multihost_utils.broadcast_one_to_all(np.int32(late)))
        return late
    return over


def train_and_evaluate(config, workdir: str, *, hooks=()) -> dict:
    """Trains `config` into `workdir` (resuming if it holds checkpoints); returns the summary.

    Args:
        config: an `ml_collections.ConfigDict` (read once: `train.run_config`).
        hooks: callables `hook(step, metrics)` run on the host after each step's metrics are
            read (tests use them to send signals).
    """
    run, start = start_run(config, workdir)
    try:
        return _train(run, start, hooks)
    finally:
        run.lock.release()


def _train(run: Run, start, hooks) -> dict:
    state, iterator, step = start.state, start.iterator, start.step
    loop, every_checkpoint = run.config.loop, run.config.checkpoints.checkpoint_every_steps
    from tqdm import tqdm
    progress = tqdm(total=loop.num_train_steps, initial=step, disable=not run.lead,
                    dynamic_ncols=True, unit="step", mininterval=1.0)
    log = StepLog(run.writer, progress, loop.log_every_steps, hooks)
    started = time.time()
    stopped, out_of_time = None, _out_of_time(loop.max_train_seconds, started)
    budget_spent = False
    with _stop_signals() as should_stop, contextlib.closing(run.writer):
        with contextlib.closing(progress):
            pending = None  # (step, metrics) of the previous step, read while the next one runs
            while step < loop.num_train_steps:
                stopped = should_stop(step)
                if stopped:
                    break
                if out_of_time():
                    budget_spent = True
                    break
                new_state, metrics = run.wrapper.train_step(state, next(iterator))
                if pending is not None:
                    log(pending[0], run.wrapper.metrics(pending[1]))
                state, pending, step = new_state, (step + 1, metrics), step + 1
                evaluating = step % loop.eval_every_steps == 0 and step < loop.num_train_steps
                saving = step % every_checkpoint == 0
                if evaluating or saving:
                    log(pending[0], run.wrapper.metrics(pending[1]))
                    pending = None
                    if evaluating:
                        _evaluate(run, state, step, final=False)
                    if saving:
                        run.save(step, state, iterator)
            if pending is not None:
                log(pending[0], run.wrapper.metrics(pending[1]))
        train_seconds = round(time.time() - started, 2)
        if step not in run.checkpoints.all_steps():
            run.save(step, state, iterator)
        state, averaged = checkpoint_average.averaged_state(run, state)
        exported = run.export(state)
        summary = {"step": step, "resumed_from_step": start.resumed_from,
                   "train_seconds": train_seconds, "model": exported,
                   "preempted": bool(stopped)}
        if averaged:
            summary["averaged_steps"] = averaged
        if stopped:
            if run.lead:
                print(f"{stopped} received: saved a checkpoint at step {step}, exported it to "
                      f"{exported} and stopped", flush=True)
            summary["stopped_by"] = stopped
        else:
            if budget_spent:
                summary["stopped_by"] = "max_train_seconds"
                if run.lead:
                    print(f"max_train_seconds={loop.max_train_seconds:g} spent: stopped at "
                          f"step {step} of {loop.num_train_steps} after {train_seconds} s",
                          flush=True)
            summary.update(_evaluate(run, state, step, final=True))
    if run.lead:
        write_text(os.path.join(run.workdir, "summary.json"), json.dumps(summary, indent=2))
    return summary


def _evaluate(run: Run, state, step: int, *, final: bool) -> dict:
    """Validation loss metrics, with what the objective adds (decoded scores for
    translation); at the end (`final`) the test split's metrics where the objective scores
    one (decoded for translation; loss, accuracy and F1 for classification)."""
    data, lead = run.config.data, run.lead
    val = evaluate.loss_metrics(run.wrapper, state.eval_params, run.eval_batches,
                                run.choice.config.label_names)
    more, test = run.objective.evaluate(run, state, final=final)
    val.update(more)
    run.writer.write(step, "eval", val)
    if lead:
        print(f"step {step} {data.eval_split}: "
              + ", ".join(f"{k} {v:.4g}" for k, v in val.items()), flush=True)
    out = {"validation": val}
    if test is not None:
        out["test"] = test
        run.writer.write(step, "test", test)
        if lead:
            print(f"step {step} {data.test_split}: "
                  + ", ".join(f"{k} {v:.4g}" for k, v in test.items()), flush=True)
    return out
