"""orbax checkpoints: parameters, optimiser state, data position, config and tokenizer.

One checkpoint is a step directory with separate items, so decoding can restore the
parameters alone (on CPU, without building an optimiser):

    params     the model parameters (plain arrays, never replicated)
    train      {"step", "opt_state", "rng"}
    data       the grain iterator state (JSON)
    config     {"experiment", "model", "model_type", "generation"} (JSON): the experiment
               config, the model's TransformerConfig, and where a fine-tuned model came from
    tokenizer  {"files": the tokenizer's files, base64} (JSON)

`restore_model` gives what an export needs (`train.export` writes it as a model directory,
the one form decoding reads).
"""

from __future__ import annotations

import base64
import dataclasses
import os
import tempfile

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from models.config import TransformerConfig
from models.pretrained import GenerationDefaults
from models.tokenizer import ByteTokenizer, SentencePieceTokenizer, Tokenizer, load_tokenizer
from train.model_config import ModelChoice
from train.state import TrainState


def manager(workdir: str, keep: int = 3) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
        os.path.abspath(os.path.join(workdir, "checkpoints")),
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
        item_names=("params", "train", "data", "config", "tokenizer"))


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
    if "files" not in item:       # checkpoints written before the Hugging Face layout
        if item["kind"] == ByteTokenizer.kind:
            return ByteTokenizer()
        return SentencePieceTokenizer(base64.b64decode(item["model_b64"]))
    with tempfile.TemporaryDirectory() as d:
        for name, data in item["files"].items():
            if os.path.basename(name) != name:
                raise ValueError(f"checkpoint tokenizer file name {name!r} is not a file name")
            with open(os.path.join(d, name), "wb") as f:
                f.write(base64.b64decode(data))
        return load_tokenizer(d)


def save(mngr: ocp.CheckpointManager, step: int, host_state, data_state: dict, config: dict,
         tok: Tokenizer) -> None:
    """Saves (synchronously finished before returning, so a kill cannot leave it half)."""
    train = {"step": np.asarray(host_state.step), "opt_state": host_state.opt_state,
             "rng": np.asarray(host_state.rng)}
    mngr.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(host_state.params), train=ocp.args.StandardSave(train),
        data=ocp.args.JsonSave(data_state), config=ocp.args.JsonSave(config),
        tokenizer=ocp.args.JsonSave(tokenizer_json(tok))), force=True)
    mngr.wait_until_finished()


@dataclasses.dataclass(frozen=True)
class Restored:
    """A checkpoint as the training loop resumes from it."""

    step: int
    state: TrainState       # host arrays; the optimiser (`tx`) is the template's
    data: dict              # the data iterator's state


def restore_latest(mngr: ocp.CheckpointManager, template: TrainState,
                   set_aside: bool = True) -> Restored | None:
    """The newest checkpoint that restores into `template`'s shapes (arrays or
    `jax.ShapeDtypeStruct`s); a broken one is reported and the previous one used.

    An unreadable step directory is renamed to `<step>.unreadable` when `set_aside` (the
    lead process of a run does it), so later saves of that step do not collide with it.

    Returns:
        A `Restored`, or None when there is no checkpoint.
    """
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), template)
    for step in sorted(mngr.all_steps(), reverse=True):
        try:
            train_target = {"step": abstract.step, "opt_state": abstract.opt_state,
                            "rng": abstract.rng}
            got = mngr.restore(step, args=ocp.args.Composite(
                params=ocp.args.StandardRestore(abstract.params),
                train=ocp.args.StandardRestore(train_target), data=ocp.args.JsonRestore()))
            state = template.replace(params=got.params, **got.train)
            return Restored(step, state, got.data)
        except Exception as e:       # any failure to read: fall back to an older step
            reason = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            moved = _set_aside(mngr, step) if set_aside else None
            print(f"checkpoint at step {step} is unreadable ({reason}); "
                  + (f"moved it to {moved}; " if moved else "")
                  + "falling back to the previous one", flush=True)
    return None


def _set_aside(mngr: ocp.CheckpointManager, step: int) -> str:
    """Renames an unreadable step directory out of the manager's sight (kept for inspection),
    so the run can save that step again once it gets there."""
    src = os.path.join(str(mngr.directory), str(step))
    dst = f"{src}.unreadable"
    n = 1
    while os.path.exists(dst):
        n += 1
        dst = f"{src}.unreadable{n}"
    os.rename(src, dst)
    mngr.reload()
    return dst


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


def config_item(experiment: dict, choice: ModelChoice) -> dict:
    generation = choice.generation
    return {"experiment": experiment, "model": choice.config.to_dict(),
            "model_type": choice.model_type,
            "generation": None if generation is None else {
                "eos_ids": generation.eos_ids, "raw": generation.raw}}


def restore_model(workdir: str, step: int | None = None) -> SavedModel:
    """The model of a run's newest readable checkpoint (or of `step`), without optimiser
    state, on the host.

    Raises:
        FileNotFoundError: naming the workdir when it has no (readable) checkpoint.
    """
    path = os.path.abspath(os.path.join(workdir, "checkpoints"))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoints in {workdir!r} (looked for {path})")
    mngr = ocp.CheckpointManager(path, item_names=("params", "config", "tokenizer"))
    steps = sorted(mngr.all_steps(), reverse=True) if step is None else [step]
    if not steps:
        raise FileNotFoundError(f"no checkpoints in {path}")
    last_error = None
    for s in steps:
        try:
            got = mngr.restore(s, args=ocp.args.Composite(
                params=ocp.args.StandardRestore(), config=ocp.args.JsonRestore(),
                tokenizer=ocp.args.JsonRestore()))
        except Exception as e:
            print(f"checkpoint at step {s} is unreadable ({type(e).__name__}); trying the "
                  "previous one", flush=True)
            last_error = e
            continue
        tok = tokenizer_from_json(got.tokenizer)
        item = got.config
        if "experiment" not in item:     # written before the model config was stored
            from train.model_config import model_config
            item = config_item(item, ModelChoice(
                model_config(ml_collections.ConfigDict(item), tok.vocab_size)))
        generation = item["generation"] and GenerationDefaults(
            eos_ids=tuple(item["generation"]["eos_ids"] or ()) or None,
            raw=item["generation"]["raw"])
        return SavedModel(got.params, TransformerConfig.from_dict(item["model"]), tok, s,
                          item["model_type"], generation, item["experiment"])
    raise FileNotFoundError(f"no readable checkpoint in {path}") from last_error
