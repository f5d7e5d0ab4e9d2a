"""Everything a run fixes before its first step: processes, data, tokenizer, model, state.

    run, start = start_run(config, workdir)
    run.model, run.tokenizer, run.dp ...       # fixed for the whole run (a frozen `Run`)
    start.state, start.iterator, start.step    # where the loop begins (resumed or fresh)

Before anything else, every process locks the workdir (`train.workdir.claim`: one run per
workdir, and a workdir that cannot be written is found in seconds, naming the path).
With several processes sharing a workdir, whatever is written there once (the prepared
dataset, the tokenizer) is made by the lead process first, then read by the others
(`lead_first`).
"""

from __future__ import annotations

import dataclasses
import json
import os

import flax.linen as nn
import grain
import jax
import ml_collections
import orbax.checkpoint as ocp

import models
from models.errors import UserError
from train import (
    checkpoint,
    data as data_lib,
    integrity,
    parallel,
    sharding,
    state as state_lib,
    step as step_lib,
    workdir as workdir_lib,
)
from train.config_checks import check_config
from train.export import write_model
from train.masking import Masking
from train.metrics import MetricWriter
from train.model_config import ModelChoice, choose_model


@dataclasses.dataclass(frozen=True)
class Run:
    """What a run fixes at its start; the loop only reads it.

    Attributes:
        config: the experiment config.
        workdir: the run directory.
        lead: this is process 0 (it prints, writes metrics and the summary).
        dataset, tokenizer, model: the data, its tokenizer and the model built for them.
        choice: the model's config and, fine-tuning, the directory's type and defaults.
        data_record: what the data are (`train.data.data_record`), kept in checkpoints.
        eval_batches: the validation batches, the same on every evaluation.
        dp: the wrapper of the train and eval steps: data-parallel (`parallel.DataParallel`)
            or sharded over a mesh (`sharding.Sharded`).
        writer: metrics.jsonl and TensorBoard (inert on the other processes).
        checkpoints: the orbax checkpoint manager of `workdir/checkpoints`.
        lock: this process's lock on the workdir (`release()` it when the run ends).
    """

    config: ml_collections.ConfigDict
    workdir: str
    lead: bool
    dataset: data_lib.Dataset
    tokenizer: data_lib.Tokenizer
    model: nn.Module
    choice: ModelChoice
    data_record: dict
    eval_batches: list[dict]
    dp: parallel.DataParallel | sharding.Sharded
    writer: MetricWriter
    checkpoints: ocp.CheckpointManager
    lock: workdir_lib.Lock

    def save(self, step: int, state, iterator: grain.DatasetIterator) -> None:
        """A checkpoint of `state` (on devices) and the data position at `step`.

        Raises:
            FloatingPointError: naming the step and the first parameter (or optimiser
                state) array holding a NaN or an Inf; nothing is saved, so the newest
                checkpoint stays the last good one.
        """
        bad = integrity.first_non_finite({"params": state.params,
                                          "opt_state": state.opt_state})
        if bad is not None:
            raise FloatingPointError(f"{bad} is not finite (nan or inf) at step {step}; "
                                     "stopping without saving it, the last good checkpoint "
                                     "is kept")
        item = checkpoint.config_item(json.loads(self.config.to_json()), self.choice,
                                      self.data_record)
        checkpoint.save(self.checkpoints, step, self.dp.saved_state(state),
                        iterator.get_state(), item, tok=self.tokenizer)

    def export(self, state) -> str | None:
        """The model as a directory, WORKDIR/model (written by the lead process; every
        process gathers the params, a collective when they are sharded)."""
        params = self.dp.host_state(state).params
        if not self.lead:
            return None
        path = os.path.join(self.workdir, "model")
        write_model(path, self.choice.config, params,
                    self.tokenizer, model_type=self.choice.model_type,
                    generation=self.choice.generation)
        return path


@dataclasses.dataclass
class Start:
    """Where the loop begins: the state on devices, the data iterator, the step, and the
    checkpoint step it resumed from (None for a fresh run)."""

    state: state_lib.TrainState
    iterator: grain.DatasetIterator
    step: int
    resumed_from: int | None


def lead_first(make, name: str):
    """`make()` on the lead process first, then on every other one after a barrier.

    For what the lead writes into a shared directory and the others then find there: with
    `make` = "load it, preparing it if missing", the lead prepares and the others load, so
    no two processes ever write the same files. One process: just `make()`.
    """
    if jax.process_count() == 1:
        return make()
    from jax.experimental import multihost_utils
    result = make() if jax.process_index() == 0 else None
    multihost_utils.sync_global_devices(name)
    return result if jax.process_index() == 0 else make()


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


def load_dataset(config) -> data_lib.Dataset:
    """The config's dataset, prepared once (by the lead process) and opened."""
    files = tuple(p for p in config.data_files.split(",") if p)
    return lead_first(lambda: data_lib.load_dataset(
        config.dataset, config.data_dir or None, data_files=files,
        reverse_translation=config.reverse_translation), "dataset prepared")


def get_tokenizer(config, ds: data_lib.Dataset, workdir: str) -> data_lib.Tokenizer:
    """The run's tokenizer: reloaded from `workdir/tokenizer`, or made and saved there (by
    the lead process; the others load that one, so all encode with the same pieces). Made
    means: `init_from`'s own tokenizer, or a byte tokenizer, or sentencepiece trained on the
    training split. For an encoder-only preset ours get a mask token and wrap each text in
    `<s> ... </s>` (`add_special_tokens`), as BERT's [CLS] ... [SEP]."""
    path = os.path.join(workdir, "tokenizer")
    encoder = (not config.init_from
               and models.get_config(config.model).architecture == "encoder_only")

    def load_or_build() -> data_lib.Tokenizer:
        # Written whole (a temporary directory renamed into place), so a kill never leaves
        # a half-saved tokenizer that a later run would load.
        saved = data_lib.load_tokenizer(path, missing_ok=True)
        if saved is not None:
            return saved
        if config.init_from:
            tok = data_lib.load_tokenizer(config.init_from, missing_ok=True)
            if tok is None:
                raise UserError(f"init_from={config.init_from!r} has no tokenizer files; "
                                 "fine-tuning on text needs the model's own tokenizer")
        elif config.tokenizer == "byte":
            tok = data_lib.ByteTokenizer(mask=encoder, add_bos=encoder, add_eos=encoder)
        elif config.tokenizer == "sentencepiece":
            n = min(len(ds.split("train")), 500_000)
            sides = 1 if ds.kind == "classification" else len(ds.keys)   # not labels
            texts = (t for ex in ds.examples("train", range(n)) for t in ex[:sides])
            tok = data_lib.train_sentencepiece(texts, config.vocab_size,
                                               model_type=config.spm_model_type, mask=encoder)
            if encoder:
                tok = tok.with_specials(add_bos=True, add_eos=True)
        else:
            raise UserError(
                f"tokenizer={config.tokenizer!r} must be 'sentencepiece' or 'byte'")
        workdir_lib.write_dir(path, tok.save)
        return tok

    return lead_first(load_or_build, "tokenizer saved")


def pipeline_config(config, eval_: bool = False,
                    model: models.TransformerConfig | None = None) -> data_lib.PipelineConfig:
    """How the run batches its data; an encoder-only `model` reads sentences (its
    tokenizer's template) and fixes the class order (its label names)."""
    encoder = model is not None and model.architecture == "encoder_only"
    return data_lib.PipelineConfig(
        text_role="sentence" if encoder else "text",
        label_names=model.label_names if encoder else (),
        per_device_batch_size=(config.eval_per_device_batch_size if eval_
                               else config.per_device_batch_size),
        max_source_length=config.max_source_length, max_target_length=config.max_target_length,
        packing=config.packing and not eval_, overlong=config.overlong, seed=config.seed,
        worker_count=0 if eval_ else config.data_workers)


def start_run(config, workdir: str) -> tuple[Run, Start]:
    """Sets up a run in `workdir`, resuming from its newest readable checkpoint if any.

    The returned `Run` holds this process's lock on the workdir; release it (`run.lock`)
    when the run ends. If setting up fails, the lock is released here.

    Raises:
        WorkdirError: the workdir (or a path the run writes in it) cannot be written.
        WorkdirInUse: another live run holds the workdir.
        CheckpointError: checkpoints exist but none is usable, or they are another
            model's.
    """
    check_config(config)
    maybe_initialize_distributed(config)
    lock = workdir_lib.claim(workdir, jax.process_index())
    try:
        return _start_run(config, workdir, lock)
    except BaseException:
        lock.release()
        raise


def _start_run(config, workdir: str, lock: workdir_lib.Lock) -> tuple[Run, Start]:
    lead = jax.process_index() == 0
    ds = load_dataset(config)
    tok = get_tokenizer(config, ds, workdir)
    choice = choose_model(config, tok.vocab_size, ds.kind, ds.label_names)
    mcfg = choice.config
    objective = step_lib.objective_for(mcfg, tok, masking_of(config))
    if objective.kind == "next_token" and mcfg.bos_id is None:
        raise UserError(f"model {config.init_from or config.model!r} has no start token "
                         "(bos_id), which teacher forcing puts first in every sequence")
    model = models.build(mcfg)
    pcfg = pipeline_config(config, model=mcfg)
    source, stats = data_lib.train_source(ds, tok, pcfg, cache_dir=os.path.join(workdir, "cache"))
    eval_batches, eval_stats = data_lib.eval_batches(
        ds, tok, pipeline_config(config, eval_=True, model=mcfg), config.eval_split)
    if lead:
        bad = f"; {ds.bad_lines.summary()}" if ds.bad_lines.total else ""
        print(f"data: {config.dataset} train {stats.summary()}; {config.eval_split} "
              f"{eval_stats.summary()}{bad}", flush=True)

    tx, schedule = state_lib.make_optimizer(config)
    first = jax.tree.map(lambda x: x[0], source[0])
    init_args = ((first["inputs"], first["targets"]) if mcfg.is_encoder_decoder
                 else (first["inputs"],) if objective.kind == "classify"
                 else (first["targets"],))
    init_method = "classify" if objective.kind == "classify" else None

    def init():
        return model.init(jax.random.key(config.seed), *init_args, method=init_method)["params"]

    heads = set(jax.eval_shape(init))

    def fresh_state(init_params=None):
        params = init_params
        if params is None or set(params) != heads:      # a head of its own (see _head_change)
            params = {**init(), **{k: v for k, v in (params or {}).items() if k in heads}}
        return state_lib.TrainState.create(params, tx, config.seed)

    dp = _wrapper(config, model, objective, schedule, tx, jax.eval_shape(fresh_state))
    mngr = checkpoint.manager(workdir, config.keep_checkpoints)
    iterator = data_lib.train_iterator(source, pcfg)
    template = jax.eval_shape(fresh_state)
    if dp.kind == "sharded":    # restored straight into its shards
        template = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), template,
            dp.state_shardings)
    restored = checkpoint.restore_latest(mngr, template, set_aside=lead)
    resumed_from = None
    record = data_lib.data_record(ds, tok)
    if restored is not None:
        resumed_from, state = restored.step, restored.state
        iterator.set_state(restored.data)
        saved = restored.config.get("data") if isinstance(restored.config, dict) else None
        changes = data_lib.data_changes(saved, record) if saved else []
        if lead and changes:
            print(f"warning: the data differ from those of the checkpoint at step "
                  f"{resumed_from}: " + "; ".join(changes), flush=True)
        if lead:
            print(f"resumed from step {resumed_from}", flush=True)
    elif config.init_from:
        mesh = dp.mesh if dp.kind == "sharded" else None
        loaded = models.load(config.init_from, mesh=mesh, rules=_rules(config),
                             **_runtime(mcfg)).params
        state = dp.init(fresh_state, loaded) if dp.kind == "sharded" else jax.jit(
            fresh_state)(loaded)
        if lead:
            print(f"initialised from {config.init_from} ({choice.model_type})", flush=True)
            new, unused = _head_change(heads, loaded)
            if new or unused:
                print(f"warning: {config.init_from}'s {', '.join(unused) or 'model'} is not "
                      f"used; {', '.join(new)} newly initialised for {mcfg.num_labels} "
                      f"labels {list(mcfg.label_names)[:10]}", flush=True)
    elif dp.kind == "sharded":
        state = dp.init(fresh_state)            # made straight into its shards
    else:
        state = jax.jit(fresh_state)()

    step = int(resumed_from or 0)
    state = dp.put_state(state)
    # Opened last, so a failure above leaves no file or writer thread open. Rows and events
    # past the step the run goes on from are dropped: each step once.
    writer = MetricWriter(workdir, lead, resume_step=step)
    run = Run(config=config, workdir=workdir, lead=lead, dataset=ds, tokenizer=tok, model=model,
              choice=choice, data_record=record, eval_batches=eval_batches, dp=dp, writer=writer,
              checkpoints=mngr, lock=lock)
    return run, Start(state, iterator, step, resumed_from)


def _rules(config) -> tuple:
    return tuple(config.logical_axis_rules) or models.axes.DEFAULT_RULES


def _wrapper(config, model, objective, schedule, tx, abstract):
    """The steps' wrapper the config asks for: data parallel (pmap, shard_map), or sharded
    over the config's mesh with the state's shardings derived from its logical axes.

    Raises:
        UserError: a mesh that does not match the device count, or attention heads that
            do not divide the tensor axis (naming the numbers).
    """
    if config.parallel != "sharded":
        train_fn, eval_fn = step_lib.make_steps(model, config, schedule, objective)
        return parallel.DataParallel(config.parallel, train_fn, eval_fn)
    mesh = sharding.make_mesh(config.mesh_shape)
    rules = sharding.check_rules(_rules(config))
    dp = sharding.for_model(model, config, schedule, tx, mesh, rules, objective, config.seed)
    whole = sharding.undivided(dp.specs.params, abstract.params, mesh, rules)
    if whole and jax.process_index() == 0:
        print(f"mesh {dict(mesh.shape)}: {len(whole)} parameter(s) kept whole along a "
              f"dimension that does not divide its axes: " + "; ".join(whole[:4])
              + (" ..." if len(whole) > 4 else ""), flush=True)
    return dp


def masking_of(config) -> Masking:
    """The masked-LM corruption the config asks for (`mlm_rate`, `mlm_mask_fraction`,
    `mlm_random_fraction`)."""
    return Masking(config.mlm_rate, config.mlm_mask_fraction, config.mlm_random_fraction)


def _head_change(heads: set[str], loaded: dict) -> tuple[list[str], list[str]]:
    """(parts the run initialises anew, loaded parts it drops): a masked-LM checkpoint
    fine-tuned to classify trades `mlm_head` for `classifier`."""
    return sorted(heads - set(loaded)), sorted(set(loaded) - heads)


def _runtime(config: models.TransformerConfig) -> dict:
    """The fields of `config` that `models.load` takes (how to run, not what)."""
    return {k: getattr(config, k) for k in models.pretrained.RUNTIME_FIELDS}
