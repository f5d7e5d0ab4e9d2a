"""orbax checkpoints: parameters, optimiser state, data position, config and tokenizer.

One checkpoint is a step directory with separate items, so decoding can restore the
parameters alone (on CPU, without building an optimiser):

    params     the model parameters (plain arrays, never replicated)
    train      {"step", "opt_state", "rng"}
    data       the grain iterator state (JSON)
    config     the experiment config (JSON)
    tokenizer  {"kind", "model_b64"} (JSON)
"""

from __future__ import annotations

import base64
import dataclasses
import os
import tempfile

import jax
import numpy as np
import orbax.checkpoint as ocp

from models.tokenizer import ByteTokenizer, SentencePieceTokenizer, Tokenizer, load_tokenizer
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
    """The newest checkpoint that restores into `template`'s shapes; a broken one is
    reported and the previous one used.

    An unreadable step directory is renamed to `<step>.unreadable` when `set_aside` (the
    lead process of a run does it), so later saves of that step do not collide with it.

    Returns:
        A `Restored`, or None when there is no checkpoint.
    """
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), template)
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


def restore_for_decoding(workdir: str, step: int | None = None):
    """(params, config dict, tokenizer, step) of a run, parameters only, as host arrays.

    Raises:
        FileNotFoundError: naming the workdir when it has no checkpoint.
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
            return got.params, got.config, tokenizer_from_json(got.tokenizer), s
        except Exception as e:
            print(f"checkpoint at step {s} is unreadable ({type(e).__name__}); trying the "
                  "previous one", flush=True)
            last_error = e
    raise FileNotFoundError(f"no readable checkpoint in {path}") from last_error
