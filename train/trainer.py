"""The training loop: steps, periodic evaluation and checkpoints, the summary.

    summary = train_and_evaluate(configs.get("default"), "runs/default")

Restarting with the same workdir resumes from the newest readable checkpoint, exactly (the
data position, RNG and optimiser state are all in it). At the end, and when SIGTERM or
Ctrl-C stops the run after saving, the model is exported to WORKDIR/model (the directory
`models.load` and `python -m decode --model` read); a stopped run's summary says
`"preempted": true` and `"stopped_by": "SIGTERM"` (the command line turns that into exit
status 128 + the signal's number). A NaN or Inf loss, or parameters or optimiser state that
are not finite when a checkpoint is due, raise `FloatingPointError` naming the step (and the
array), without saving. The workdir is locked for the whole run (`train.workdir`). Setting up
(lock, data, tokenizer, model, state, restore) is `train.setup`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time

import jax

from train import data as data_lib, evaluate
from train.metrics import StepLog
from train.setup import Run, pipeline_config, start_run
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


def train_and_evaluate(config, workdir: str, *, hooks=()) -> dict:
    """Trains `config` into `workdir` (resuming if it holds checkpoints); returns the summary.

    Args:
        hooks: callables `hook(step, metrics)` run on the host after each step's metrics are
            read (tests use them to send signals).
    """
    run, start = start_run(config, workdir)
    try:
        return _train(run, start, config, workdir, hooks)
    finally:
        run.lock.release()


def _train(run: Run, start, config, workdir: str, hooks) -> dict:
    state, iterator, step = start.state, start.iterator, start.step
    from tqdm import tqdm
    progress = tqdm(total=config.num_train_steps, initial=step, disable=not run.lead,
                    dynamic_ncols=True, unit="step", mininterval=1.0)
    log = StepLog(run.writer, progress, config.log_every_steps, hooks)
    started = time.time()
    stopped = None
    with _stop_signals() as should_stop, contextlib.closing(run.writer):
        with contextlib.closing(progress):
            pending = None  # (step, metrics) of the previous step, read while the next one runs
            while step < config.num_train_steps:
                stopped = should_stop(step)
                if stopped:
                    break
                new_state, metrics = run.dp.train_step(state, next(iterator))
                if pending is not None:
                    log(pending[0], run.dp.metrics(pending[1]))
                state, pending, step = new_state, (step + 1, metrics), step + 1
                evaluating = step % config.eval_every_steps == 0 and step < config.num_train_steps
                saving = step % config.checkpoint_every_steps == 0
                if evaluating or saving:
                    log(pending[0], run.dp.metrics(pending[1]))
                    pending = None
                    if evaluating:
                        _evaluate(run, state, step, test=False)
                    if saving:
                        run.save(step, state, iterator)
            if pending is not None:
                log(pending[0], run.dp.metrics(pending[1]))
        train_seconds = round(time.time() - started, 2)
        if step not in run.checkpoints.all_steps():
            run.save(step, state, iterator)
        exported = run.export(state)
        summary = {"step": step, "resumed_from_step": start.resumed_from,
                   "train_seconds": train_seconds, "model": exported,
                   "preempted": bool(stopped)}
        if stopped:
            if run.lead:
                print(f"{stopped} received: saved a checkpoint at step {step}, exported it to "
                      f"{exported} and stopped", flush=True)
            summary["stopped_by"] = stopped
        else:
            summary.update(_evaluate(run, state, step, test=True))
    if run.lead:
        write_text(os.path.join(workdir, "summary.json"), json.dumps(summary, indent=2))
    return summary


def _evaluate(run: Run, state, step: int, *, test: bool) -> dict:
    """Validation loss metrics and decoded scores; at the end (`test`) the test split too
    (decoded for translation; loss, accuracy and F1 for classification)."""
    config, ds, lead = run.config, run.dataset, run.lead
    names = run.choice.config.label_names
    val = evaluate.loss_metrics(run.dp, state.params, run.eval_batches, names)
    out = {"validation": val}
    decodes = ds.kind == "translation" and config.num_eval_decode
    tests = test and ds.kind == "translation" and config.num_test_decode \
        and config.test_split in ds.splits
    if decodes or tests:
        host_params = run.dp.host_state(state).params

        def decoded(split: str, n: int, beam: bool):
            request = evaluate.decode_request(config, run.choice, beam=beam)
            return evaluate.decoded_metrics(run.model, host_params, run.tokenizer, ds,
                                            split=split, n=n, config=config, request=request)
    if decodes:
        greedy, triples = decoded(config.eval_split, config.num_eval_decode, False)
        val.update(greedy)
        if evaluate.decode_request(config, run.choice, beam=True).strategy == "beam":
            beam, _ = decoded(config.eval_split, min(config.num_eval_decode, 100), True)
            val.update({f"beam_{k}": v for k, v in beam.items()})
        if lead:
            for s, r, h in triples[:config.show_examples]:
                print(f"  source:     {s}\n  reference:  {r}\n  hypothesis: {h}", flush=True)
    run.writer.write(step, "eval", val)
    if lead:
        print(f"step {step} {config.eval_split}: "
              + ", ".join(f"{k} {v:.4g}" for k, v in val.items()), flush=True)
    if tests:
        out["test"], _ = decoded(config.test_split, config.num_test_decode, False)
        run.writer.write(step, "test", out["test"])
    elif test and ds.kind == "classification" and config.test_split in ds.splits:
        batches, _ = data_lib.eval_batches(
            ds, run.tokenizer, pipeline_config(config, eval_=True, model=run.choice.config),
            config.test_split)
        out["test"] = evaluate.loss_metrics(run.dp, state.params, batches, names)
        run.writer.write(step, "test", out["test"])
        if lead:
            print(f"step {step} {config.test_split}: "
                  + ", ".join(f"{k} {v:.4g}" for k, v in out["test"].items()), flush=True)
    return out
