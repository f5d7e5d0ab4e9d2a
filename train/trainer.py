"""The training loop: data, model, optimiser, checkpoints, evaluation, logs, summary.json.

    summary = train_and_evaluate(configs.get("default"), "runs/default")

Restarting with the same workdir resumes from the newest readable checkpoint, exactly (the
data position, RNG and optimiser state are all in it). SIGTERM or Ctrl-C saves and returns;
a NaN or Inf loss raises `FloatingPointError` naming the step, without saving.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import time

import jax
import numpy as np

import models
from train import (
    checkpoint,
    data as data_lib,
    evaluate,
    parallel,
    state as state_lib,
    step as step_lib,
)
from train.model_config import model_config


class MetricWriter:
    """metrics.jsonl, plus TensorBoard event files (tensorboardX, no TensorFlow)."""

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
    if _main_thread():   # signal handlers can only be installed from the main thread
        old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield lambda step: flag["signal"]
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


def get_tokenizer(config, ds: data_lib.Dataset, workdir: str) -> data_lib.Tokenizer:
    """The run's tokenizer: reloaded from the workdir, or built and saved there.

    With several processes (sharing the workdir) the lead builds it and the others load
    that one, so every process encodes the data with the same pieces.
    """
    path = os.path.join(workdir, "tokenizer")
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        tok = _build_tokenizer(config, ds, path) if jax.process_index() == 0 else None
        multihost_utils.sync_global_devices("tokenizer saved")
        return tok if tok is not None else data_lib.load_tokenizer(path)
    return _build_tokenizer(config, ds, path)


def _build_tokenizer(config, ds: data_lib.Dataset, path: str) -> data_lib.Tokenizer:
    """Loads the tokenizer saved at `path`, or trains (sentencepiece) or makes it and saves it."""
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        return data_lib.load_tokenizer(path)
    if config.tokenizer == "byte":
        tok = data_lib.ByteTokenizer()
    elif config.tokenizer == "sentencepiece":
        train = ds.split("train")
        n = min(len(train), 500_000)
        texts = (t for ex in ds.examples("train", range(n)) for t in ex)
        tok = data_lib.train_sentencepiece(texts, config.vocab_size,
                                           model_type=config.spm_model_type)
    else:
        raise ValueError(f"tokenizer={config.tokenizer!r} must be 'sentencepiece' or 'byte'")
    tok.save(path)
    return tok


def _load_dataset(config, lead: bool) -> data_lib.Dataset:
    """Opens the dataset; with several processes the lead prepares it first, alone, so that
    processes sharing a data directory never write the same TFDS files at once."""
    def load():
        return data_lib.load_dataset(
            config.dataset, config.data_dir or None,
            data_files=tuple(p for p in config.data_files.split(",") if p),
            reverse_translation=config.reverse_translation)

    if jax.process_count() == 1:
        return load()
    from jax.experimental import multihost_utils
    ds = load() if lead else None
    multihost_utils.sync_global_devices("dataset prepared")
    return ds if lead else load()


def pipeline_config(config, eval_: bool = False) -> data_lib.PipelineConfig:
    return data_lib.PipelineConfig(
        per_device_batch_size=(config.eval_per_device_batch_size if eval_
                               else config.per_device_batch_size),
        max_source_length=config.max_source_length, max_target_length=config.max_target_length,
        packing=config.packing and not eval_, overlong=config.overlong, seed=config.seed,
        worker_count=0 if eval_ else config.data_workers)


def maybe_initialize_distributed(config) -> None:
    """`jax.distributed.initialize()` when `config.distributed`: with `coordinator_address`
    (host:port of process 0), `num_processes` and `process_id` as given; without it, as the
    cluster says (TPU pods, SLURM, Open MPI and Kubernetes are detected by JAX)."""
    if not config.distributed or jax.distributed.is_initialized():
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")   # CPU-only runs
    if config.coordinator_address:
        jax.distributed.initialize(coordinator_address=config.coordinator_address,
                                   num_processes=config.num_processes,
                                   process_id=config.process_id)
    else:
        jax.distributed.initialize()


def train_and_evaluate(config, workdir: str, *, hooks=()) -> dict:
    """Trains `config` into `workdir` (resuming if it holds checkpoints); returns the summary.

    Args:
        hooks: callables `hook(step, metrics)` run on the host after each step's metrics are
            read (tests use them to send signals).
    """
    maybe_initialize_distributed(config)
    os.makedirs(workdir, exist_ok=True)
    lead = jax.process_index() == 0
    ds = _load_dataset(config, lead)
    tok = get_tokenizer(config, ds, workdir)
    mcfg = model_config(config, tok.vocab_size)
    if mcfg.is_encoder_decoder != (ds.kind == "translation"):
        raise ValueError(f"model {config.model!r} ({mcfg.architecture}) does not fit dataset "
                         f"{config.dataset!r} ({ds.kind})")
    model = models.build(mcfg)
    pcfg = pipeline_config(config)
    source, stats = data_lib.train_source(ds, tok, pcfg, cache_dir=os.path.join(workdir, "cache"))
    eval_batches, eval_stats = data_lib.eval_batches(
        ds, tok, pipeline_config(config, eval_=True), config.eval_split)
    if lead:
        print(f"data: {config.dataset} train {stats.summary()}; {config.eval_split} "
              f"{eval_stats.summary()}" + (f"; {ds.bad_lines.summary()}"
                                          if ds.bad_lines.total else ""), flush=True)

    tx, schedule = state_lib.make_optimizer(config)
    first = jax.tree.map(lambda x: x[0], source[0])
    init_args = ((first["inputs"], first["targets"]) if mcfg.is_encoder_decoder
                 else (first["targets"],))
    params = jax.jit(model.init)(jax.random.key(config.seed), *init_args)["params"]
    state = state_lib.TrainState.create(params, tx, config.seed)
    mngr = checkpoint.manager(workdir, config.keep_checkpoints)
    iterator = data_lib.train_iterator(source, pcfg)
    resumed_from = None
    restored = checkpoint.restore_latest(mngr, jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), state),
        set_aside=lead)
    if restored is not None:
        resumed_from, got = restored
        state = state.replace(params=got["params"], opt_state=got["train"]["opt_state"],
                              step=got["train"]["step"], rng=got["train"]["rng"])
        iterator.set_state(got["data"])
        if lead:
            print(f"resumed from step {resumed_from}", flush=True)

    train_fn, eval_fn = step_lib.make_steps(model, config, schedule)
    dp = parallel.DataParallel(config.parallel, train_fn, eval_fn)
    state = dp.put_state(state)
    writer = MetricWriter(workdir, lead)
    config_json = json.loads(config.to_json())

    def save(step: int):
        checkpoint.save(mngr, step, dp.host_state(state), iterator.get_state(), config_json, tok)

    step = int(resumed_from or 0)
    start_time, train_seconds = time.time(), 0.0
    window = {"tokens": 0.0, "time": time.time()}
    progress = _progress(config.num_train_steps, step, lead)
    stopped = None
    with _stop_signals() as should_stop, contextlib.closing(writer), \
            contextlib.closing(progress):
        pending = None
        while step < config.num_train_steps:
            stopped = should_stop(step)
            if stopped:
                break
            batch = next(iterator)
            new_state, metrics = dp.train_step(state, batch)
            if pending is not None:
                # Metrics of the previous step, read while this one runs.
                _check_and_log(pending, writer, window, progress, hooks, config)
            state, pending = new_state, (step + 1, metrics, dp)
            step += 1
            if step % config.checkpoint_every_steps == 0 or step % config.eval_every_steps == 0:
                _check_and_log(pending, writer, window, progress, hooks, config)
                pending = None
                if step % config.eval_every_steps == 0 and step < config.num_train_steps:
                    _evaluate(dp, state, model, tok, ds, eval_batches, config, step, writer,
                              lead, test=False)
                if step % config.checkpoint_every_steps == 0:
                    save(step)
        if pending is not None:
            _check_and_log(pending, writer, window, progress, hooks, config)
        train_seconds = time.time() - start_time
        if step not in mngr.all_steps():
            save(step)
        progress.close()
        if stopped:
            if lead:
                print(f"{stopped} received: saved a checkpoint at step {step} and stopped",
                      flush=True)
            summary = {"step": step, "resumed_from_step": resumed_from, "stopped_by": stopped,
                       "train_seconds": round(train_seconds, 2)}
        else:
            final = _evaluate(dp, state, model, tok, ds, eval_batches, config, step, writer, lead,
                              test=True)
            summary = {"step": step, "resumed_from_step": resumed_from,
                       "train_seconds": round(train_seconds, 2), **final}
    if lead:
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return summary


def _progress(total: int, initial: int, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, disable=not enabled, dynamic_ncols=True,
                unit="step", mininterval=1.0)


def _check_and_log(pending, writer, window, progress, hooks, config) -> None:
    step, metrics, dp = pending
    m = step_lib.summarise(dp.metrics(metrics))
    if not math.isfinite(m["loss"]):
        raise FloatingPointError(f"loss is {m['loss']} at step {step}; stopping without saving "
                                 "it, the last good checkpoint is kept")
    window["tokens"] += m["tokens"]
    progress.update(1)
    if step % config.log_every_steps == 0:
        now = time.time()
        m["tokens_per_s"] = window["tokens"] / max(now - window["time"], 1e-9)
        window.update(tokens=0.0, time=now)
        writer.write(step, "train", m)
        progress.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{m['tokens_per_s']:.0f}")
    for hook in hooks:
        hook(step, m)


def _evaluate(dp, state, model, tok, ds, eval_batches, config, step, writer, lead, test):
    """Validation loss metrics and decoded scores; at the end also the test split."""
    params = dp.params(state)
    val = evaluate.loss_metrics(dp, params, eval_batches)
    host_params = dp.host_state(state).params
    out = {"validation": val}
    if ds.kind == "translation" and config.num_eval_decode:
        greedy, triples = evaluate.decoded_metrics(model, host_params, tok, ds,
                                                   config.eval_split, config.num_eval_decode,
                                                   config, beam_size=1)
        val.update(greedy)
        if config.beam_size > 1:
            beam, _ = evaluate.decoded_metrics(model, host_params, tok, ds, config.eval_split,
                                               min(config.num_eval_decode, 100), config,
                                               config.beam_size)
            val.update({f"beam_{k}": v for k, v in beam.items()})
        if lead:
            for s, r, h in triples[:config.show_examples]:
                print(f"  source:     {s}\n  reference:  {r}\n  hypothesis: {h}", flush=True)
    writer.write(step, "eval", val)
    if lead:
        print(f"step {step} {config.eval_split}: " + ", ".join(
            f"{k} {v:.4g}" for k, v in val.items()), flush=True)
    if test and ds.kind == "translation" and config.num_test_decode and \
            config.test_split in ds.splits:
        test_scores, _ = evaluate.decoded_metrics(model, host_params, tok, ds, config.test_split,
                                                  config.num_test_decode, config, beam_size=1)
        out["test"] = test_scores
        writer.write(step, "test", test_scores)
    return out
