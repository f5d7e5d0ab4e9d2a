"""Token losses for teacher forcing: cross-entropy with label smoothing and z-loss.

Losses return sums and the weight they were summed over, never means, so that a sum over
devices (or micro-batches) divided by the total weight is the loss of the whole batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def smoothed_targets_constant(vocab_size: int, label_smoothing: float) -> float:
    """The entropy of the smoothed target distribution; subtracted so a perfect fit is 0."""
    confidence = 1.0 - label_smoothing
    low = label_smoothing / (vocab_size - 1)
    return -(confidence * jnp.log(confidence) + (vocab_size - 1) * low * jnp.log(low + 1e-20))


def cross_entropy(logits_BTV: Float[Array, "B T V"], targets_BT: Int[Array, "B T"],
                  weights_BT: Float[Array, "B T"], *, label_smoothing: float = 0.0,
                  z_loss: float = 0.0) -> dict[str, jax.Array]:
    """Weighted token cross-entropy against label-smoothed targets, plus optional z-loss.

    With smoothing e over V classes the target puts 1 - e on the gold token and e / (V - 1)
    on every other; the loss is the KL divergence to that distribution (cross-entropy minus
    its entropy). z-loss adds `z_loss * logsumexp(logits)**2` per token (PaLM), keeping the
    softmax normaliser near 1.

    Returns:
        sums over weighted tokens: `loss` (what to minimise, z-loss included), `nll`
        (unsmoothed negative log-likelihood), `z_loss`, `correct` (argmax hits), `weight`.
    """
    logits_BTV = logits_BTV.astype(jnp.float32)
    vocab = logits_BTV.shape[-1]
    log_z_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    gold_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
    nll_BT = log_z_BT - gold_BT
    if label_smoothing:
        low = label_smoothing / (vocab - 1)
        # -sum_v q_v log p_v with q = low everywhere plus (1 - e - low) on the gold token.
        mean_log_p_BT = jnp.sum(logits_BTV, axis=-1) - vocab * log_z_BT
        loss_BT = (-(low * mean_log_p_BT) + (1.0 - label_smoothing - low) * nll_BT
                   - smoothed_targets_constant(vocab, label_smoothing))
    else:
        loss_BT = nll_BT
    z_BT = z_loss * jnp.square(log_z_BT)
    w = weights_BT.astype(jnp.float32)
    correct = (jnp.argmax(logits_BTV, axis=-1) == targets_BT).astype(jnp.float32)
    return {"loss": jnp.sum((loss_BT + z_BT) * w), "nll": jnp.sum(nll_BT * w),
            "z_loss": jnp.sum(z_BT * w), "correct": jnp.sum(correct * w), "weight": jnp.sum(w)}
