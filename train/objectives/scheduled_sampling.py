"""Scheduled sampling (Bengio et al., 2015), next-token prediction's option against exposure
bias: a second decoder pass in which a scheduled fraction of the gold decoder inputs is
replaced by the first pass's predictions.

    settings = ScheduledSampling(enabled=True, schedule="linear", max_rate=0.25,
                                 ramp_steps=1000)
    settings.rate(500)                      # 0.125: the probability of feeding a prediction
    mix_predictions(decoder_inputs, first_pass_logits, positions, segmentation,
                    rate=settings.rate(step), rng=key)

`ScheduledSampling` is the run config's `scheduled_sampling.*` keys (a part of
`train.run_config.ObjectiveSettings`), defaults and rules included.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from train.config_checks import Part, boolean, choice, fail, integer, number, setting

SCHEDULES = ("linear", "exponential", "inverse_sigmoid")


@dataclasses.dataclass(frozen=True)
class ScheduledSampling(Part):
    """The `scheduled_sampling.*` keys.

    Attributes:
        enabled: run the second pass (off: teacher forcing alone).
        schedule: how the rate rises with the step (see `rate`).
        max_rate: the rate the schedule tends to.
        ramp_steps: the linear schedule's steps to reach max_rate.
        k: the exponential (0 < k < 1) or inverse-sigmoid (k >= 1) schedule's constant.
    """

    prefix = "scheduled_sampling."
    enabled: bool = setting(False, boolean())
    schedule: str = setting("linear", choice(*SCHEDULES))
    max_rate: float = setting(0.25, number("in [0, 1]", lambda v: 0 <= v <= 1))
    ramp_steps: int = setting(1000, integer(1))
    k: float = setting(0.999, number("> 0", lambda v: v > 0))

    def check(self) -> None:
        if self.schedule == "exponential" and not 0 < self.k < 1:
            raise fail(self.prefix + "k", self.k,
                       "must be in (0, 1) for the exponential schedule")
        if self.schedule == "inverse_sigmoid" and not self.k >= 1:
            raise fail(self.prefix + "k", self.k,
                       "must be >= 1 for the inverse_sigmoid schedule")

    def rate(self, step) -> jax.Array:
        """The probability of feeding a prediction at training step `step`.

            linear:          max_rate * min(1, step / ramp_steps)
            exponential:     max_rate * (1 - k ** step)                  (0 < k < 1)
            inverse_sigmoid: max_rate * (1 - k / (k + exp(step / k)))    (k >= 1)
        """
        step = jnp.asarray(step, jnp.float32)
        if self.schedule == "linear":
            frac = jnp.minimum(1.0, step / max(self.ramp_steps, 1))
        elif self.schedule == "exponential":
            frac = 1.0 - jnp.power(self.k, step)
        else:
            frac = 1.0 - self.k / (self.k + jnp.exp(step / self.k))
        return self.max_rate * frac


def mix_predictions(decoder_inputs, logits_BTV, positions_BT, segmentation_BT, *, rate, rng):
    """Replaces each gold decoder input (not a segment's BOS) by the previous position's
    prediction with probability `rate`: rate 0 returns the inputs, rate 1 only predictions.

        decoder inputs  [BOS a1  a2  BOS b1]     predictions [p1 p2 p3 q1 q2]
        rate 1          [BOS p1  p2  BOS q1]     (each segment's BOS stays)
    """
    predicted = jnp.argmax(logits_BTV, axis=-1).astype(decoder_inputs.dtype)
    shifted = jnp.pad(predicted, ((0, 0), (1, 0)))[:, :-1]
    replace = (jax.random.uniform(rng, decoder_inputs.shape) < rate) & (positions_BT > 0) & (
        segmentation_BT > 0)
    return jnp.where(replace, shifted, decoder_inputs)
