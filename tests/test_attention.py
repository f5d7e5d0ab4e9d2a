"""The attention core against a plain reference, on random inputs with every mask kind."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models import masks


def reference_attention(q_BTNH, k_BSNH, v_BSNH, mask_BTS):
    """softmax(Q K^T / sqrt(d) + additive mask) V, one head at a time, in numpy float64."""
    q, k, v = (np.asarray(a, np.float64) for a in (q_BTNH, k_BSNH, v_BSNH))
    B, T, N, H = q.shape
    out = np.zeros((B, T, N, H))
    for b in range(B):
        for n in range(N):
            logits = q[b, :, n] @ k[b, :, n].T / np.sqrt(H)
            logits = np.where(np.asarray(mask_BTS[b]), logits, -np.inf)
            p = np.exp(logits - logits.max(-1, keepdims=True))
            out[b, :, n] = (p / p.sum(-1, keepdims=True)) @ v[b, :, n]
    return out


def _qkv(seed, B=2, T=5, S=7, N=4, K=4, H=8):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(ks[0], (B, T, N, H)), jax.random.normal(ks[1], (B, S, K, H)),
            jax.random.normal(ks[2], (B, S, K, H)))


def _mask_kinds(B, T, S):
    rng = np.random.default_rng(0)
    q_pos = jnp.broadcast_to(jnp.arange(S - T, S)[None, :], (B, T))
    k_pos = jnp.broadcast_to(jnp.arange(S)[None, :], (B, S))
    k_valid = jnp.arange(S)[None, :] < jnp.array([[S], [S - 3]])
    q_seg = jnp.asarray(rng.integers(1, 3, (B, T)))
    k_seg = jnp.asarray(rng.integers(1, 3, (B, S))).at[:, 0].set(1).at[:, 1].set(2)
    causal = masks.causal_mask(q_pos, k_pos)
    padding = masks.padding_mask(jnp.ones((B, T), bool), k_valid)
    segment = masks.segment_mask(q_seg, k_seg)
    return {
        "none": jnp.ones((B, T, S), bool),
        "causal": causal,
        "padding": padding,
        "segment": segment,
        "causal+padding+segment": masks.combine_masks(causal, padding, segment),
    }


@pytest.mark.parametrize("kind", list(_mask_kinds(2, 5, 7)))
def test_core_equals_reference(kind):
    q, k, v = _qkv(1)
    mask = _mask_kinds(2, 5, 7)[kind]
    assert bool(mask.any(-1).all()), "every row keeps a key, so the reference has no NaN"
    out, probs = models.dot_product_attention(q, k, v, mask)
    chex.assert_shape(out, (2, 5, 4, 8))
    chex.assert_shape(probs, (2, 4, 5, 7))
    np.testing.assert_allclose(out, reference_attention(q, k, v, mask), atol=1e-5, rtol=1e-5)
    # Probabilities are exactly zero where masked, and sum to one per row.
    assert float(jnp.where(mask[:, None], 0.0, probs).max()) == 0.0
    np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-6)


@pytest.mark.parametrize("K", [1, 2])
def test_grouped_query_equals_multi_head_with_repeated_kv(K):
    """Query head n reads key/value head n // G, i.e. MHA over K/V heads repeated G times."""
    q, k, v = _qkv(2, N=4, K=K)
    mask = _mask_kinds(2, 5, 7)["causal+padding+segment"]
    out, _ = models.dot_product_attention(q, k, v, mask)
    G = 4 // K
    mha, _ = models.dot_product_attention(q, jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2),
                                          mask)
    np.testing.assert_allclose(out, mha, atol=1e-6)
    np.testing.assert_allclose(
        out, reference_attention(q, jnp.repeat(k, G, 2), jnp.repeat(v, G, 2), mask), atol=1e-5)


def test_fully_masked_row_gives_zeros_not_nan():
    q, k, v = _qkv(3)
    mask = jnp.ones((2, 5, 7), bool).at[0, 2].set(False).at[1].set(False)
    out, probs = models.dot_product_attention(q, k, v, mask)
    chex.assert_tree_all_finite((out, probs))
    assert float(jnp.abs(out[0, 2]).max()) == 0.0 and float(jnp.abs(out[1]).max()) == 0.0
    assert float(jnp.abs(out[0, 1]).max()) > 0.0
    # And gradients through such rows stay finite.
    grads = jax.grad(lambda q: models.dot_product_attention(q, k, v, mask)[0].sum())(q)
    chex.assert_tree_all_finite(grads)


def test_shared_keys_for_folded_query_rows():
    """B = Bk * W query rows over Bk key rows equal attention over tiled keys (beams)."""
    q, k, v = _qkv(4, B=6)
    k, v = k[:2], v[:2]
    mask = jnp.repeat(jnp.arange(7)[None, None, :] < jnp.array([7, 4])[:, None, None], 3, 0)
    mask = jnp.broadcast_to(mask, (6, 5, 7))
    out, probs = models.dot_product_attention(q, k, v, mask)
    tiled, tiled_probs = models.dot_product_attention(
        q, jnp.repeat(k, 3, 0), jnp.repeat(v, 3, 0), mask)
    np.testing.assert_allclose(out, tiled, atol=1e-6)
    np.testing.assert_allclose(probs, tiled_probs, atol=1e-6)


def test_rope_scores_depend_only_on_relative_position():
    key1, key2 = jax.random.split(jax.random.key(5))
    q = jax.random.normal(key1, (1, 1, 1, 16))
    k = jax.random.normal(key2, (1, 1, 1, 16))

    inv_freq = models.rope_frequencies(16, 10_000.0)

    def score(m, n):
        qm = models.apply_rope(q, jnp.array([[m]]), inv_freq)
        kn = models.apply_rope(k, jnp.array([[n]]), inv_freq)
        return float(jnp.sum(qm * kn))

    assert abs(score(7, 3) - score(104, 100)) < 1e-4
    assert abs(score(7, 3) - score(3, 7)) > 1e-3
    np.testing.assert_allclose(models.apply_rope(q, jnp.array([[0]]), inv_freq), q, atol=0)


def test_bad_shapes_raise():
    q, k, v = _qkv(6, N=4, K=4)
    with pytest.raises(ValueError, match="incompatible attention shapes"):
        models.dot_product_attention(q, k[..., :4], v[..., :4])
    with pytest.raises(ValueError, match=r"differ in \[B, S, K\]"):
        models.dot_product_attention(q, k, v[:, :3])
    with pytest.raises(ValueError, match="rank 3"):
        models.dot_product_attention(q, k, v, jnp.ones((2, 1, 5, 7), bool))
    q3, _, _ = _qkv(6, N=3)
    with pytest.raises(ValueError, match="N divisible by K"):
        models.dot_product_attention(q3, k[:, :, :2], v[:, :, :2])


def test_values_of_another_width_than_the_keys_give_the_same_attention_in_xla_and_chunked():
    """Latent attention's values are narrower than its keys (and its step's are the keys'
    first numbers): both implementations give the output the values' width, and the same
    numbers and gradients as the attention written out."""
    from models.kernels import attend
    from models.masks import MaskSpec
    r = np.random.default_rng(3)
    q, k = (jnp.asarray(r.normal(size=(2, 5, 4, 12)), jnp.float32) for _ in range(2))
    k, v = k[:, :, :1], jnp.asarray(r.normal(size=(2, 5, 1, 8)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
    spec = MaskSpec(pos, pos, causal=True)

    def written_out(q, k, v):
        logits = jnp.einsum("btnh,bsh->bnts", q, k[:, :, 0]) * 0.3
        logits = jnp.where(np.tril(np.ones((5, 5), bool)), logits, -jnp.inf)
        return jnp.einsum("bnts,bsh->btnh", jax.nn.softmax(logits, -1), v[:, :, 0])

    want = written_out(q, k, v)
    want_grads = jax.grad(lambda *a: jnp.sum(written_out(*a) ** 2), argnums=(0, 1, 2))(q, k, v)
    for impl in ("xla", "chunked"):
        def out(q, k, v, impl=impl):
            return attend(q, k, v, spec, impl=impl, scale=0.3, block=2)[0]
        chex.assert_shape(out(q, k, v), (2, 5, 4, 8))
        np.testing.assert_allclose(out(q, k, v), want, atol=1e-6)
        grads = jax.grad(lambda *a: jnp.sum(out(*a) ** 2), argnums=(0, 1, 2))(q, k, v)
        chex.assert_trees_all_close(grads, want_grads, atol=1e-5)
