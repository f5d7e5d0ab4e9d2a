"""Checkpoint averaging: the mean of the parameters of a run's newest checkpoints.

A model averaged over the last few checkpoints of a run usually translates better than the
last state alone (Vaswani et al. 2017 average the last 5 or 20): the steps' noise cancels.
With `average_last_checkpoints=N`, a run evaluates and exports the mean of its newest N
checkpoints' parameters at the end (`averaged_state`), and `python -m train.export` writes
the same mean (`mean_params`). Only what leaves the run is averaged: the checkpoints keep
the trained states, so a resumed run continues from its last state, and the mean at its end
takes the newest N checkpoints then in the workdir (those written before the restart
included).

    steps = newest_steps(mngr, 3)                 # e.g. [1000, 1500, 1800]
    params = mean_params(mngr, steps)             # {..: (p_1000 + p_1500 + p_1800) / 3}
    saved, steps = averaged_model(workdir, checkpoint.restore_model(workdir), 3)
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import orbax.checkpoint as ocp

from train import checkpoint


def newest_steps(mngr: ocp.CheckpointManager, count: int, *,
                 up_to: int | None = None) -> list[int]:
    """The newest `count` checkpoint steps (at most `up_to`), oldest first; fewer when the
    run has fewer."""
    steps = sorted(s for s in mngr.all_steps() if up_to is None or s <= up_to)
    return steps[-count:] if count > 0 else []


def mean_params(mngr: ocp.CheckpointManager, steps: list[int]):
    """The element-wise mean of the "params" item of checkpoints `steps`, as numpy arrays
    of each parameter's dtype (summed in float64).

        mean_params(mngr, [10, 20]) -> {"w": (w_10 + w_20) / 2, ...}

    Raises:
        ValueError: no steps.
    """
    if not steps:
        raise ValueError("no checkpoints to average")
    total, dtypes = None, None
    for step in steps:
        shapes = mngr.item_metadata(step)["params"]
        target = jax.tree.map(lambda m: np.empty(m.shape, m.dtype), shapes)
        params = mngr.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(target))).params
        if total is None:
            dtypes = jax.tree.map(lambda p: p.dtype, params)
            total = jax.tree.map(lambda p: np.asarray(p, np.float64), params)
        else:
            total = jax.tree.map(lambda t, p: t + p, total, params)
    return jax.tree.map(lambda t, d: (t / len(steps)).astype(d), total, dtypes)


def averaged_state(run, state):
    """(state, steps averaged): `state` with its parameters replaced by the mean of the run's
    newest `average_last_checkpoints` checkpoints (every process reads them), placed as
    the steps take it; `state` itself and [] when that is 1 or only one checkpoint exists.

    Args:
        run: a `train.setup.Run` whose newest checkpoint holds `state`.
    """
    steps = newest_steps(run.checkpoints, run.config.checkpoints.average_last_checkpoints)
    if len(steps) < 2:
        return state, []
    host = run.wrapper.host_state(state)
    state = run.wrapper.put_state(host.replace(params=mean_params(run.checkpoints, steps)))
    if run.lead:
        print(f"averaged the parameters of the checkpoints at steps "
              f"{', '.join(map(str, steps))}", flush=True)
    return state, steps


def averaged_model(workdir: str, saved: checkpoint.SavedModel, count: int
                   ) -> tuple[checkpoint.SavedModel, list[int]]:
    """(`saved` with the mean parameters of the newest `count` checkpoints of `workdir` up
    to its step, steps averaged); `saved` and [] when fewer than two are there. An adapted
    run's mean adapters are joined with their base, as `checkpoint.restore_model` does."""
    mngr = checkpoint.reader(workdir)
    steps = newest_steps(mngr, count, up_to=saved.step)
    if len(steps) < 2:
        return saved, []
    params = mean_params(mngr, steps)
    if saved.config.lora is not None:
        params = checkpoint.with_base(params, saved.config, saved.experiment)
    return dataclasses.replace(saved, params=params), steps
