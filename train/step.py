"""The train and eval steps, written once for every objective and every wrapper.

    steps = Steps(model, objective, schedule, grad_accum_steps=1)
    train_step, eval_step = steps.functions()          # per device, over the "batch" axis
    train_step, eval_step = steps.functions(axis=None)  # the global batch (train.sharding)

Both run inside a mapped axis named "batch" (pmap or shard_map): each device sees its own
`[B, W]` rows, and sums are combined with `lax.psum` / `lax.pmean` over that axis. With
`axis=None` (`train.sharding`, under `jax.jit`) the same body sees the whole global batch,
as one device would, and the compiler partitions it: every collective is then the identity.

What a batch means is the objective's (`train.objectives`): it prepares the targets and
weights (`prepare`) and sums the loss (`loss_sums`). The step draws the keys, normalises
the gradient by the global weight and applies the update; it is the same for all of them.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax import lax

from train import losses
from train.objectives.base import Objective
from train.state import EvalParams, TrainState

AXIS = "batch"
# The objective's draws' stream (masks): the step key folded with this (dropout folds
# device indices).
MASKING_STREAM = 0x7FFF_FFFF


def _psum(x, axis: str | None):
    return x if axis is None else lax.psum(x, axis)


def _index(axis: str | None):
    return 0 if axis is None else lax.axis_index(axis)


def _row_ids(batch, axis: str | None = AXIS) -> jax.Array:
    """This device's rows' global indices: device d of the axis holds rows d*B .. d*B+B-1."""
    rows = next(iter(batch.values())).shape[0]
    return _index(axis) * rows + jnp.arange(rows)


def _sums(model, objective: Objective, params, batch, task, *, rng, step, train: bool,
          reference=None):
    """The objective's loss sums, with the dropout key and a key of its own from `rng`
    (and the train state's `reference` copy, to an objective that keeps one)."""
    dropout_rng, sample_rng = jax.random.split(rng)
    extra = {} if reference is None else {"reference": reference}
    return objective.loss_sums(model, params, batch, task, dropout_rng=dropout_rng,
                               sample_rng=sample_rng, step=step, train=train, **extra)


def train_step(state: TrainState, batch, *, model, objective: Objective, schedule,
               grad_accum_steps: int = 1, axis: str | None = AXIS):
    """One optimiser update on this device's rows; gradients averaged over the "batch" axis
    (`axis`; None: the rows are the global batch, see the module docstring).

    Each device's loss is its loss sum over the *global* weight (target tokens, masked
    tokens or examples) times the number of devices, so `pmean` of the gradients is exactly
    the gradient of the global batch's mean loss, however unevenly packing spreads the
    scored positions over devices. Dropout keys are `fold_in(fold_in(rng, step), device)`.

    Returns:
        (new state, metrics): metric sums psum-ed over devices (see `summarise`), the
        gradient norm and the learning rate.
    """
    step_key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
    rng = jax.random.fold_in(step_key, _index(axis))
    task = objective.prepare(batch, key=jax.random.fold_in(step_key, MASKING_STREAM),
                             row_ids=_row_ids(batch, axis))
    global_weight = _psum(jnp.sum(task["weights"]), axis)
    num_devices = _psum(1, axis)

    def loss_fn(params):
        whole = state.replace(params=params).model_params     # with an adapted model's base
        sums = _sums(model, objective, whole, batch, task, rng=rng, step=state.step,
                     train=True, reference=state.reference)
        return sums["loss"] * num_devices / jnp.maximum(global_weight, 1.0), sums

    # Differentiate per device: under shard_map the replicated params would otherwise get
    # gradients already summed over devices (the transpose of their implicit broadcast).
    params = state.params if axis is None else per_device(state.params, axis)
    grads, sums = jax.grad(loss_fn, has_aux=True)(params)
    grads = grads if axis is None else lax.pmean(grads, axis)
    metrics = _psum(sums, axis)
    metrics["grad_norm"] = optax.tree.norm(grads)
    metrics["learning_rate"] = schedule(state.step // max(grad_accum_steps, 1))
    return state.apply_gradients(grads), metrics


def per_device(tree, axis: str = AXIS):
    """Marks a replicated tree as varying over the "batch" axis (a no-op under pmap)."""
    return jax.tree.map(lambda x: lax.pcast(x, axis, to="varying"), tree)


def eval_step(params, batch, *, model, objective: Objective, axis: str | None = AXIS):
    """Loss sums without dropout or smoothing, psum-ed over devices. The objective's draws
    (masked LM's masks) use a fixed key and each row's example index (`example_index`,
    when the batch has it), so every evaluation scores the same positions. `params` is
    `TrainState.eval_params`: the model's, or `EvalParams` (the model's, the reference
    copy's)."""
    params, reference = params if isinstance(params, EvalParams) else (params, None)
    if axis is not None:      # as the train step's: a loop over rows and params (GRPO's
        params = per_device(params, axis)          # rollouts) needs one kind of value
    row_ids = batch.get("example_index")
    batch = {k: v for k, v in batch.items() if k != "example_index"}
    row_ids = _row_ids(batch, axis) if row_ids is None else row_ids
    task = objective.prepare(batch, key=jax.random.key(MASKING_STREAM), row_ids=row_ids)
    sums = _sums(model, objective, params, batch, task, rng=jax.random.key(0), step=0,
                 train=False, reference=reference)
    return _psum(sums, axis)


def summarise(sums: dict, label_names: tuple[str, ...] = ()) -> dict:
    """Host-side means from summed metrics: loss, accuracy, perplexity per target token
    (per masked token in masked LM, per example in classification, with each class's F1
    named by `label_names`), and each mean an objective sums as `NAME` and `NAME_count`
    (sequence-level training's `reward`, `risk`)."""
    weight = max(float(sums["weight"]), 1.0)
    out = {"loss": float(sums["loss"]) / weight, "nll": float(sums["nll"]) / weight,
           "accuracy": float(sums["correct"]) / weight, "tokens": float(sums["weight"])}
    out["perplexity"] = float(jnp.exp(min(out["nll"], 50.0)))
    for key in ("z_loss", "moe_aux_loss", "router_z_loss"):     # the last two: moe_terms
        if key in sums:
            out[key] = float(sums[key]) / weight
    if "true_positives" in sums:
        out.update(losses.f1_scores(sums, label_names))
    for key in ("grad_norm", "learning_rate"):
        if key in sums:
            out[key] = float(sums[key])
    for key in sums:        # an objective's means: a sum NAME beside its count NAME_count
        if f"{key}_count" in sums:
            out[key] = float(sums[key]) / max(float(sums[f"{key}_count"]), 1.0)
    return out


@dataclasses.dataclass(frozen=True)
class Steps:
    """What the steps compute, before any wrapper: the model, its objective, and the
    learning-rate schedule the metrics report (in optimiser updates: the step over
    `grad_accum_steps`).

    Attributes:
        model: the Flax module.
        objective: a `train.objectives.Objective`.
        schedule: `train.state.make_optimizer`'s schedule.
        grad_accum_steps: micro-batches per optimiser update.
    """

    model: nn.Module
    objective: Objective
    schedule: optax.Schedule
    grad_accum_steps: int = 1

    def functions(self, axis: str | None = AXIS):
        """(train_step, eval_step) closed over these, ready for a wrapper: a data-parallel
        one (`axis` "batch") or `train.sharding` (`axis` None)."""
        return (functools.partial(train_step, model=self.model, objective=self.objective,
                                  schedule=self.schedule,
                                  grad_accum_steps=self.grad_accum_steps, axis=axis),
                functools.partial(eval_step, model=self.model, objective=self.objective,
                                  axis=axis))

