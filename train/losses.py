"""Token losses for teacher forcing: cross-entropy with label smoothing and z-loss.

Losses return sums and the weight they were summed over, never means, so that a sum over
devices (or micro-batches) divided by the total weight is the loss of the whole batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
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


def confusion(logits_BTC: Float[Array, "B T C"], labels_BT: Int[Array, "B T"],
              weights_BT: Float[Array, "B T"]) -> dict[str, jax.Array]:
    """Per-class counts `[C]` of the argmax predictions at weighted positions:
    `true_positives`, `false_positives`, `false_negatives` (summable over devices)."""
    classes = logits_BTC.shape[-1]
    predicted_BTC = jax.nn.one_hot(jnp.argmax(logits_BTC, axis=-1), classes)
    gold_BTC = jax.nn.one_hot(labels_BT, classes)
    w_BT1 = weights_BT.astype(jnp.float32)[..., None]
    return {"true_positives": jnp.sum(predicted_BTC * gold_BTC * w_BT1, axis=(0, 1)),
            "false_positives": jnp.sum(predicted_BTC * (1 - gold_BTC) * w_BT1, axis=(0, 1)),
            "false_negatives": jnp.sum((1 - predicted_BTC) * gold_BTC * w_BT1, axis=(0, 1))}


def f1_scores(sums: dict, label_names: tuple[str, ...] = ()) -> dict[str, float]:
    """Host-side F1 of each class (`f1/NAME`, class index without names) and their mean
    (`macro_f1`) from `confusion` counts. A class never predicted nor present scores 0."""
    tp, fp, fn = (np.asarray(sums[k], np.float64) for k in (
        "true_positives", "false_positives", "false_negatives"))
    f1 = np.where(2 * tp + fp + fn > 0, 2 * tp / np.maximum(2 * tp + fp + fn, 1e-12), 0.0)
    names = label_names or tuple(str(c) for c in range(len(f1)))
    out = {f"f1/{name}": float(v) for name, v in zip(names, f1, strict=True)}
    out["macro_f1"] = float(np.mean(f1))
    return out
