"""orbax checkpoints: parameters, optimiser state, data position, config and tokenizer.

One checkpoint is a step directory with separate items, so decoding can restore the
parameters alone (on CPU, without building an optimiser):

    params     the model parameters (plain arrays, never replicated)
    train      {"step", "opt_state", "rng"}
    data       the grain iterator state (JSON)
    config     {"experiment", "model", "model_type", "generation"} (JSON): the experiment
               config, the model's TransformerConfig, and where a fine-tuned model came from
    tokenizer  {"files": the tokenizer's files, base64} (JSON)

Every step directory also holds `integrity.json` (`train.integrity`), written last: the size
and sha256 of each file. A step whose files differ from it, or whose save did not finish, is
set aside on restore and the previous one used. Steps written before manifests existed have
none and say so in their orbax step metadata (no `integrity_manifest` entry in
`custom_metadata`): they restore unchecked. With several processes, all of them restore the
newest step every one of them can read (`restore_latest`; the checks and the agreement are
in `train.checkpoint_steps`).

`restore_model` gives what an export needs (`train.export` writes it as a model directory,
the one form decoding reads).
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import os
import tempfile

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from models import atomic
from models.config import TransformerConfig
from models.errors import UserError
from models.pretrained import GenerationDefaults
from models.tokenizer import ByteTokenizer, SentencePieceTokenizer, Tokenizer, load_tokenizer
from train import checkpoint_steps as steps_lib, integrity
from train.checkpoint_steps import CheckpointError, step_dir
from train.model_config import ModelChoice
from train.state import TrainState
from train.workdir import WorkdirError, check_dir_writable

log = logging.getLogger(__name__)

ITEMS = ("params", "train", "data", "config", "tokenizer")


def _handlers(names=ITEMS) -> dict:
    """orbax handlers by item name: a manager given them can read each item's metadata
    (array shapes) before restoring anything."""
    return {name: (ocp.StandardCheckpointHandler() if name in ("params", "train")
                   else ocp.JsonCheckpointHandler()) for name in names}


def manager(workdir: str, keep: int = 3) -> ocp.CheckpointManager:
    """The run's checkpoint manager. Saves are synchronous: the loop waits for every save
    anyway, and a failing write then raises at once (asynchronous saves to a read-only
    directory wait five minutes for a signal that never comes)."""
    return ocp.CheckpointManager(
        os.path.abspath(os.path.join(workdir, "checkpoints")),
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                             enable_async_checkpointing=False),
        item_handlers=_handlers())


def tokenizer_json(tok: Tokenizer) -> dict:
    """The tokenizer's files, base64-encoded, as one JSON item."""
    with tempfile.TemporaryDirectory() as d:
        tok.save(d)
        files = {}
        for name in sorted(os.listdir(d)):
            with open(os.path.join(d, name), "rb") as f:
                files[name] = base64.b64encode(f.read()).decode()
    return {"files": files}


def tokenizer_from_json(item: dict) -> Tokenizer:
    """The tokenizer a checkpoint's item holds: its files (`tokenizer_json`), or the
    format without files, `{"kind": "byte"}` or `{"kind": ..., "model_b64": ...}` (a
    sentencepiece model), written before tokenizers were saved in the Hugging Face layout."""
    if "files" not in item:
        if item["kind"] == ByteTokenizer.kind:
            return ByteTokenizer()
        return SentencePieceTokenizer(base64.b64decode(item["model_b64"]))
    with tempfile.TemporaryDirectory() as d:
        for name, data in item["files"].items():
            if os.path.basename(name) != name:
                raise UserError(f"checkpoint tokenizer file name {name!r} is not a file name")
            with open(os.path.join(d, name), "wb") as f:
                f.write(base64.b64decode(data))
        return load_tokenizer(d)


def save(mngr: ocp.CheckpointManager, step: int, host_state, data_state: dict, config: dict,
         *, tok: Tokenizer) -> None:
    """Saves a checkpoint, then (on the lead process) its integrity manifest, last.

    A kill at any moment leaves a whole checkpoint with its manifest, or orbax's unfinished
    temporary directory (which no restore looks at), or a finished step without the
    manifest its step metadata promises (which restoring sets aside).

    Raises:
        WorkdirError: naming the checkpoint directory when it cannot be written (found by a
            probe before orbax starts, or raised by the write itself: a full disk).
    """
    directory = str(mngr.directory)
    check_dir_writable(directory)
    train = {"step": _saved(host_state.step), "opt_state": host_state.opt_state,
             "rng": _saved(host_state.rng)}
    try:
        mngr.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(host_state.params), train=ocp.args.StandardSave(train),
            data=ocp.args.JsonSave(data_state), config=ocp.args.JsonSave(config),
            tokenizer=ocp.args.JsonSave(tokenizer_json(tok))), force=True,
            custom_metadata={steps_lib.PROMISE: integrity.MANIFEST})
        mngr.wait_until_finished()
    except (OSError, ValueError) as e:
        if isinstance(e, ValueError) and not _is_storage_error(e):
            raise
        reason = e.strerror if isinstance(e, OSError) and e.strerror else steps_lib.brief(e)
        raise WorkdirError(f"cannot save the checkpoint of step {step} in {directory}: "
                           f"{reason}") from e
    if jax.process_index() == 0:
        atomic.write_manifest(step_dir(mngr, step), integrity.MANIFEST)


def _saved(x):
    """A host value as a numpy array; a (sharded) jax.Array as it is, for orbax."""
    return x if isinstance(x, jax.Array) else np.asarray(x)


def _is_storage_error(e: ValueError) -> bool:
    """tensorstore reports a failed write (a full disk, no permission) as a ValueError
    carrying the status and the OS error code."""
    text = str(e)
    return "os_error_code" in text or text.startswith(
        ("RESOURCE_EXHAUSTED", "PERMISSION_DENIED", "UNAVAILABLE", "DATA_LOSS"))


@dataclasses.dataclass(frozen=True)
class Restored:
    """A checkpoint as the training loop resumes from it."""

    step: int
    state: TrainState       # host arrays; the optimiser (`tx`) is the template's
    data: dict              # the data iterator's state
    config: dict            # the config item (see `config_item`)


def restore_latest(mngr: ocp.CheckpointManager, template: TrainState,
                   set_aside: bool = True) -> Restored | None:
    """The newest checkpoint every process can use, restored into `template`'s shapes
    (arrays or `jax.ShapeDtypeStruct`s, with shardings where sharded).

    A step is unusable when its manifest finds a changed or missing file, when its save did
    not finish, or when orbax cannot read it. With several processes each checks the steps
    itself and all of them restore the newest step every one can use (see
    `train.checkpoint_steps`), so every process must call this. Newer unusable steps are
    then reported (one line each, with one process's reason; the traceback is logged at
    DEBUG) and, when `set_aside` (the lead process does it), renamed to `<step>.unreadable`,
    so later saves of that step do not collide with them.

    Only when no step is usable: a step whose save was killed between orbax's atomic commit
    and its manifest (with `keep_checkpoints=1` there is no older one) is used unverified,
    as orbax committed it, and its manifest written then.

    Returns:
        A `Restored`, or None when there is no checkpoint.

    Raises:
        CheckpointError: when checkpoints exist but none is usable (naming the directory
            and each step's reason; nothing is moved, so the run never starts again from
            step 0 by itself), or when the newest usable one was written for another model
            (naming the first array of another shape, with both shapes).
    """
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=getattr(x, "sharding", None)), template)
    steps = sorted(mngr.all_steps(), reverse=True)
    if not steps_lib.any_steps(steps):
        steps_lib.note_set_aside_only(str(mngr.directory), set_aside)
        return None
    verdicts = steps_lib.Verdicts(mngr, abstract)
    for unverified_ok in (False, True):
        agreement = steps_lib.Agreement(steps, verdicts, unverified_ok)
        while (step := agreement.next()) is not None:
            try:
                restored, reason = _restore(mngr, step, abstract, template), None
            except Exception as e:       # a step every check passed that orbax cannot read
                log.debug("checkpoint at step %d in %s is unusable", step, mngr.directory,
                          exc_info=True)
                restored, reason = None, steps_lib.brief(e)
            if agreement.settle(step, reason):
                _report(mngr, step, verdicts, set_aside=set_aside, unverified=unverified_ok)
                return restored
    reasons, blind = steps_lib.shared_reasons(verdicts, -1, len(steps))
    raise CheckpointError(
        f"no usable checkpoint in {mngr.directory}: "
        + "; ".join(f"step {s}: {reason}" for s, reason in reasons.items())
        + "".join(f"; process {p} sees no checkpoint there" for p in blind)
        + ". Nothing was moved: to start again from step 0, move these steps away (or use "
        "another workdir)")


def _restore(mngr: ocp.CheckpointManager, step: int, abstract, template: TrainState
             ) -> Restored:
    train_target = {"step": abstract.step, "opt_state": abstract.opt_state,
                    "rng": abstract.rng}
    got = mngr.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract.params),
        train=ocp.args.StandardRestore(train_target), data=ocp.args.JsonRestore(),
        config=ocp.args.JsonRestore()))
    return Restored(step, template.replace(params=got.params, **got.train), got.data,
                    got.config)


def _report(mngr: ocp.CheckpointManager, step: int, verdicts: steps_lib.Verdicts, *,
            set_aside: bool, unverified: bool) -> None:
    """After every process restored `step`: the lead sets aside each newer step (naming
    one process's reason) or, for a step used unverified, writes its manifest; then every
    process sees the same steps."""
    if unverified:
        if set_aside and step in verdicts.unfinished:
            atomic.write_manifest(step_dir(mngr, step), integrity.MANIFEST)
            print(f"checkpoint at step {step} has no {integrity.MANIFEST} (the run stopped "
                  "right after writing it) and no older one is usable: using it as orbax "
                  "committed it, and writing its manifest now", flush=True)
        return
    reasons, _ = steps_lib.shared_reasons(verdicts, step, len(mngr.all_steps()))
    for bad in sorted((s for s in mngr.all_steps() if s > step), reverse=True):
        if set_aside:
            moved = steps_lib.set_aside(mngr, bad)
            print(f"checkpoint at step {bad} is unreadable "
                  f"({reasons.get(bad, 'not every process sees it')}); moved it to {moved}; "
                  f"using step {step}", flush=True)
    steps_lib.sync("checkpoint-steps-set-aside")
    if not set_aside:
        mngr.reload()


@dataclasses.dataclass(frozen=True)
class SavedModel:
    """A checkpoint's model, as an export needs it (parameters as host arrays)."""

    params: dict
    config: TransformerConfig
    tokenizer: Tokenizer
    step: int
    model_type: str | None
    generation: GenerationDefaults | None
    experiment: dict


def config_item(experiment: dict, choice: ModelChoice, data: dict | None = None) -> dict:
    """The checkpoint's "config" item: the experiment, the model (and where a fine-tuned
    one came from), and what the data were (`train.data.data_record`)."""
    generation = choice.generation
    return {"experiment": experiment, "model": choice.config.to_dict(),
            "model_type": choice.model_type,
            "generation": None if generation is None else {
                "eos_ids": generation.eos_ids, "start_id": generation.start_id,
                "raw": generation.raw},
            "data": data}


def _generation(saved: dict | None, config: TransformerConfig) -> GenerationDefaults | None:
    """The decoding defaults a checkpoint's config item kept (`config_item`), parsed again
    from the directory's fields as `models.load` parsed them; its end and start ids stand
    for config.json's (an item without "start_id" has none)."""
    if not saved:
        return None
    eos = saved.get("eos_ids")
    return GenerationDefaults.from_dict(
        saved["raw"], config.vocab_size,
        model_config={"eos_token_id": list(eos) if eos else None,
                      "decoder_start_token_id": saved.get("start_id")},
        where="the checkpoint's generation defaults")


def with_base(adapters: dict, config: TransformerConfig, experiment: dict) -> dict:
    """An adapted run's checkpointed adapters joined with the frozen weights they adapt,
    read again from the run's `init_from`."""
    import models
    base = experiment.get("init_from", "")
    if not base or not os.path.isdir(base):
        raise FileNotFoundError(f"the checkpoint holds adapters of init_from={base!r}, "
                                "which is needed to restore the model and is missing")
    runtime = {k: getattr(config, k) for k in models.pretrained.RUNTIME_FIELDS}
    loaded = jax.device_get(models.load(base, **runtime).params)
    return models.lora.join(models.lora.split(loaded)[0], adapters)


def reader(workdir: str) -> ocp.CheckpointManager:
    """A manager that reads (never writes) the checkpoints of `workdir`: their params,
    config and tokenizer items.

    Raises:
        FileNotFoundError: naming the workdir when it has no checkpoints directory.
    """
    path = os.path.abspath(os.path.join(workdir, "checkpoints"))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoints in {workdir!r} (looked for {path})")
    return ocp.CheckpointManager(
        path, options=ocp.CheckpointManagerOptions(create=False),
        item_handlers=_handlers(("params", "config", "tokenizer")))


def restore_model(workdir: str, step: int | None = None) -> SavedModel:
    """The model of a run's newest readable checkpoint (or of `step`), without optimiser
    state, on the host.

    Raises:
        FileNotFoundError: naming the workdir when it has no (readable) checkpoint, and
            what is wrong with each one it has.

    A step whose files differ from its integrity manifest counts as unreadable (nothing is
    moved here: only a training run sets steps aside).
    """
    mngr = reader(workdir)
    path = str(mngr.directory)
    steps = sorted(mngr.all_steps(), reverse=True) if step is None else [step]
    if not steps:
        raise FileNotFoundError(f"no checkpoints in {path}")
    unusable: list[tuple[int, str]] = []
    for s in steps:
        try:
            steps_lib.check_whole(mngr, s)
            # Whole numpy arrays, whatever mesh or processes wrote the shards.
            shapes = mngr.item_metadata(s)["params"]
            target = jax.tree.map(lambda m: np.empty(m.shape, m.dtype), shapes)
            got = mngr.restore(s, args=ocp.args.Composite(
                params=ocp.args.StandardRestore(target), config=ocp.args.JsonRestore(),
                tokenizer=ocp.args.JsonRestore()))
        except Exception as e:
            reason = str(e) if isinstance(e, steps_lib.Unusable) else steps_lib.brief(e)
            log.debug("checkpoint at step %d in %s is unusable", s, path, exc_info=True)
            print(f"checkpoint at step {s} is unreadable ({reason}); trying the previous one",
                  flush=True)
            unusable.append((s, reason))
            continue
        tok = tokenizer_from_json(got.tokenizer)
        item = got.config
        if "experiment" not in item:     # the older item: the experiment config alone
            from train.model_config import model_config
            item = config_item(item, ModelChoice(
                model_config(ml_collections.ConfigDict(item), tok.vocab_size)))
        config = TransformerConfig.from_dict(item["model"])
        params = got.params
        if config.lora is not None:        # the adapters: their base is init_from's
            params = with_base(params, config, item["experiment"])
        return SavedModel(params, config, tok, s, item["model_type"],
                          _generation(item["generation"], config), item["experiment"])
    raise FileNotFoundError(f"no readable checkpoint in {path}: "
                            + "; ".join(f"step {s}: {reason}" for s, reason in unusable))
