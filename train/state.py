"""TrainState and the optax optimiser: adamw, warmup then rsqrt or cosine, clipping,
accumulation."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import struct
from flax.core import meta

from models import lora
from models.errors import UserError


class EvalParams(NamedTuple):
    """What the eval step reads when the state keeps a reference copy (preference and
    GRPO training in full fine-tuning): the model's parameters and the frozen reference's.
    A pytree like any tuple, so it shards and replicates as its parts do."""

    model: Any
    reference: Any


@struct.dataclass
class TrainState:
    """Everything a training run carries from step to step.

    Attributes:
        step: optimiser updates applied so far (int32 scalar).
        params: the trained parameters (float32 unless param_dtype says otherwise): the
            whole model's, or an adapted model's adapters alone (`models.lora`).
        opt_state: the optax state (moments; accumulated gradients under MultiSteps), for
            `params` only.
        rng: uint32[2] raw key data; dropout keys are `fold_in(fold_in(rng, step), device)`.
        tx: the optimiser (static, not saved).
        frozen: an adapted model's base weights, which never train (None otherwise).
            Checkpoints leave them out: a resumed run reads them from `init_from` again.
        reference: a frozen copy of the whole model as the run started, for an objective
            that compares the trained model with it (full fine-tuning with DPO,
            `train.objectives.preference`); None otherwise. Checkpoints leave it out.
    """
    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    tx: optax.GradientTransformation = struct.field(pytree_node=False)
    frozen: Any = None
    reference: Any = None

    @classmethod
    def create(cls, params, tx: optax.GradientTransformation, seed: int, *,
               base_dtype=None, quantize_base=None, reference: bool = False) -> TrainState:
        """A fresh state of `params` (the model's whole tree). Where it holds adapters
        (`models.lora`), only they train: the rest is `frozen`, stored in `base_dtype`
        (None: as given) and then, with `quantize_base` (a function of the base tree, such
        as `models.quantize` with its config and scheme), quantized; the optimiser state
        covers the adapters alone. With `reference` (a model without adapters), the state
        also keeps a frozen copy of `params` (`reference`)."""
        base, adapters = lora.split(params)
        frozen = None
        kept = jax.tree.map(jnp.copy, params) if reference and not adapters else None
        if adapters:
            frozen = base if base_dtype is None else jax.tree.map(
                lambda x: x.astype(base_dtype), base)
            if quantize_base is not None:
                frozen = quantize_base(frozen)
            params = adapters
        return cls(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                   rng=jax.random.key_data(jax.random.key(seed)), tx=tx, frozen=frozen,
                   reference=kept)

    @property
    def model_params(self):
        """The model's whole parameter tree: `params`, joined with the frozen base of an
        adapted model (no copy: the same leaves)."""
        return self.params if self.frozen is None else lora.join(self.frozen, self.params)

    @property
    def eval_params(self):
        """What the eval step reads (`train.step.eval_step`): `model_params`, or with a
        `reference`, `EvalParams(model_params, reference)`."""
        if self.reference is None:
            return self.model_params
        return EvalParams(self.model_params, self.reference)

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


def make_optimizer(settings, total_steps: int, *, frozen: tuple[str, ...] = ()
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """adamw behind global-norm clipping, wrapped in MultiSteps when accumulating.

    Args:
        settings: a `train.run_config.OptimizerSettings` (learning_rate, warmup_steps,
            lr_decay, adam_b1, adam_b2, adam_eps, weight_decay, grad_clip_norm (0 = off),
            grad_accum_steps).
        total_steps: the run's optimiser steps (`num_train_steps`), where cosine reaches 0.
        frozen: top-level parameter names (a Whisper's `src_embed` and `encoder`) that never
            train: `optax.multi_transform` gives them `set_to_zero` (zero updates, no
            moments, no accumulated gradients, left out of clipping's norm) and everything
            else the optimiser above.

    Returns:
        (the optimiser, its learning-rate schedule in optimiser updates).
    """
    schedule = learning_rate_schedule(settings.learning_rate, settings.warmup_steps,
                                      settings.lr_decay, total_steps)
    parts = []
    if settings.grad_clip_norm:
        parts.append(optax.clip_by_global_norm(settings.grad_clip_norm))

    def decay_mask(params):
        return jax.tree.map(lambda p: p.ndim > 1, params)

    parts.append(optax.adamw(schedule, b1=settings.adam_b1, b2=settings.adam_b2,
                             eps=settings.adam_eps, weight_decay=settings.weight_decay,
                             mask=decay_mask))
    tx = optax.chain(*parts)
    if settings.grad_accum_steps > 1:
        tx = optax.MultiSteps(tx, every_k_schedule=settings.grad_accum_steps)
    if frozen:
        tx = optax.multi_transform({"trained": tx, "frozen": optax.set_to_zero()},
                                   functools.partial(_labels, frozen=frozenset(frozen)))
    return tx, schedule


def _labels(params, *, frozen: frozenset[str]):
    """"frozen" on every leaf under a top-level name in `frozen`, else "trained". A boxed
    parameter (`flax.core.meta.Partitioned`, as `train.sharding` traces the state) is one
    leaf, so a frozen one is masked whole and its logical names never reach a moment that
    is not there."""
    return {name: jax.tree.map(lambda _, n=name: "frozen" if n in frozen else "trained", sub,
                               is_leaf=lambda x: isinstance(x, meta.AxisMetadata))
            for name, sub in params.items()}
