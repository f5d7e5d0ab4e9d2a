"""Which checkpoint step a run resumes from: each step's checks, and the step every process
agrees on.

A step is usable by a process when its files match its integrity manifest (or it was
written before manifests existed), its save finished, and its arrays have this run's shapes
(`Verdicts`). With several processes each one checks the steps itself, newest first, and
they agree on the newest step that every one of them can use (`Agreement`, collectives only
when `jax.process_count() > 1`): a read error on one host never makes hosts restore
different steps. Each round, every process proposes its newest usable step at most the
current limit, and the smallest proposal becomes the limit:

    steps 9, 6, 3; process 1 cannot read 9
    round 1   proposals  process 0: 9   process 1: 6    -> limit 6
    round 2   proposals  process 0: 6   process 1: 6    -> agreed: 6 (restored by both)

When orbax then fails to restore the agreed step on every process, they all pass it over
together (`Agreement.settle`). A restore that fails on one process only cannot be survived
that way (orbax ends every restore with a barrier the others wait in), which is why the
checks come first: every file's sha256 against the manifest, the metadata and the shapes.
Steps newer than the agreed one are unusable for at least one process; the lead names one
process's reason for each (`shared_reasons`) when it sets them aside.
"""

from __future__ import annotations

import functools
import json
import logging
import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from models import atomic
from models.errors import UserError
from train import integrity

log = logging.getLogger(__name__)
PROMISE = "integrity_manifest"      # step metadata of a save that writes a manifest
_TEXT_BYTES = 4096                  # the longest text one process sends the others


class CheckpointError(UserError):
    """Checkpoints that exist but cannot be used: none readable, or not this model's."""


class Unusable(Exception):
    """A step that cannot be read, with the one-line reason."""


class Unfinished(Unusable):
    """A step orbax committed whose manifest was never written (a kill in between)."""


def step_dir(mngr: ocp.CheckpointManager, step: int) -> str:
    return os.path.join(str(mngr.directory), str(step))


def brief(e: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def check_whole(mngr: ocp.CheckpointManager, step: int, unverified_ok: bool = False) -> None:
    """Raises `Unusable` unless `step` is unchanged since it was written.

    A step with a manifest is checked against it. A step without one is accepted unchecked
    if it was written before manifests existed (its orbax step metadata has no manifest
    promise, `custom_metadata["integrity_manifest"]`, which every save sets), or when
    `unverified_ok` (the newest step, when no older one is usable).
    """
    path = step_dir(mngr, step)
    if os.path.exists(os.path.join(path, integrity.MANIFEST)):
        wrong = atomic.check_manifest(path, integrity.MANIFEST)
        if wrong:
            raise Unusable(wrong)
        return
    try:
        promised = (mngr.metadata(step).custom_metadata or {}).get(PROMISE)
    except Exception as e:
        raise Unusable(f"its step metadata cannot be read ({brief(e)})") from e
    if promised and not unverified_ok:
        raise Unfinished(f"{integrity.MANIFEST} is missing: the save did not finish")


def _shapes(tree) -> dict[str, tuple]:
    return {integrity.path_name(p): tuple(x.shape)
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def check_fits(mngr: ocp.CheckpointManager, step: int, abstract) -> None:
    """Raises `CheckpointError` naming the first array whose shape differs between the
    checkpoint (orbax's stored metadata) and this run's state (`abstract`, a `TrainState`
    of `jax.ShapeDtypeStruct`s), before anything is read."""
    try:
        meta = mngr.item_metadata(step)
        saved = {"params": _shapes(meta["params"]), "train": _shapes(meta["train"])}
    except Exception as e:
        raise Unusable(f"its metadata cannot be read ({brief(e)})") from e
    wanted = {"params": _shapes(abstract.params),
              "train": _shapes({"step": abstract.step, "opt_state": abstract.opt_state,
                                "rng": abstract.rng})}
    for item, hint in (("params", "the model config (d_model, layers, vocabulary, ...)"),
                       ("train", "the optimiser config (grad_accum_steps, grad_clip_norm)")):
        have, want = saved[item], wanted[item]
        for path in sorted(set(have) | set(want)):
            if have.get(path) != want.get(path):
                shown = ("params/" if item == "params" else "") + path
                raise CheckpointError(
                    f"the checkpoint at step {step} in {mngr.directory} does not fit this "
                    f"run: {shown} is {_shape_text(have.get(path))} there and "
                    f"{_shape_text(want.get(path))} here; was {hint} changed? Resume with "
                    "the config the run was started with, or use another workdir")


def _shape_text(shape) -> str:
    return "absent" if shape is None else f"shape {shape}"


class Verdicts:
    """This process's view of each step, each check made once, as asked.

    `reason(step)` is None when the step is usable here, else why not (`reasons` keeps
    them). With `unverified_ok` a step whose only fault is an unfinished save (in
    `unfinished`) counts as usable.

    Raises (from `reason`):
        CheckpointError: the step was written for another model (`check_fits`).
    """

    def __init__(self, mngr: ocp.CheckpointManager, abstract):
        self._mngr, self._abstract = mngr, abstract
        self.reasons: dict[int, str] = {}
        self.unfinished: set[int] = set()
        self._usable: set[int] = set()

    def reason(self, step: int, unverified_ok: bool = False) -> str | None:
        if step not in self._usable and step not in self.reasons:
            self._check(step, unverified_ok=False)
        if unverified_ok and step in self.unfinished and step not in self._usable:
            self._check(step, unverified_ok=True)
        return None if step in self._usable else self.reasons[step]

    def _check(self, step: int, unverified_ok: bool) -> None:
        try:
            check_whole(self._mngr, step, unverified_ok)
            check_fits(self._mngr, step, self._abstract)
        except CheckpointError:
            raise
        except Exception as e:       # any failure to read: an older step may do
            log.debug("checkpoint at step %d in %s is unusable", step, self._mngr.directory,
                      exc_info=True)
            self.unfinished.discard(step)
            if isinstance(e, Unfinished):
                self.unfinished.add(step)
            self.reasons[step] = str(e) if isinstance(e, Unusable) else brief(e)
            return
        self._usable.add(step)

    def fail(self, step: int, reason: str) -> None:
        """`step` passed its checks but could not be restored."""
        self._usable.discard(step)
        self.unfinished.discard(step)
        self.reasons[step] = reason


def _gather(row: list[int]) -> np.ndarray:
    """Every process's `row`, `[processes, len(row)]` int32, in process order: a collective
    when there are several processes (each must call it at the same point)."""
    if jax.process_count() == 1:
        return np.asarray([row], np.int32)
    from jax.experimental import multihost_utils
    mine = np.asarray(row, np.int32)
    return np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, len(mine))


def _gather_text(text: str) -> list[str]:
    """Every process's `text` (its first `_TEXT_BYTES` bytes), in process order."""
    data = text.encode()[:_TEXT_BYTES]
    every = _gather([len(data), *data, *[0] * (_TEXT_BYTES - len(data))])
    return [bytes(row[1:1 + row[0]].astype(np.uint8)).decode(errors="replace")
            for row in every]


def sync(name: str) -> None:
    """Waits for every process to get here (nothing with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def any_steps(steps: list[int]) -> bool:
    """Whether any process sees a checkpoint (a collective with several processes)."""
    return bool(_gather([len(steps)]).any())


class Agreement:
    """The newest step every process can use, found together (see the module docstring).

    Every process calls `next` and `settle` the same number of times, in the same order:
    with several processes each is a collective.
    """

    def __init__(self, steps: list[int], verdicts: Verdicts, unverified_ok: bool = False):
        self._steps = sorted(steps, reverse=True)
        self._check = functools.partial(verdicts.reason, unverified_ok=unverified_ok)
        self._verdicts = verdicts
        self._limit = self._steps[0] if self._steps else -1

    def _newest(self, limit: int) -> int:
        """This process's newest usable step at most `limit`; -1 when there is none."""
        return next((s for s in self._steps if s <= limit and self._check(s) is None), -1)

    def next(self) -> int | None:
        """The newest step at most the limit that every process can use; None when there
        is none.

        Raises:
            CheckpointError: on every process, when a step was written for another model on
                any of them (with that process's message).
        """
        limit = self._limit
        while True:
            refused: CheckpointError | None = None
            try:
                mine = self._newest(limit)
            except CheckpointError as e:
                mine, refused = -1, e
            every = _gather([mine, refused is not None])
            if every[:, 1].any():
                texts = _gather_text(str(refused) if refused else "")
                if refused is not None:
                    raise refused
                raise CheckpointError(next(t for t, f in zip(texts, every[:, 1],
                                                            strict=True) if f))
            agreed = int(every[:, 0].min())
            if agreed < 0 or (every[:, 0] == agreed).all():
                self._limit = agreed
                return None if agreed < 0 else agreed
            limit = agreed

    def settle(self, step: int, reason: str | None) -> bool:
        """Whether every process restored `step` (`reason` None here: this one did); if
        not, all of them pass it over together and `next` looks below it."""
        every = _gather([reason is None])
        if every.all():
            return True
        if reason is not None:
            self._verdicts.fail(step, reason)
        self._limit = step - 1
        return False


def shared_reasons(verdicts: Verdicts, above: int, seen: int) -> tuple[dict[int, str], list]:
    """Why each step newer than `above` is unusable, one process's reason each (the lowest
    numbered process that has one), and which processes see no checkpoint at all (`seen`:
    this process's step count). With several processes the reasons name their process:

        {9: "process 1: params/d/0 differs from its manifest (sha256)"}, []

    A collective with several processes.
    """
    if jax.process_count() == 1:
        return {s: r for s, r in sorted(verdicts.reasons.items(), reverse=True)
                if s > above}, [] if seen else [0]
    newer = [(str(s), r[:300]) for s, r in sorted(verdicts.reasons.items(), reverse=True)
             if s > above]
    mine = dict(newer[:10])
    payload = json.dumps({"seen": seen, "reasons": mine})
    while len(payload.encode()) > _TEXT_BYTES:          # the oldest steps' reasons go first
        mine.popitem()
        payload = json.dumps({"seen": seen, "reasons": mine})
    every = [json.loads(t) for t in _gather_text(payload)]
    out: dict[int, str] = {}
    for p, one in enumerate(every):
        for s, r in one["reasons"].items():
            out.setdefault(int(s), f"process {p}: {r}")
    blind = [p for p, one in enumerate(every) if not one["seen"]]
    return dict(sorted(out.items(), reverse=True)), blind


def set_aside(mngr: ocp.CheckpointManager, step: int) -> str:
    """Renames an unreadable step directory out of the manager's sight (kept for inspection),
    so the run can save that step again once it gets there."""
    src = step_dir(mngr, step)
    dst = f"{src}.unreadable"
    n = 1
    while os.path.exists(dst):
        n += 1
        dst = f"{src}.unreadable{n}"
    os.rename(src, dst)
    mngr.reload()
    return dst


def note_set_aside_only(directory: str, report: bool) -> None:
    """Says (when `report`) that the only steps in `directory` were set aside."""
    if not report or not os.path.isdir(directory):
        return
    aside = sorted(n for n in os.listdir(directory) if ".unreadable" in n)
    if aside:
        print(f"no checkpoint to resume from in {directory} (only steps set aside: "
              f"{', '.join(aside)}); starting from step 0", flush=True)
