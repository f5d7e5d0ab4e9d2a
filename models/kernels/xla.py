"""The materialised attention core (`xla`): the whole [B, N, T, S] logits and probabilities.

The reference the other implementations are held to, and the only one that can return the
probabilities (for inspection: the notebooks and tests sow them). Its memory grows with
T x S; `models.kernels.chunked` computes the same without that array.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from models.errors import UserError
from models.masks import MaskSpec
from models.numerics import MASKED_LOGIT


def dot_product_attention(
    q_BTNH: Float[Array, "B T N H"],
    k_BSKH: Float[Array, "Bk S K H"],
    v_BSKH: Float[Array, "Bk S K H"],
    mask_BTS: Bool[Array, "B T S"] | None = None,
    *,
    bias_BNTS: Float[Array, "B N T S"] | None = None,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    with_lse: bool = False,
    softcap: float | None = None,
) -> tuple[Float[Array, "B T N H"], Float[Array, "B N T S"]]:
    """softmax(scale * q k^T + bias, masked) v, with the softmax in float32.

    Args:
        q_BTNH: queries.
        k_BSKH, v_BSKH: keys and values with K heads, N % K == 0 (the values' width may
            differ from the keys': the output has the values'). Their batch Bk may divide
            B: then B = Bk * W and the W query rows of one key row (beams sharing one encoded
            source) attend to it without the keys being copied.
        mask_BTS: True where a query may see a key; broadcastable to [B, T, S]; None means
            everything is visible. A query row with no visible key returns zeros, not NaN.
        bias_BNTS: added to the logits before masking (T5's relative position bias);
            broadcastable to [B, N, T, S], float32 preferred; None adds nothing.
        scale: the logits' scale; None means 1 / sqrt(H).
        dropout_rate, dropout_rng: dropout on the probabilities (training only).

        with_lse: also return the log-sum-exp of each query's visible logits, lse_BTN
            (float32; -inf for a query that sees nothing), to merge this attention with
            another over other keys.
        softcap: None, or c: the scaled logits become c * tanh(logits / c) (in float32),
            before the bias and the mask (Gemma 2's attention soft-capping).

    Returns:
        out_BTNH in the dtype of v, and probs_BNTS (float32) for inspection (and lse_BTN).
    """
    B, T, N, H = q_BTNH.shape
    Bk, S, K, Hk = k_BSKH.shape
    if k_BSKH.shape[:3] != v_BSKH.shape[:3]:
        raise UserError(f"keys {k_BSKH.shape} and values {v_BSKH.shape} differ in [B, S, K]")
    if H != Hk or N % K or B % Bk:
        raise UserError(
            f"incompatible attention shapes: q {q_BTNH.shape} [B,T,N,H] vs k {k_BSKH.shape} "
            "[Bk,S,K,H] needs equal H, N divisible by K, B divisible by Bk")
    if mask_BTS is not None:
        if mask_BTS.ndim != 3:
            raise UserError(f"mask must be [B, T, S] (rank 3), got shape {mask_BTS.shape}")
        mask_BTS = jnp.broadcast_to(mask_BTS, (B, T, S))
    W, G = B // Bk, N // K
    scale = H ** -0.5 if scale is None else scale
    # Fold the W query rows that share one key row into its time axis, then the G query
    # heads of each kv head with them (M = G * Q): each dot is then one plain matrix
    # product per (row, kv head), in the layout the cache keeps keys in ([Bk, K, S, H]).
    # On a CPU this is 2x to 3x faster than a dot whose G and Q stay apart (measured in
    # the decode step, the prefill and the training step).
    Q = W * T
    q_BQKGH = q_BTNH.reshape(Bk, Q, K, G, H)
    if scale != 1.0:
        q_BQKGH = q_BQKGH * jnp.asarray(scale, q_BTNH.dtype)
    q_BKMH = q_BQKGH.transpose(0, 2, 3, 1, 4).reshape(Bk, K, G * Q, H)
    logits_BKMS = jnp.einsum("BKMH,BKSH->BKMS", q_BKMH, k_BSKH.transpose(0, 2, 1, 3),
                             preferred_element_type=jnp.float32)
    logits_BKGQS = logits_BKMS.reshape(Bk, K, G, Q, S)
    if softcap is not None:
        logits_BKGQS = jnp.tanh(logits_BKGQS / softcap) * softcap
    if bias_BNTS is not None:
        bias_BWKGTS = jnp.broadcast_to(bias_BNTS, (B, N, T, S)).reshape(Bk, W, K, G, T, S)
        bias_BKGQS = bias_BWKGTS.transpose(0, 2, 3, 1, 4, 5).reshape(Bk, K, G, W * T, S)
        logits_BKGQS = logits_BKGQS + bias_BKGQS.astype(jnp.float32)
    if mask_BTS is not None:
        mask_B11QS = mask_BTS.reshape(Bk, 1, 1, W * T, S)
        logits_BKGQS = jnp.where(mask_B11QS, logits_BKGQS, MASKED_LOGIT)
    probs_BKGQS = jax.nn.softmax(logits_BKGQS, axis=-1)
    if mask_BTS is not None:
        probs_BKGQS = jnp.where(mask_B11QS, probs_BKGQS, 0.0)
    out_BTNH, probs_BNTS = _weighted(probs_BKGQS, v_BSKH, (B, T, N, v_BSKH.shape[-1]),
                                     dropout_rate, dropout_rng)
    if not with_lse:
        return out_BTNH, probs_BNTS
    lse_BKGQ = jax.nn.logsumexp(logits_BKGQS, axis=-1)
    if mask_BTS is not None:                # a query that sees nothing: -inf, weight 0
        lse_BKGQ = jnp.where(mask_B11QS.any(-1), lse_BKGQ, -jnp.inf)
    lse_BTN = lse_BKGQ.reshape(Bk, K * G, W, T).transpose(0, 2, 3, 1).reshape(B, T, N)
    return out_BTNH, probs_BNTS, lse_BTN


def _weighted(probs_BKGQS, v_BSKH, shape, dropout_rate, dropout_rng):
    """(out_BTNH, probs_BNTS) from the probabilities of the folded queries."""
    B, T, N, H = shape
    Bk, K, G, _, S = probs_BKGQS.shape
    W = B // Bk
    if dropout_rate > 0.0 and dropout_rng is not None:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, probs_BKGQS.shape)
        probs_BKGQS = jnp.where(keep, probs_BKGQS / (1.0 - dropout_rate), 0.0)
    probs_BKMS = probs_BKGQS.reshape(Bk, K, G * W * T, S).astype(v_BSKH.dtype)
    out_BKMH = jnp.einsum("BKMS,BKSH->BKMH", probs_BKMS, v_BSKH.transpose(0, 2, 1, 3))
    out_BTNH = (out_BKMH.reshape(Bk, K, G, W, T, H).transpose(0, 3, 4, 1, 2, 5)
                .reshape(B, T, N, H))
    probs_BNTS = probs_BKGQS.reshape(Bk, K * G, W, T, S).transpose(0, 2, 1, 3, 4)
    return out_BTNH, probs_BNTS.reshape(B, N, T, S)


def xla_attention(q_BTNH, k_BSKH, v_BSKH, spec: MaskSpec, bias=None, *, scale: float,
                  dropout_rate: float = 0.0, dropout_rng=None, with_lse: bool = False,
                  softcap: float | None = None):
    """`dot_product_attention` of a mask description (`MaskSpec`) and a bias description
    (None, or a `models.relative.RelativeBias`), both materialised here."""
    B, Bk = q_BTNH.shape[0], k_BSKH.shape[0]
    if Bk != B:          # key-side rows repeated for the query rows that share them
        spec = spec.key_rows(lambda x: jnp.repeat(x, B // Bk, axis=0))
    mask = spec.materialize()
    return dot_product_attention(
        q_BTNH, k_BSKH, v_BSKH, None if mask is None else jnp.broadcast_to(
            mask, (B, q_BTNH.shape[1], k_BSKH.shape[1])),
        bias_BNTS=None if bias is None else bias.materialize(), scale=scale,
        dropout_rate=dropout_rate, dropout_rng=dropout_rng, with_lse=with_lse,
        softcap=softcap)
