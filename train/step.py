"""The train and eval steps, written once for any data-parallel wrapper (see `parallel`).

Both run inside a mapped axis named "batch" (pmap or shard_map): each device sees its own
`[B, W]` rows, and sums are combined with `lax.psum` / `lax.pmean` over that axis.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from jax import lax

from train import losses
from train.state import TrainState

AXIS = "batch"


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
        raise ValueError(f"scheduled_sampling.schedule={ss.schedule!r} must be 'linear', "
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


def _sums(model, params, batch, rng, config, step, deterministic):
    """Loss sums of one device's rows (two passes under scheduled sampling)."""
    dropout_rng, mix_rng = jax.random.split(rng)
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
    weights = (batch["targets_segmentation"] > 0).astype(jnp.float32)
    return losses.cross_entropy(logits, batch["targets"], weights,
                                label_smoothing=config.label_smoothing if not deterministic
                                else 0.0, z_loss=config.z_loss)


def train_step(state: TrainState, batch, *, model, config, schedule):
    """One optimiser update on this device's rows; gradients averaged over the "batch" axis.

    Each device's loss is its token-loss sum over the *global* token count times the number
    of devices, so `pmean` of the gradients is exactly the gradient of the global batch's
    mean token loss, however unevenly packing spreads tokens over devices.

    Returns:
        (new state, metrics): metric sums psum-ed over devices (see `summarise`).
    """
    device = lax.axis_index(AXIS)
    rng = jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(state.rng),
                                                state.step), device)
    global_weight = lax.psum(jnp.sum((batch["targets_segmentation"] > 0).astype(jnp.float32)),
                             AXIS)
    num_devices = lax.psum(1, AXIS)

    def loss_fn(params):
        sums = _sums(model, params, batch, rng, config, state.step, deterministic=False)
        return sums["loss"] * num_devices / jnp.maximum(global_weight, 1.0), sums

    # Differentiate per device: under shard_map the replicated params would otherwise get
    # gradients already summed over devices (the transpose of their implicit broadcast).
    grads, sums = jax.grad(loss_fn, has_aux=True)(per_device(state.params))
    grads = lax.pmean(grads, AXIS)
    metrics = lax.psum(sums, AXIS)
    metrics["grad_norm"] = optax.tree.norm(grads)
    metrics["learning_rate"] = schedule(state.step // max(config.grad_accum_steps, 1))
    return state.apply_gradients(grads), metrics


def per_device(tree):
    """Marks a replicated tree as varying over the "batch" axis (a no-op under pmap)."""
    return jax.tree.map(lambda x: lax.pcast(x, AXIS, to="varying"), tree)


def eval_step(params, batch, *, model, config):
    """Loss sums without dropout or smoothing, psum-ed over devices."""
    sums = _sums(model, params, batch, jax.random.key(0), config, 0, deterministic=True)
    return lax.psum(sums, AXIS)


def summarise(sums: dict) -> dict:
    """Host-side means from summed metrics: loss, accuracy, perplexity per target token."""
    weight = max(float(sums["weight"]), 1.0)
    out = {"loss": float(sums["loss"]) / weight, "nll": float(sums["nll"]) / weight,
           "accuracy": float(sums["correct"]) / weight, "tokens": float(sums["weight"])}
    out["perplexity"] = float(jnp.exp(min(out["nll"], 50.0)))
    if "z_loss" in sums:
        out["z_loss"] = float(sums["z_loss"]) / weight
    for key in ("grad_norm", "learning_rate"):
        if key in sums:
            out[key] = float(sums[key])
    return out


def make_steps(model, config, schedule):
    """(train_step, eval_step) closed over the model and config, ready for a wrapper."""
    return (functools.partial(train_step, model=model, config=config, schedule=schedule),
            functools.partial(eval_step, model=model, config=config))
