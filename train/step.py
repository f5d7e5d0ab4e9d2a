"""The train and eval steps, written once for any data-parallel wrapper (see `parallel`).

Both run inside a mapped axis named "batch" (pmap or shard_map): each device sees its own
`[B, W]` rows, and sums are combined with `lax.psum` / `lax.pmean` over that axis. With
`axis=None` (`train.sharding`, under `jax.jit`) the same body sees the whole global batch,
as one device would, and the compiler partitions it: every collective is then the identity.

Three objectives (`Objective`), one loss: token cross-entropy at weighted positions,
normalised by the global weight.

    next_token   decoder-only, encoder-decoder: every real target token, teacher-forced
    mlm          encoder-only with a masked-LM head: the positions `train.masking` chose
    classify     encoder-only classifier: each example's label at its first position
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from jax import lax

from models.errors import UserError
from train import losses
from train.masking import Masking, mask_tokens
from train.state import TrainState

AXIS = "batch"
# The masking draws' stream: the step key folded with this (dropout folds device indices).
MASKING_STREAM = 0x7FFF_FFFF


@dataclasses.dataclass(frozen=True)
class Objective:
    """What a run predicts (see the module docstring) and, for masked LM, with what.

    Attributes:
        kind: "next_token", "mlm" or "classify".
        mask_id: the tokenizer's mask token (mlm).
        special_ids: ids never chosen for masking (the tokenizer's specials).
        masking: the corruption's probabilities.
    """

    kind: str = "next_token"
    mask_id: int | None = None
    special_ids: tuple[int, ...] = ()
    masking: Masking = Masking()

    def __post_init__(self):
        if self.kind not in ("next_token", "mlm", "classify"):
            raise UserError(f"objective {self.kind!r} must be 'next_token', 'mlm' or "
                             "'classify'")
        if self.kind == "mlm" and self.mask_id is None:
            raise UserError("masked LM needs a mask token, and the tokenizer has none "
                             "(mask_id None)")


def objective_for(model_config, tokenizer, masking: Masking | None = None) -> Objective:
    """The objective a model's config implies: next-token prediction, or for an encoder-only
    model masked LM (num_labels 0) or classification.

    Raises:
        UserError: masked LM with a tokenizer that has no mask token, naming it.
    """
    if model_config.architecture != "encoder_only":
        return Objective()
    if model_config.num_labels:
        return Objective("classify")
    if tokenizer.mask_id is None:
        raise UserError(f"masked LM needs a mask token, and the tokenizer "
                         f"({tokenizer.identity[:40]}) has none (mask_id None)")
    return Objective("mlm", int(tokenizer.mask_id),
                     tuple(sorted(int(i) for i in tokenizer.special_ids)), masking or Masking())


def shift_right(targets_BT, positions_BT, segmentation_BT, bos_id: int):
    """Decoder inputs: each segment's targets moved one right behind BOS (packing aware).

        targets       [a1 a2 EOS b1 EOS 0]
        positions     [ 0  1  2   0  1  0]
        decoder input [BOS a1 a2 BOS b1 0]
    """
    shifted = jnp.pad(targets_BT, ((0, 0), (1, 0)))[:, :-1]
    inputs = jnp.where(positions_BT == 0, bos_id, shifted)
    return jnp.where(segmentation_BT > 0, inputs, 0)


def forward(model, params, batch, decoder_inputs, *, dropout_rng, deterministic: bool):
    """Teacher-forced logits `[B, T, V]` for either architecture, segments respected."""
    rngs = None if deterministic else {"dropout": dropout_rng}
    if "inputs" in batch:
        return model.apply({"params": params}, batch["inputs"], decoder_inputs,
                           src_segment_ids=batch["inputs_segmentation"],
                           tgt_segment_ids=batch["targets_segmentation"],
                           src_positions=batch["inputs_position"],
                           tgt_positions=batch["targets_position"],
                           deterministic=deterministic, rngs=rngs)
    return model.apply({"params": params}, decoder_inputs,
                       segment_ids=batch["targets_segmentation"],
                       positions=batch["targets_position"], deterministic=deterministic,
                       rngs=rngs)


def sampling_rate(step, config) -> jax.Array:
    """Scheduled-sampling probability of feeding a prediction, at training step `step`.

        linear:          max_rate * min(1, step / ramp_steps)
        exponential:     max_rate * (1 - k ** step)                  (0 < k < 1)
        inverse_sigmoid: max_rate * (1 - k / (k + exp(step / k)))    (k >= 1)
    """
    ss = config.scheduled_sampling
    step = jnp.asarray(step, jnp.float32)
    if ss.schedule == "linear":
        frac = jnp.minimum(1.0, step / max(ss.ramp_steps, 1))
    elif ss.schedule == "exponential":
        frac = 1.0 - jnp.power(ss.k, step)
    elif ss.schedule == "inverse_sigmoid":
        frac = 1.0 - ss.k / (ss.k + jnp.exp(step / ss.k))
    else:
        raise UserError(f"scheduled_sampling.schedule={ss.schedule!r} must be 'linear', "
                         "'exponential' or 'inverse_sigmoid'")
    return ss.max_rate * frac


def mix_predictions(decoder_inputs, logits_BTV, positions_BT, segmentation_BT, rate, rng):
    """Replaces each gold decoder input (not a segment's BOS) by the previous prediction
    with probability `rate`: rate 0 returns the inputs, rate 1 only predictions."""
    predicted = jnp.argmax(logits_BTV, axis=-1).astype(decoder_inputs.dtype)
    shifted = jnp.pad(predicted, ((0, 0), (1, 0)))[:, :-1]
    replace = (jax.random.uniform(rng, decoder_inputs.shape) < rate) & (positions_BT > 0) & (
        segmentation_BT > 0)
    return jnp.where(replace, shifted, decoder_inputs)


def prepare(model, objective: Objective, batch, mask_key, row_ids_B) -> dict:
    """What the loss compares with, and where: `targets` `[B, T]` and `weights` `[B, T]`
    (float32), plus masked LM's corrupted `inputs`. Rows are masked by their global index
    `row_ids_B`, so a device split masks exactly as one device does."""
    if objective.kind == "next_token":
        return {"targets": batch["targets"],
                "weights": (batch["targets_segmentation"] > 0).astype(jnp.float32)}
    if objective.kind == "classify":
        first_BT = (batch["inputs_position"] == 0) & (batch["inputs_segmentation"] > 0)
        return {"targets": batch["labels"], "weights": first_BT.astype(jnp.float32)}
    tokens_BT = batch["targets"]
    maskable_BT = (batch["targets_segmentation"] > 0) & ~jnp.isin(
        tokens_BT, jnp.asarray(objective.special_ids, tokens_BT.dtype))
    inputs_BT, chosen_BT = mask_tokens(mask_key, tokens_BT, maskable_BT, row_ids_B,
                                       mask_id=objective.mask_id,
                                       vocab_size=model.config.vocab_size,
                                       masking=objective.masking)
    return {"targets": tokens_BT, "weights": chosen_BT.astype(jnp.float32),
            "inputs": inputs_BT}


def _encoder_logits(model, params, batch, task, *, dropout_rng, deterministic: bool):
    """An encoder-only model's logits: `[B, T, V]` (masked LM) or per-position class
    logits `[B, T, C]` (classification; read at each example's first position)."""
    rngs = None if deterministic else {"dropout": dropout_rng}
    if "inputs" in task:             # masked LM: the corrupted text
        return model.apply({"params": params}, task["inputs"],
                           segment_ids=batch["targets_segmentation"],
                           positions=batch["targets_position"],
                           deterministic=deterministic, rngs=rngs)
    return model.apply({"params": params}, batch["inputs"],
                       segment_ids=batch["inputs_segmentation"],
                       positions=batch["inputs_position"], deterministic=deterministic,
                       rngs=rngs, method="classify_positions")


def _sums(model, params, batch, task, rng, config, step, deterministic):
    """Loss sums of one device's rows (two passes under scheduled sampling)."""
    dropout_rng, mix_rng = jax.random.split(rng)
    smoothing = config.label_smoothing if not deterministic else 0.0
    if model.config.architecture == "encoder_only":
        logits = _encoder_logits(model, params, batch, task, dropout_rng=dropout_rng,
                                 deterministic=deterministic)
        sums = losses.cross_entropy(logits, task["targets"], task["weights"],
                                    label_smoothing=smoothing, z_loss=config.z_loss)
        if model.config.num_labels:
            sums.update(losses.confusion(logits, task["targets"], task["weights"]))
        return sums
    dec_in = shift_right(batch["targets"], batch["targets_position"],
                         batch["targets_segmentation"], model.config.bos_id)
    if config.scheduled_sampling.enabled and not deterministic:
        first = forward(model, params, batch, dec_in, dropout_rng=dropout_rng,
                        deterministic=deterministic)
        dec_in = mix_predictions(dec_in, lax.stop_gradient(first), batch["targets_position"],
                                 batch["targets_segmentation"], sampling_rate(step, config),
                                 mix_rng)
    logits = forward(model, params, batch, dec_in, dropout_rng=dropout_rng,
                     deterministic=deterministic)
    return losses.cross_entropy(logits, task["targets"], task["weights"],
                                label_smoothing=smoothing, z_loss=config.z_loss)


def _psum(x, axis: str | None):
    return x if axis is None else lax.psum(x, axis)


def _index(axis: str | None):
    return 0 if axis is None else lax.axis_index(axis)


def _row_ids(batch, axis: str | None = AXIS) -> jax.Array:
    """This device's rows' global indices: device d of the axis holds rows d*B .. d*B+B-1."""
    rows = next(iter(batch.values())).shape[0]
    return _index(axis) * rows + jnp.arange(rows)


def train_step(state: TrainState, batch, *, model, config, schedule,
               objective: Objective = Objective(), axis: str | None = AXIS):
    """One optimiser update on this device's rows; gradients averaged over the "batch" axis
    (`axis`; None: the rows are the global batch, see the module docstring).

    Each device's loss is its token-loss sum over the *global* token count times the number
    of devices, so `pmean` of the gradients is exactly the gradient of the global batch's
    mean token loss, however unevenly packing spreads tokens over devices.

    Returns:
        (new state, metrics): metric sums psum-ed over devices (see `summarise`).
    """
    step_key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
    rng = jax.random.fold_in(step_key, _index(axis))
    task = prepare(model, objective, batch, jax.random.fold_in(step_key, MASKING_STREAM),
                   _row_ids(batch, axis))
    global_weight = _psum(jnp.sum(task["weights"]), axis)
    num_devices = _psum(1, axis)

    def loss_fn(params):
        sums = _sums(model, params, batch, task, rng, config, state.step,
                     deterministic=False)
        return sums["loss"] * num_devices / jnp.maximum(global_weight, 1.0), sums

    # Differentiate per device: under shard_map the replicated params would otherwise get
    # gradients already summed over devices (the transpose of their implicit broadcast).
    params = state.params if axis is None else per_device(state.params, axis)
    grads, sums = jax.grad(loss_fn, has_aux=True)(params)
    grads = grads if axis is None else lax.pmean(grads, axis)
    metrics = _psum(sums, axis)
    metrics["grad_norm"] = optax.tree.norm(grads)
    metrics["learning_rate"] = schedule(state.step // max(config.grad_accum_steps, 1))
    return state.apply_gradients(grads), metrics


def per_device(tree, axis: str = AXIS):
    """Marks a replicated tree as varying over the "batch" axis (a no-op under pmap)."""
    return jax.tree.map(lambda x: lax.pcast(x, axis, to="varying"), tree)


def eval_step(params, batch, *, model, config, objective: Objective = Objective(),
              axis: str | None = AXIS):
    """Loss sums without dropout or smoothing, psum-ed over devices. Masked LM masks each
    row with a fixed key by its example's index (`example_index`, when the batch has it),
    so every evaluation scores the same masks."""
    row_ids = batch.get("example_index")
    batch = {k: v for k, v in batch.items() if k != "example_index"}
    row_ids = _row_ids(batch, axis) if row_ids is None else row_ids
    task = prepare(model, objective, batch, jax.random.key(MASKING_STREAM), row_ids)
    sums = _sums(model, params, batch, task, jax.random.key(0), config, 0, deterministic=True)
    return _psum(sums, axis)


def summarise(sums: dict, label_names: tuple[str, ...] = ()) -> dict:
    """Host-side means from summed metrics: loss, accuracy, perplexity per target token
    (per masked token in masked LM, per example in classification, with each class's F1
    named by `label_names`)."""
    weight = max(float(sums["weight"]), 1.0)
    out = {"loss": float(sums["loss"]) / weight, "nll": float(sums["nll"]) / weight,
           "accuracy": float(sums["correct"]) / weight, "tokens": float(sums["weight"])}
    out["perplexity"] = float(jnp.exp(min(out["nll"], 50.0)))
    if "z_loss" in sums:
        out["z_loss"] = float(sums["z_loss"]) / weight
    if "true_positives" in sums:
        out.update(losses.f1_scores(sums, label_names))
    for key in ("grad_norm", "learning_rate"):
        if key in sums:
            out[key] = float(sums[key])
    return out


def make_steps(model, config, schedule, objective: Objective = Objective(),
               axis: str | None = AXIS):
    """(train_step, eval_step) closed over the model, config and objective, ready for a
    wrapper: a data-parallel one (`axis` "batch") or `train.sharding` (`axis` None)."""
    return (functools.partial(train_step, model=model, config=config, schedule=schedule,
                              objective=objective, axis=axis),
            functools.partial(eval_step, model=model, config=config, objective=objective,
                              axis=axis))
