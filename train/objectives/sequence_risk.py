"""The sequence-level losses on candidates' log-probabilities and rewards: minimum risk
training's expected risk and self-critical REINFORCE's loss, per source, plus which
candidates repeat an earlier one. Pure functions of arrays (B sources, K candidates each,
W tokens per candidate); the rewards are constants here (computed on the host).

    logp_BK   the candidates' log-probabilities (sums of teacher-forced token log-probs)
    cost_BK   1 - reward
    keep_BK   the candidates that count (distinct, of a real source)

    risk_B = expected_risk(logp_BK, cost_BK, keep_BK, alpha=0.005)
    loss_B = self_critical(logp_BK, reward_BK, baseline_B, keep_BK)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def expected_risk(logp_BK: Float[Array, "B K"], cost_BK: Float[Array, "B K"],
                  keep_BK: Bool[Array, "B K"], *, alpha: float) -> Float[Array, " B"]:
    """Shen et al. (2016)'s risk: the expected cost under Q(y | x) ∝ p(y | x) ** alpha,
    renormalised over the source's kept candidates.

        q_j   = exp(alpha * logp_j) / sum_{kept i} exp(alpha * logp_i)
        risk  = sum_{kept j} q_j * cost_j
        d risk / d logp_j = alpha * q_j * (cost_j - risk)

    so a candidate cheaper than the risk gets its probability raised. A source with no kept
    candidate has risk 0 and no gradient.

    Example: logp [-1, -2], cost [0, 1], alpha 1: q = [0.731, 0.269], risk 0.269.
    """
    scores_BK = jnp.where(keep_BK, alpha * logp_BK.astype(jnp.float32), -jnp.inf)
    any_B1 = jnp.any(keep_BK, axis=-1, keepdims=True)
    q_BK = jax.nn.softmax(jnp.where(any_B1, scores_BK, 0.0), axis=-1)
    q_BK = jnp.where(keep_BK, q_BK, 0.0)
    return jnp.sum(q_BK * jnp.where(keep_BK, cost_BK, 0.0), axis=-1)


def self_critical(logp_BK: Float[Array, "B K"], reward_BK: Float[Array, "B K"],
                  baseline_B: Float[Array, " B"], keep_BK: Bool[Array, "B K"]
                  ) -> Float[Array, " B"]:
    """Rennie et al. (2017)'s loss: the mean over the source's kept samples of
    -(reward - baseline) * logp, the baseline being the greedy output's reward. Its gradient
    is REINFORCE's with that baseline: a sample scoring as the greedy output gets none, a
    better one is pushed up, a worse one down.

        d loss / d logp_j = -(reward_j - baseline) / (kept samples)
    """
    advantage_BK = jax.lax.stop_gradient(reward_BK - baseline_B[:, None])
    kept_B = jnp.maximum(jnp.sum(keep_BK, axis=-1), 1).astype(jnp.float32)
    terms_BK = jnp.where(keep_BK, -advantage_BK * logp_BK.astype(jnp.float32), 0.0)
    return jnp.sum(terms_BK, axis=-1) / kept_B


def first_occurrences(tokens_BKW: Int[Array, "B K W"], lengths_BK: Int[Array, "B K"]
                      ) -> Bool[Array, "B K"]:
    """True where a candidate differs from every earlier candidate of its source (tokens
    up to its length, and the length): the distinct candidates, each counted once, as Shen
    et al. count their sampled set.

        tokens [[5 1 0], [5 1 0], [6 1 0]], lengths [2, 2, 2]  ->  [True, False, True]
    """
    K, W = tokens_BKW.shape[1], tokens_BKW.shape[2]
    valid_BKW = jnp.arange(W)[None, None, :] < lengths_BK[..., None]
    shown_BKW = jnp.where(valid_BKW, tokens_BKW, -1)
    same_BKK = jnp.all(shown_BKW[:, :, None, :] == shown_BKW[:, None, :, :], axis=-1)
    earlier_KK = jnp.arange(K)[None, :] < jnp.arange(K)[:, None]      # [j, i]: i before j
    return ~jnp.any(same_BKK & earlier_KK[None], axis=-1)
