"""Masked-LM corruption (BERT's objective): which tokens to predict and what the model sees.

Of the maskable tokens (real, not special), each is chosen with probability `rate`; a
chosen token is replaced by the mask id with probability `mask_fraction`, by a uniformly
random id with probability `random_fraction`, and otherwise left as it is. The loss is the
cross-entropy at the chosen positions only.

    tokens    [CLS] the  cat  sat  on   the  mat  [SEP] pad
    maskable    0    1    1    1    1    1    1     0    0
    chosen      0    0    1    0    0    0    1     0    0
    inputs    [CLS] the [MASK] sat on   the  dog  [SEP] pad    (mat -> random "dog")
    targets: "cat" and "mat" at the chosen positions, weight 1 there and 0 elsewhere

Every draw is a pure function of the step's key and each row's global index (`row_ids`):
row r uses `fold_in(key, r)`. So a batch split over devices, each masking its own rows
with their global indices, corrupts exactly what one device masking the whole batch does,
and a resumed run (same step keys) draws the same masks.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from models.errors import UserError


@dataclasses.dataclass(frozen=True)
class Masking:
    """The corruption's probabilities (config fields `mlm_rate`, `mlm_mask_fraction`,
    `mlm_random_fraction`), checked on construction."""

    rate: float = 0.15
    mask_fraction: float = 0.8
    random_fraction: float = 0.1

    def __post_init__(self):
        for name in ("rate", "mask_fraction", "random_fraction"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise UserError(f"masking {name}={value} must be in [0, 1]")
        if not 0.0 < self.rate:
            raise UserError(f"masking rate={self.rate} must be > 0 (nothing would be learned)")
        if self.mask_fraction + self.random_fraction > 1.0:
            raise UserError(f"masking mask_fraction={self.mask_fraction} plus random_fraction="
                             f"{self.random_fraction} exceeds 1")


def mask_tokens(
    key: jax.Array,
    tokens_BT: Int[Array, "B T"],
    maskable_BT: Bool[Array, "B T"],
    row_ids_B: Int[Array, " B"],
    *,
    mask_id: int,
    vocab_size: int,
    masking: Masking = Masking(),
) -> tuple[Int[Array, "B T"], Bool[Array, "B T"]]:
    """Returns (inputs_BT, chosen_BT): the corrupted tokens the model reads, and where the
    loss is taken (the targets are `tokens_BT` there). See the module docstring."""

    def one_row(row_id, tokens_T, maskable_T):
        k_choose, k_kind, k_random = jax.random.split(jax.random.fold_in(key, row_id), 3)
        chosen_T = maskable_T & jax.random.bernoulli(k_choose, masking.rate, tokens_T.shape)
        u_T = jax.random.uniform(k_kind, tokens_T.shape)
        random_T = jax.random.randint(k_random, tokens_T.shape, 0, vocab_size, tokens_T.dtype)
        corrupted_T = jnp.where(u_T < masking.mask_fraction, jnp.asarray(mask_id, tokens_T.dtype),
                                jnp.where(u_T < masking.mask_fraction + masking.random_fraction,
                                          random_T, tokens_T))
        return jnp.where(chosen_T, corrupted_T, tokens_T), chosen_T

    return jax.vmap(one_row)(row_ids_B, tokens_BT, maskable_BT)
