"""TrainState and the optax optimiser: adamw, warmup then rsqrt or cosine, clipping,
accumulation."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from models.errors import UserError


@struct.dataclass
class TrainState:
    """Everything a training run carries from step to step.

    Attributes:
        step: optimiser updates applied so far (int32 scalar).
        params: model parameters (float32 unless param_dtype says otherwise).
        opt_state: the optax state (moments; accumulated gradients under MultiSteps).
        rng: uint32[2] raw key data; dropout keys are `fold_in(fold_in(rng, step), device)`.
        tx: the optimiser (static, not saved).
    """
    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    tx: optax.GradientTransformation = struct.field(pytree_node=False)

    @classmethod
    def create(cls, params, tx: optax.GradientTransformation, seed: int) -> TrainState:
        return cls(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                   rng=jax.random.key_data(jax.random.key(seed)), tx=tx)

    def apply_gradients(self, grads) -> TrainState:
        updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
        return self.replace(step=self.step + 1, params=optax.apply_updates(self.params, updates),
                            opt_state=opt_state)


def learning_rate_schedule(learning_rate: float, warmup_steps: int, decay: str,
                           total_steps: int) -> optax.Schedule:
    """Linear warmup to `learning_rate`, then `rsqrt` (Vaswani et al.), `cosine` to 0 at
    `total_steps`, or `constant`. Every warmup starts at lr / warmup, never at 0, so the
    first update already moves the parameters:

        rsqrt:     lr * min(max(step, 1) / warmup, sqrt(warmup / max(step, 1)))
        cosine:    lr / warmup at step 0, linearly to lr at step warmup, then
                   lr * 0.5 * (1 + cos(pi * (step - warmup) / (total - warmup)))
        constant:  the same ramp, then lr
    """
    warmup = max(warmup_steps, 1)
    if decay == "rsqrt":
        def schedule(step):
            step = jnp.maximum(step.astype(jnp.float32) if hasattr(step, "astype") else
                               jnp.float32(step), 1.0)
            return learning_rate * jnp.minimum(step / warmup, jnp.sqrt(warmup / step))
        return schedule
    first = learning_rate / warmup
    if decay == "cosine":
        return optax.warmup_cosine_decay_schedule(first, learning_rate, warmup,
                                                  max(total_steps, warmup + 1))
    if decay == "constant":
        return optax.linear_schedule(first, learning_rate, warmup)
    raise UserError(f"lr_decay={decay!r} must be 'rsqrt', 'cosine' or 'constant'")


def make_optimizer(config) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """adamw behind global-norm clipping, wrapped in MultiSteps when accumulating.

    Config keys: learning_rate, warmup_steps, lr_decay, num_train_steps, adam_b1, adam_b2,
    adam_eps, weight_decay, grad_clip_norm (0 = off), grad_accum_steps.
    """
    schedule = learning_rate_schedule(config.learning_rate, config.warmup_steps,
                                      config.lr_decay, config.num_train_steps)
    parts = []
    if config.grad_clip_norm:
        parts.append(optax.clip_by_global_norm(config.grad_clip_norm))

    def decay_mask(params):
        return jax.tree.map(lambda p: p.ndim > 1, params)

    parts.append(optax.adamw(schedule, b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps,
                             weight_decay=config.weight_decay, mask=decay_mask))
    tx = optax.chain(*parts)
    if config.grad_accum_steps < 1:
        raise UserError(f"grad_accum_steps={config.grad_accum_steps} must be >= 1")
    if config.grad_accum_steps > 1:
        tx = optax.MultiSteps(tx, every_k_schedule=config.grad_accum_steps)
    return tx, schedule
