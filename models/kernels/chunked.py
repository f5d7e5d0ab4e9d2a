"""Memory-efficient exact attention in pure JAX: an online softmax over key blocks.

Queries are cut into blocks of `q_block` rows and keys into blocks of `k_block`; for each
query block the key blocks are visited in order, keeping per query row the running
maximum logit `m`, the running sum of exponentials `l` (`total` in the code) and the
running weighted sum of values `acc` (Rabe and Staats 2021; Dao et al. 2022):

    for each key block j:   s = scale q k_j^T + bias_j      (masked: MASKED_LOGIT)
                            m' = max(m, max_j s)
                            p = exp(s - m')                 (masked: 0)
                            l = l exp(m - m') + sum_j p
                            acc = acc exp(m - m') + p v_j
    out = acc / l,   lse = m + log l

so no `[T, S]` array of logits or probabilities exists, only one `[q_block, k_block]`
block per head at a time. The backward pass (`jax.custom_vjp`) keeps only `out` and `lse`
from the forward and recomputes each block's probabilities from them,
`P = exp(s - lse)`, then

    dV_j += P^T dO      dP = dO v_j^T      dS = P (dP - D),  D = rowsum(dO * out) - d(lse)
    dQ   += scale dS k_j                   dK_j += scale dS^T q
    d(bias) = dS (through the bias description's own vjp, block by block)

so the gradient's memory is linear in T too. A block that the mask hides entirely (keys
after a causal query block, outside a window, or padding) is skipped with `lax.cond` in
both passes. Attention dropout is applied block by block with a key folded from the block
indices, so the backward pass draws the same keep mask as the forward.

Shapes: queries [B, T, N, H], keys and values [Bk, S, K, H] with Bk dividing B (the
B / Bk query rows of one key row are folded into its time axis, as in the `xla` core) and
K dividing N (G = N / K query heads per key head; keys are never repeated).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from models.masks import MaskSpec
from models.numerics import MASKED_LOGIT

Q_BLOCK = 512
K_BLOCK = 512


def chunked_attention(q_BTNH, k_BSKH, v_BSKH, spec: MaskSpec, bias=None, *,
                      scale: float, dropout_rate: float = 0.0, dropout_rng=None,
                      q_block: int = Q_BLOCK, k_block: int = K_BLOCK, with_lse: bool = False,
                      softcap: float | None = None):
    """softmax(scale q k^T + bias, masked) v without a [T, S] array in either pass.

    Args:
        q_BTNH: queries; k_BSKH, v_BSKH: keys and values with K heads (K divides N) and
            Bk rows (Bk divides B); the values' width may differ from the keys' (the
            output has the values').
        spec: which keys each query sees (`models.masks.MaskSpec`, query side [B, T], key
            side [Bk, S]).
        bias: None, or a description with `rows(fold)` and `block(q_slice, k_slice)` ->
            float32[Bk, N, t, s] (`models.relative.RelativeBias`); its float leaves get
            gradients.
        scale: the logits' scale.
        dropout_rate, dropout_rng: dropout on the probabilities (training only).
        q_block, k_block: block sizes (smaller sequences are one block).
        with_lse: also return each query's log-sum-exp of its visible logits, lse_BTN
            (float32, -inf for a query that sees nothing), differentiable like `out`.
        softcap: None, or c: each block's scaled logits become c * tanh(logits / c) before
            the bias and the mask (the backward pass multiplies dS by 1 - tanh^2).

    Returns:
        out_BTNH in the dtype of v (and lse_BTN). A query that sees no key gives zeros.
    """
    B, T, N, H = q_BTNH.shape
    Bk, S, K, _ = k_BSKH.shape
    W, G = B // Bk, N // K
    Q = W * T
    bq, bk = min(q_block, Q), min(k_block, S)
    nq, nk = -(-Q // bq), -(-S // bk)
    spec, bias = spec.rows(W), None if bias is None else bias.rows(W)
    q = q_BTNH.reshape(Bk, Q, K, G, H)
    if scale != 1.0:
        q = q * jnp.asarray(scale, q.dtype)
    q, spec, bias = _pad_queries(q, spec, bias, nq * bq - Q)
    k, v, spec, bias = _pad_keys(k_BSKH, v_BSKH, spec, bias, nk * bk - S)
    plan = _Plan(bq=bq, bk=bk, nq=nq, nk=nk, dropout_rate=float(dropout_rate),
                 softcap=None if softcap is None else float(softcap))
    key_data = None
    if plan.dropout_rate > 0.0:
        key_data = (jax.random.key_data(dropout_rng)
                    if jnp.issubdtype(dropout_rng.dtype, jax.dtypes.prng_key) else dropout_rng)
    out, lse = _attention(plan, _Operands(q, k, v, spec, bias, key_data))
    out = out[:, :Q].reshape(B, T, N, v_BSKH.shape[-1]).astype(v_BSKH.dtype)
    if not with_lse:
        return out
    lse = jnp.where(jnp.isposinf(lse[..., :Q]), -jnp.inf, lse[..., :Q])   # [Bk, K, G, Q]
    return out, lse.reshape(Bk, K * G, W, T).transpose(0, 2, 3, 1).reshape(B, T, N)


@flax.struct.dataclass
class _Operands:
    """What the kernel differentiates: queries (scaled, padded, folded), keys, values, and
    the mask and bias descriptions and the dropout key (their cotangents are zeros, but
    the bias description's float leaves')."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    spec: MaskSpec
    bias: object
    key_data: jax.Array | None


class _Plan(NamedTuple):
    """The block sizes and counts, the dropout rate and the logit soft-cap (static)."""

    bq: int
    bk: int
    nq: int
    nk: int
    dropout_rate: float
    softcap: float | None = None


def _keep_scale(plan: _Plan, key_data, i, j, shape):
    """Attention dropout of block (i, j): 1 / (1 - rate) where kept, 0 where dropped,
    drawn from the key folded with i and j, so both passes draw the same mask."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(key_data), i), j)
    kept = jax.random.bernoulli(key, 1.0 - plan.dropout_rate, shape)
    return jnp.where(kept, 1.0 / (1.0 - plan.dropout_rate), 0.0)


def _pad_queries(q, spec: MaskSpec, bias, pad: int):
    """Query rows padded to whole blocks; padded rows are never read back."""
    if not pad:
        return q, spec, bias

    def rows(x):
        return None if x is None else jnp.pad(x, ((0, 0), (0, pad)), mode="edge")
    q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
    visible = spec.visible
    if visible is not None and visible.shape[1] > 1:
        visible = jnp.pad(visible, ((0, 0), (0, pad), (0, 0)), mode="edge")
    spec = spec.replace(q_index=rows(spec.q_index), q_segment=rows(spec.q_segment),
                        q_valid=rows(spec.q_valid), q_position=rows(spec.q_position),
                        visible=visible)
    if bias is not None:
        bias = bias.replace(q_pos=rows(bias.q_pos))
    return q, spec, bias


def _pad_keys(k, v, spec: MaskSpec, bias, pad: int):
    """Keys padded to whole blocks, the padding marked invalid so no query sees it."""
    if not pad:
        return k, v, spec, bias
    S = k.shape[1]

    def rows(x):
        return None if x is None else jnp.pad(x, ((0, 0), (0, pad)), mode="edge")
    widths = ((0, 0), (0, pad), (0, 0), (0, 0))
    valid = jnp.arange(S + pad)[None, :] < S
    if spec.k_valid is not None:
        valid = valid & jnp.pad(spec.k_valid, ((0, 0), (0, pad)))
    visible = spec.visible
    if visible is not None:
        visible = jnp.pad(visible, ((0, 0), (0, 0), (0, pad)))
    spec = spec.key_rows(rows).replace(
        k_valid=jnp.broadcast_to(valid, (k.shape[0], S + pad)), visible=visible)
    if bias is not None:
        bias = bias.replace(k_pos=rows(bias.k_pos))
    return jnp.pad(k, widths), jnp.pad(v, widths), spec, bias


def _query_blocks(plan: _Plan, x):
    """[Bk, Q, K, G, H] -> [nq, Bk, K, G * bq, H]: block i's queries of each kv head as one
    matrix (its G heads' rows one after another), so a block's dots are plain matrix
    products (on a CPU 2x to 3x faster than dots that keep G and the rows apart)."""
    Bk, _, K, G, H = x.shape
    x = x.reshape(Bk, plan.nq, plan.bq, K, G, H).transpose(1, 0, 3, 4, 2, 5)
    return x.reshape(plan.nq, Bk, K, G * plan.bq, H)


def _key_blocks(plan: _Plan, x):
    """[Bk, S, K, H] -> [nk, Bk, K, bk, H]."""
    Bk, _, K, H = x.shape
    return x.reshape(Bk, plan.nk, plan.bk, K, H).transpose(1, 0, 3, 2, 4)


def _fold(x):
    """[Bk, K, G, bq, n] -> [Bk, K, G * bq, n]: a block's heads' rows as one matrix."""
    Bk, K, G, bq, n = x.shape
    return x.reshape(Bk, K, G * bq, n)


def _unfold(x, G: int):
    """[Bk, K, G * bq, n] -> [Bk, K, G, bq, n]."""
    Bk, K, M, n = x.shape
    return x.reshape(Bk, K, G, M // G, n)


def _block(plan: _Plan, spec: MaskSpec, bias, q_i, k_j, *, i, j):
    """One block's float32 logits [Bk, K, G, bq, bk] (soft-capped, bias added, hidden keys
    at MASKED_LOGIT), its mask [Bk, 1, 1, bq, bk] (None: nothing hidden) and the slope of
    the soft-cap, d capped / d logits = 1 - tanh^2 (None without one), from the block's
    queries q_i [Bk, K, G * bq, H] and keys k_j [Bk, K, bk, H]."""
    Bk, K, M, _ = q_i.shape
    G, bq = M // plan.bq, plan.bq
    q_slice, k_slice = (i * plan.bq, plan.bq), (j * plan.bk, plan.bk)
    s = _unfold(jnp.einsum("BKMH,BKkH->BKMk", q_i, k_j, preferred_element_type=jnp.float32), G)
    slope = None
    if plan.softcap is not None:
        tanh = jnp.tanh(s / plan.softcap)
        s, slope = tanh * plan.softcap, 1.0 - tanh * tanh
    if bias is not None:
        s = s + bias.block(q_slice, k_slice).reshape(Bk, K, G, bq, plan.bk)
    mask = spec.block(q_slice, k_slice)
    if mask is None:
        return s, None, slope
    mask = jnp.broadcast_to(mask, (Bk, bq, plan.bk))[:, None, None]
    return jnp.where(mask, s, MASKED_LOGIT), mask, slope


def _visible(plan: _Plan, spec: MaskSpec, i, j):
    """Whether block (i, j) has any visible entry (traced bool), or True without a mask."""
    mask = spec.block((i * plan.bq, plan.bq), (j * plan.bk, plan.bk))
    return True if mask is None else jnp.any(mask)


def _tied(q, spec: MaskSpec, bias):
    """`spec` and `bias` passed through one optimisation barrier with `q`.

    Their arrays are often the same in every layer (positions 0 .. T-1), so without the
    barrier JAX's scan partial evaluation finds every block's mask loop-invariant and
    hoists them out of a scanned stack: all [q_block, k_block] masks at once, a [T, S]
    array. Tied to `q`, which differs per layer, they are computed block by block.
    """
    q, spec, bias = lax.optimization_barrier((q, spec, bias))
    return q, spec, bias


def _forward(plan: _Plan, ops: _Operands):
    """(out float32 [Bk, Q, K, G, H], lse float32 [Bk, K, G, Q]) of padded inputs."""
    k, v, key_data = ops.k, ops.v, ops.key_data
    q, spec, bias = _tied(ops.q, ops.spec, ops.bias)
    Bk, Qp, K, G, H = q.shape
    q_blocks = _query_blocks(plan, q)
    k_blocks, v_blocks = _key_blocks(plan, k), _key_blocks(plan, v)

    def one_query_block(i):
        q_i = q_blocks[i]

        def step(carry, j):
            def update(carry):
                m, total, acc = carry
                s, mask, _ = _block(plan, spec, bias, q_i, k_blocks[j], i=i, j=j)
                m_new = jnp.maximum(m, s.max(-1))
                p = jnp.exp(s - m_new[..., None])
                if mask is not None:
                    p = jnp.where(mask, p, 0.0)
                correction = jnp.exp(m - m_new)
                total = total * correction + p.sum(-1)
                if key_data is not None:
                    p = p * _keep_scale(plan, key_data, i, j, p.shape)
                pv = jnp.einsum("BKMk,BKkH->BKMH", _fold(p).astype(v.dtype), v_blocks[j],
                                preferred_element_type=jnp.float32)
                return m_new, total, acc * correction[..., None] + _unfold(pv, G)

            visible = _visible(plan, spec, i, j)
            if visible is True:
                return update(carry), None
            return lax.cond(visible, update, lambda c: c, carry), None

        init = (jnp.full((Bk, K, G, plan.bq), MASKED_LOGIT, jnp.float32),
                jnp.zeros((Bk, K, G, plan.bq), jnp.float32),
                jnp.zeros((Bk, K, G, plan.bq, v.shape[-1]), jnp.float32))
        (m, total, acc), _ = lax.scan(step, init, jnp.arange(plan.nk))
        seen = total > 0.0
        total = jnp.where(seen, total, 1.0)
        out = jnp.where(seen[..., None], acc / total[..., None], 0.0)
        lse = jnp.where(seen, m + jnp.log(total), jnp.inf)
        return out, lse

    out, lse = lax.map(one_query_block, jnp.arange(plan.nq))
    # [nq, Bk, K, G, bq, H] -> [Bk, Q, K, G, H];  [nq, Bk, K, G, bq] -> [Bk, K, G, Q]
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(Bk, Qp, K, G, v.shape[-1])
    lse = lse.transpose(1, 2, 3, 0, 4).reshape(Bk, K, G, Qp)
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(plan, ops: _Operands):
    """(out [Bk, Q, K, G, H] in v's dtype, lse float32 [Bk, K, G, Q]; +inf where a query
    sees nothing)."""
    out, lse = _forward(plan, ops)
    return out.astype(ops.v.dtype), lse


def _attention_fwd(plan, ops: _Operands):
    out, lse = _forward(plan, ops)
    out = out.astype(ops.v.dtype)
    return (out, lse), (ops, out, lse)


def _attention_bwd(plan, residuals, cotangents):
    ops, out, lse = residuals
    q, k, v, spec, bias, key_data = ops.q, ops.k, ops.v, ops.spec, ops.bias, ops.key_data
    d_out, d_lse = cotangents
    q, spec, bias = _tied(q, spec, bias)
    Bk, Qp, K, G, H = q.shape
    q_blocks, do_blocks = _query_blocks(plan, q), _query_blocks(plan, d_out)
    k_blocks, v_blocks = _key_blocks(plan, k), _key_blocks(plan, v)
    lse_blocks = lse.reshape(Bk, K, G, plan.nq, plan.bq)
    # D_i = rowsum(dO * out) less d(lse)_i (d lse / d s = P): [Bk, K, G, nq, bq]
    d_rows = jnp.einsum("BQKGH,BQKGH->BKGQ", d_out.astype(jnp.float32),
                        out.astype(jnp.float32))
    d_rows = (d_rows - jnp.where(jnp.isfinite(lse), d_lse, 0.0)).reshape(
        Bk, K, G, plan.nq, plan.bq)
    bias_zero = None if bias is None else _float_zeros(bias)

    def one_key_block(carry, j):
        dq, d_bias = carry
        k_j, v_j = k_blocks[j], v_blocks[j]

        def step(inner, i):
            def update(inner):
                dk_j, dv_j, dq, d_bias = inner
                q_i, do_i = q_blocks[i], do_blocks[i]
                s, mask, slope = _block(plan, spec, bias, q_i, k_j, i=i, j=j)
                p = jnp.exp(s - lse_blocks[:, :, :, i][..., None])
                if mask is not None:
                    p = jnp.where(mask, p, 0.0)
                dp = _unfold(jnp.einsum("BKMH,BKkH->BKMk", do_i, v_j,
                                        preferred_element_type=jnp.float32), G)
                p_kept = p
                if key_data is not None:
                    factor = _keep_scale(plan, key_data, i, j, p.shape)
                    p_kept, dp = p * factor, dp * factor
                dv_j = dv_j + jnp.einsum("BKMk,BKMH->BKkH", _fold(p_kept).astype(do_i.dtype),
                                         do_i, preferred_element_type=jnp.float32)
                ds = p * (dp - d_rows[:, :, :, i][..., None])
                ds_m = _fold(ds if slope is None else ds * slope)   # through the soft-cap
                dq_i = jnp.einsum("BKMk,BKkH->BKMH", ds_m.astype(k_j.dtype), k_j,
                                  preferred_element_type=jnp.float32)
                dk_j = dk_j + jnp.einsum("BKMk,BKMH->BKkH", ds_m.astype(q_i.dtype), q_i,
                                         preferred_element_type=jnp.float32)
                dq = lax.dynamic_update_index_in_dim(dq, dq[i] + dq_i, i, axis=0)
                if bias is not None:
                    d_bias = _add(d_bias, _bias_vjp(plan, bias, ds, i, j))
                return dk_j, dv_j, dq, d_bias

            visible = _visible(plan, spec, i, j)
            if visible is True:
                return update(inner), None
            return lax.cond(visible, update, lambda c: c, inner), None

        init = (jnp.zeros((Bk, K, plan.bk, H), jnp.float32),
                jnp.zeros((Bk, K, plan.bk, v.shape[-1]), jnp.float32), dq, d_bias)
        (dk_j, dv_j, dq, d_bias), _ = lax.scan(step, init, jnp.arange(plan.nq))
        return (dq, d_bias), (dk_j, dv_j)

    dq0 = jnp.zeros(q_blocks.shape, jnp.float32)
    (dq, d_bias), (dk, dv) = lax.scan(one_key_block, (dq0, bias_zero), jnp.arange(plan.nk))
    # [nq, Bk, K, G * bq, H] -> [Bk, Q, K, G, H];  [nk, Bk, K, bk, H] -> [Bk, S, K, H]
    dq = (dq.reshape(plan.nq, Bk, K, G, plan.bq, H).transpose(1, 0, 4, 2, 3, 5)
          .reshape(q.shape).astype(q.dtype))
    dk = dk.transpose(1, 0, 3, 2, 4).reshape(k.shape).astype(k.dtype)
    dv = dv.transpose(1, 0, 3, 2, 4).reshape(v.shape).astype(v.dtype)
    return (_Operands(dq, dk, dv, _no_cotangent(ops.spec), _with_int_zeros(ops.bias, d_bias),
                      None if key_data is None else _zero_cotangent(key_data)),)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _bias_vjp(plan: _Plan, bias, ds, i, j):
    """The cotangent of the bias description's float leaves from one block's dS."""
    Bk, K, G, bq, bk = ds.shape
    q_slice, k_slice = (i * plan.bq, plan.bq), (j * plan.bk, plan.bk)
    _, vjp = jax.vjp(lambda b: b.block(q_slice, k_slice), bias)
    (d,) = vjp(ds.reshape(Bk, K * G, bq, bk))
    return _floats(d)


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def _floats(tree):
    """The float leaves of a cotangent tree (others as None)."""
    return jax.tree.map(lambda x: x if _is_float(x) else None, tree)


def _float_zeros(tree):
    return jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32) if _is_float(x) else None,
                        tree)


def _add(a, b):
    return jax.tree.map(lambda x, y: None if x is None else x + y.astype(x.dtype), a, b,
                        is_leaf=lambda x: x is None)


def _zero_cotangent(x):
    return (jnp.zeros(x.shape, x.dtype) if _is_float(x)
            else np.zeros(x.shape, jax.dtypes.float0))


def _no_cotangent(tree):
    return jax.tree.map(_zero_cotangent, tree)


def _with_int_zeros(primal, floats):
    """A cotangent for `primal`: its float leaves from `floats`, zeros (float0) elsewhere."""
    if primal is None:
        return None
    return jax.tree.map(lambda x, d: (d.astype(x.dtype) if _is_float(x) else _zero_cotangent(x)),
                        primal, floats, is_leaf=lambda x: x is None)


def block_count(length: int, block: int) -> int:
    """Blocks of `block` covering `length` (one when it is shorter)."""
    return max(1, math.ceil(length / block))
