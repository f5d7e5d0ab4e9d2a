"""Everything a run fixes before its first step: processes, data, tokenizer, model, state.

    run, start = start_run(config, workdir)   # config: an ml_collections.ConfigDict
    run.config.loop, run.model, run.objective, run.wrapper ...   # fixed for the whole run
    start.state, start.iterator, start.step    # where the loop begins (resumed or fresh)

The config is read once, here (`train.run_config.RunConfig`), and each piece gets the part
it reads: the dataset and tokenizer `run.config.data`, the model `run.config.model`, the
objective (`train.objectives.fit`: chosen by the model and the dataset's kind)
`run.config.objective`, the optimiser `run.config.optimizer`, the wrapper
(`make_wrapper`: pmap, shard_map or sharded, all behind `train.wrapper.Wrapper`)
`run.config.parallel`.

Before anything else, every process locks the workdir (`train.workdir.claim`: one run per
workdir, and a workdir that cannot be written is found in seconds, naming the path).
With several processes sharing a workdir, whatever is written there once (the prepared
dataset, the tokenizer) is made by the lead process first, then read by the others
(`lead_first`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import flax.linen as nn
import grain
import jax
import orbax.checkpoint as ocp

import models
from models.errors import UserError
from models.pretrained.generation import GenerationDefaults
from train import (
    checkpoint,
    data as data_lib,
    integrity,
    parallel,
    sharding,
    state as state_lib,
    workdir as workdir_lib,
)
from train.config_checks import fail
from train.export import write_outputs
from train.metrics import MetricWriter
from train.model_config import ModelChoice, choose_model
from train.objectives import Objective, fit
from train.run_config import RunConfig
from train.settings import DataSettings, HostSettings, ModelSettings, ParallelSettings
from train.step import Steps
from train.wrapper import Wrapper


@dataclasses.dataclass(frozen=True)
class Run:
    """What a run fixes at its start; the loop only reads it.

    Attributes:
        config: the run config's typed parts (`train.run_config.RunConfig`).
        workdir: the run directory.
        lead: this is process 0 (it prints, writes metrics and the summary).
        dataset, tokenizer, model: the data, its tokenizer and the model built for them.
        choice: the model's config and, fine-tuning, the directory's type and defaults.
        objective: what the run trains the model to do (`train.objectives`).
        data_record: what the data are (`train.data.data_record`), kept in checkpoints.
        eval_pipeline: how evaluation batches are made (one example per row, no workers).
        eval_batches: the validation batches, the same on every evaluation.
        wrapper: where the train and eval steps run (`train.wrapper.Wrapper`).
        writer: metrics.jsonl and TensorBoard (inert on the other processes).
        checkpoints: the orbax checkpoint manager of `workdir/checkpoints`.
        lock: this process's lock on the workdir (`release()` it when the run ends).
    """

    config: RunConfig
    workdir: str
    lead: bool
    dataset: data_lib.Dataset
    tokenizer: data_lib.Tokenizer
    model: nn.Module
    choice: ModelChoice
    objective: Objective
    data_record: dict
    eval_pipeline: data_lib.PipelineConfig
    eval_batches: list[dict]
    wrapper: Wrapper
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
        item = checkpoint.config_item(json.loads(self.config.experiment), self.choice,
                                      self.data_record)
        checkpoint.save(self.checkpoints, step, self.wrapper.saved_state(state),
                        iterator.get_state(), item, tok=self.tokenizer)

    def export(self, state) -> str | None:
        """The model as a directory, WORKDIR/model, or an adapted model's adapters as
        WORKDIR/adapter (`train.export.write_outputs`; written by the lead process, every
        process gathers the params, a collective when they are sharded)."""
        params = self.wrapper.host_state(state).model_params
        if not self.lead:
            return None
        model = self.config.model
        return write_outputs(self.workdir, self.choice.config, params, self.tokenizer,
                             model_type=self.choice.model_type,
                             generation=self.choice.generation, base=model.init_from,
                             merged=model.lora.export_merged)


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


def maybe_initialize_distributed(hosts: HostSettings) -> None:
    """`jax.distributed.initialize()` when `hosts.distributed`: with `coordinator_address`
    (host:port of process 0), `num_processes` and `process_id` as given; without it, as the
    cluster says (TPU pods, SLURM, Open MPI and Kubernetes are detected by JAX)."""
    if not hosts.distributed or jax.distributed.is_initialized():
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")   # CPU-only runs
    if hosts.coordinator_address:
        jax.distributed.initialize(coordinator_address=hosts.coordinator_address,
                                   num_processes=hosts.num_processes,
                                   process_id=hosts.process_id)
    else:
        jax.distributed.initialize()


def load_dataset(data: DataSettings) -> data_lib.Dataset:
    """The run's dataset, prepared once (by the lead process) and opened."""
    return lead_first(lambda: data_lib.load_dataset(
        data.dataset, data.data_dir or None, data_files=data.files,
        reverse_translation=data.reverse_translation), "dataset prepared")


def get_tokenizer(model: ModelSettings, data: DataSettings, ds: data_lib.Dataset,
                  workdir: str) -> data_lib.Tokenizer:
    """The run's tokenizer: reloaded from `workdir/tokenizer`, or made and saved there (by
    the lead process; the others load that one, so all encode with the same pieces). Made
    means: `init_from`'s own tokenizer, or `tokenizer_from`'s, or a byte tokenizer, or
    sentencepiece trained on the training split's texts. For an encoder-only preset ours
    get a mask token and wrap each text in `<s> ... </s>` (`add_special_tokens`), as BERT's
    [CLS] ... [SEP]."""
    path = os.path.join(workdir, "tokenizer")
    encoder = (not model.init_from
               and models.get_config(model.model).architecture == "encoder_only")

    def load_or_build() -> data_lib.Tokenizer:
        # Written whole (a temporary directory renamed into place), so a kill never leaves
        # a half-saved tokenizer that a later run would load.
        saved = data_lib.load_tokenizer(path, missing_ok=True)
        if saved is not None:
            return saved
        taken = taken_from(model, data)
        if taken:
            tok = data_lib.load_tokenizer(taken, missing_ok=True)
            if tok is None:
                key = "init_from" if model.init_from else "tokenizer_from"
                raise UserError(f"{key}={taken!r} has no tokenizer files; the run needs that "
                                "model's own tokenizer")
            tok = _with_languages(tok, data, taken)
        elif data.tokenizer == "byte":
            tok = data_lib.ByteTokenizer(mask=encoder, add_bos=encoder, add_eos=encoder)
        else:
            n = min(len(ds.split("train")), 500_000)
            # An example's fields are texts, but for a classification example's last one,
            # its label (the dataset has label names then).
            texts_per_example = len(ds.data_kind.sides)
            texts = (t for ex in ds.examples("train", range(n))
                     for t in ex[:texts_per_example])
            tok = data_lib.train_sentencepiece(texts, data.vocab_size,
                                               model_type=data.spm_model_type, mask=encoder)
            if encoder:
                tok = tok.with_specials(add_bos=True, add_eos=True)
        workdir_lib.write_dir(path, tok.save)
        return tok

    if (data.source_lang or data.target_lang) and not taken_from(model, data):
        key = "source_lang" if data.source_lang else "target_lang"
        raise fail(key, getattr(data, key), "names a language of a translation model's "
                   "tokenizer: set init_from (or tokenizer_from) to its directory")
    return lead_first(load_or_build, "tokenizer saved")


def taken_from(model: ModelSettings, data: DataSettings) -> str:
    """The model directory whose tokenizer the run takes ("": none)."""
    return model.init_from or data.tokenizer_from


def _with_languages(tok, data: DataSettings, directory: str):
    """`tok` encoding with `source_lang` / `target_lang` (`HFTokenizer.for_languages`)."""
    if not (data.source_lang or data.target_lang):
        return tok
    for key in ("source_lang", "target_lang"):
        code = getattr(data, key)
        if code and not getattr(tok, "languages", None):
            raise fail(key, code, f"needs a tokenizer with language codes; {directory!r}'s "
                       "names none")
        if code and code not in tok.languages:
            raise fail(key, code, f"is not one of the {len(tok.languages)} languages of "
                       f"{directory!r}'s tokenizer ({', '.join(sorted(tok.languages)[:6])}, "
                       "...)")
    return tok.for_languages(data.source_lang or None, data.target_lang or None)


def pipeline_config(settings: RunConfig, objective: Objective | None = None, *,
                    eval_: bool = False) -> data_lib.PipelineConfig:
    """How the run batches its data (`settings.data`, `.batch` and the seed), with what the
    objective fixes (the text role, the class order); evaluation: one example per row and
    no worker processes."""
    data, batch = settings.data, settings.batch
    return data_lib.PipelineConfig(
        per_device_batch_size=(batch.eval_per_device_batch_size if eval_
                               else batch.per_device_batch_size),
        max_source_length=data.max_source_length, max_target_length=data.max_target_length,
        packing=data.packing and not eval_, overlong=data.overlong, seed=settings.loop.seed,
        worker_count=0 if eval_ else data.data_workers,
        **(objective.pipeline_options() if objective is not None else {}))


def make_wrapper(settings: ParallelSettings, steps: Steps, tx, *, seed: int,
                 base_dtype=None, reference: bool = False) -> Wrapper:
    """The wrapper `settings.parallel` names: data parallel (pmap, shard_map), or sharded
    over `settings.mesh_shape` with the state's shardings derived from its logical axes
    (`tx`, `seed`, an adapted model's `base_dtype` and `reference`, a kept copy of the
    model, make the state whose shardings those are).

    Raises:
        UserError: a mesh that does not match the device count, or attention heads that
            do not divide the tensor axis (naming the numbers).
    """
    if settings.parallel != "sharded":
        return parallel.DataParallel(settings.parallel, *steps.functions())
    return sharding.for_model(steps, tx, mesh=sharding.make_mesh(settings.mesh_shape,
                                                                 expert=settings.mesh_expert),
                              rules=sharding.check_rules(settings.rules), seed=seed,
                              base_dtype=base_dtype, reference=reference)


def start_run(config, workdir: str) -> tuple[Run, Start]:
    """Sets up a run of `config` (an `ml_collections.ConfigDict`) in `workdir`, resuming
    from its newest readable checkpoint if any.

    The returned `Run` holds this process's lock on the workdir; release it (`run.lock`)
    when the run ends. If setting up fails, the lock is released here.

    Raises:
        UserError: a config value that breaks its rule (before any other work).
        WorkdirError: the workdir (or a path the run writes in it) cannot be written.
        WorkdirInUse: another live run holds the workdir.
        CheckpointError: checkpoints exist but none is usable, or they are another
            model's.
    """
    settings = RunConfig.from_config(config)
    maybe_initialize_distributed(settings.hosts)
    lock = workdir_lib.claim(workdir, jax.process_index())
    try:
        return _start_run(settings, workdir, lock)
    except BaseException:
        lock.release()
        raise


def _start_run(settings: RunConfig, workdir: str, lock: workdir_lib.Lock
               ) -> tuple[Run, Start]:
    lead = jax.process_index() == 0
    ds = load_dataset(settings.data)
    tok = get_tokenizer(settings.model, settings.data, ds, workdir)
    choice = choose_model(settings.model, tok.vocab_size, max_len=settings.needed_max_len)
    if settings.data.target_lang:     # the target language's token first, as generate forces
        choice = dataclasses.replace(choice, generation=dataclasses.replace(
            choice.generation or GenerationDefaults(),
            forced_bos_id=tok.language_id(settings.data.target_lang)))
    chat_template = _chat_template(settings, ds)
    if chat_template is not None and settings.objective.chat_template:
        tok.hf.chat_template = chat_template.source     # so the export carries it
    mcfg, objective = fit(choice.config, ds, tok, settings.objective,
                          model_name=settings.model.name, generation=choice.generation,
                          chat_template=chat_template)
    choice = dataclasses.replace(choice, config=mcfg)
    model = models.build(mcfg)
    pcfg, eval_pcfg = (pipeline_config(settings, objective, eval_=e) for e in (False, True))
    source, stats = data_lib.train_source(ds, tok, pcfg,
                                          cache_dir=os.path.join(workdir, "cache"))
    eval_batches, eval_stats = data_lib.eval_batches(ds, tok, eval_pcfg,
                                                     settings.data.eval_split)
    if lead:
        bad = f"; {ds.bad_lines.summary()}" if ds.bad_lines.total else ""
        print(f"data: {settings.data.dataset} train {stats.summary()}; "
              f"{settings.data.eval_split} {eval_stats.summary()}{bad}", flush=True)

    tx, schedule = state_lib.make_optimizer(settings.optimizer, settings.loop.num_train_steps,
                                            frozen=_frozen_parts(settings))
    init_args, init_method = objective.init_inputs(jax.tree.map(lambda x: x[0], source[0]))
    seed = settings.loop.seed

    def init():
        return model.init(jax.random.key(seed), *init_args, method=init_method)["params"]

    heads = set(jax.eval_shape(init))
    base_dtype = settings.model.lora.base_dtype if mcfg.lora is not None else None
    quantize_base = _base_quantizer(settings, mcfg)

    def fresh_state(init_params=None):
        # The loaded parts replace the initialised ones (under jit, the replaced ones are
        # never computed); a head of its own stays initialised (see _head_change), and so
        # do an adapted model's adapters.
        base, adapters = models.lora.split(init())
        base.update({k: v for k, v in (init_params or {}).items() if k in heads})
        return state_lib.TrainState.create(models.lora.join(base, adapters), tx, seed,
                                           base_dtype=base_dtype,
                                           quantize_base=quantize_base,
                                           reference=objective.needs_reference_copy)

    steps = Steps(model, objective, schedule, settings.optimizer.grad_accum_steps)
    wrapper = make_wrapper(settings.parallel, steps, tx, seed=seed, base_dtype=base_dtype,
                           reference=objective.needs_reference_copy)
    if lead:
        for line in wrapper.notes():
            print(line, flush=True)
        if quantize_base is not None:
            lora = settings.model.lora
            print(f"the frozen base's projections are {lora.base_quant}"
                  + (f" (groups of {lora.base_quant_group})" if lora.base_quant == "int4"
                     else "") + "; the adapters train in float", flush=True)
    mngr = checkpoint.manager(workdir, settings.checkpoints.keep_checkpoints)
    iterator = data_lib.train_iterator(source, pcfg)
    template = wrapper.restore_template(jax.eval_shape(fresh_state))
    restored = checkpoint.restore_latest(mngr, template, set_aside=lead)
    resumed_from = None
    record = data_lib.data_record(ds, tok)
    init_from = settings.model.init_from
    if restored is not None:
        resumed_from = restored.step
        state = restored.state
        if mcfg.lora is not None:        # checkpoints hold the adapters, not the base
            base = wrapper.load_params(init_from, **_runtime(mcfg, base_dtype))
            frozen = models.lora.split(base)[0]
            state = state.replace(frozen=frozen if quantize_base is None
                                  else jax.jit(quantize_base)(frozen))
        elif objective.needs_reference_copy:     # nor the reference: the run's start again
            start = (wrapper.load_params(init_from, **_runtime(mcfg, base_dtype))
                     if init_from else None)
            state = state.replace(reference=jax.jit(
                lambda loaded: fresh_state(loaded).reference)(start))
        state = wrapper.put_state(state)
        iterator.set_state(restored.data)
        saved = restored.config.get("data") if isinstance(restored.config, dict) else None
        changes = data_lib.data_changes(saved, record) if saved else []
        if lead and changes:
            print(f"warning: the data differ from those of the checkpoint at step "
                  f"{resumed_from}: " + "; ".join(changes), flush=True)
        if lead:
            print(f"resumed from step {resumed_from}", flush=True)
    elif init_from:
        loaded = wrapper.load_params(init_from, **_runtime(mcfg, base_dtype))
        new, unused = _head_change(heads, loaded)
        if new and mcfg.lora is not None:
            raise UserError(f"lora.rank={mcfg.lora.rank} trains adapters over {init_from}'s "
                            f"weights, which hold no {', '.join(new)} for "
                            f"{mcfg.num_labels} labels: an adapter exported in PEFT's "
                            "format would lose that new head. Fine-tune without lora first "
                            "(or start from a directory with this head)")
        state = wrapper.init_state(fresh_state, loaded)
        if lead:
            print(f"initialised from {init_from} ({choice.model_type})", flush=True)
            if new or unused:
                print(f"warning: {init_from}'s {', '.join(unused) or 'model'} is not "
                      f"used; {', '.join(new)} newly initialised for {mcfg.num_labels} "
                      f"labels {list(mcfg.label_names)[:10]}", flush=True)
    else:
        state = wrapper.init_state(fresh_state)

    step = int(resumed_from or 0)
    # Opened last, so a failure above leaves no file or writer thread open. Rows and events
    # past the step the run goes on from are dropped: each step once.
    writer = MetricWriter(workdir, lead, resume_step=step)
    run = Run(config=settings, workdir=workdir, lead=lead, dataset=ds, tokenizer=tok,
              model=model, choice=choice, objective=objective, data_record=record,
              eval_pipeline=eval_pcfg, eval_batches=eval_batches, wrapper=wrapper,
              writer=writer, checkpoints=mngr, lock=lock)
    return run, Start(state, iterator, step, resumed_from)


def _chat_template(settings: RunConfig, ds):
    """Chat data's template: `chat_template`'s file, or the model directory's own (the
    tokenizer's directory: `tokenizer_from`, else `init_from`); None for other data or
    without one (the objective then refuses by name)."""
    from models.chat import ChatTemplate
    from train.data import kinds
    if not any(r.chat for r in kinds.get(ds.kind).roles()):
        return None
    directory = settings.data.tokenizer_from or settings.model.init_from
    if not directory:
        if settings.objective.chat_template:
            raise fail("chat_template", settings.objective.chat_template, "renders "
                       "conversations for a model directory's tokenizer: set init_from")
        return None
    return ChatTemplate.from_directory(directory, settings.objective.chat_template)


def _frozen_parts(settings: RunConfig) -> tuple[str, ...]:
    """The top-level parameters that never train: a Whisper's encoder with
    `freeze_encoder` (`train.objectives.speech`)."""
    from train.objectives.speech import ENCODER_PARTS
    return ENCODER_PARTS if settings.objective.freeze_encoder else ()


def _head_change(heads: set[str], loaded: dict) -> tuple[list[str], list[str]]:
    """(parts the run initialises anew, loaded parts it drops): a masked-LM checkpoint
    fine-tuned to classify trades `mlm_head` for `classifier`."""
    return sorted(heads - set(loaded)), sorted(set(loaded) - heads)


def _base_quantizer(settings: RunConfig, config: models.TransformerConfig):
    """`lora.base_quant`'s quantizer of the frozen base (None: not quantized).

    Raises:
        UserError: base_quant on a sharded mesh, whose state shardings come from the float
            params' logical axes (data-parallel runs, pmap and shard_map, take it).
    """
    lora = settings.model.lora
    if config.lora is None or lora.base_quant == "none":
        return None
    if settings.parallel.parallel == "sharded":
        raise fail("lora.base_quant", lora.base_quant, "trains over data-parallel devices "
                   "(parallel=pmap or shard_map); a sharded mesh keeps the base in "
                   "lora.base_dtype")
    return functools.partial(models.quantize, config_or_scheme=config.replace(lora=None),
                             scheme=lora.base_quant, group=lora.base_quant_group)


def _runtime(config: models.TransformerConfig, base_dtype=None) -> dict:
    """The fields of `config` that `models.load` takes (how to run, not what); an adapted
    model's base is read straight into `base_dtype`."""
    runtime = {k: getattr(config, k) for k in models.pretrained.RUNTIME_FIELDS}
    return runtime if base_dtype is None else {**runtime, "param_dtype": base_dtype}
