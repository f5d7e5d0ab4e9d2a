"""Gemma 2 and Gemma 3 (text): the layer variants they need, then models.load against
transformers' logits and models.save back to its tensors.

1. The variants, on their own: attention logit soft-capping and per-layer kinds (sliding or
   full, with their own RoPE bases) give the same numbers under xla and chunked attention and
   under looped and scanned layers, and a ragged prefill then cached steps give the forward
   pass's logits for every kind across the window.
2. The families (as tests/test_pretrained_2025.py does for qwen3 and gemma): tiny random
   transformers models whose windows are shorter than the sequence, so every sliding and
   full pattern crosses its window, give the same logits forward (to 1e-5) and through a
   ragged prefill then cached steps; greedy decoding equals `generate`; load then save is
   bit for bit; bfloat16 loads exactly; refused values are named; the presets have
   transformers' parameter counts for the published configs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models.kernels import attend
from models.masks import MaskSpec, positions_like
from tests import pretrained_helpers as ph
from tests.helpers import fns, random_tokens, tiny

highest_precision = ph.highest_precision          # the shared fixture
ATOL = 1e-5

# ---------------------------------------------------------------------------------------------
# 1. The variants.


def _reference(q, k, v, mask, scale, cap):
    """softmax(cap * tanh(scale q k^T / cap), masked) v in numpy float64, heads equal in
    number (the oracle)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    logits = np.einsum("btnh,bsnh->bnts", q, k) * scale
    logits = np.tanh(logits / cap) * cap
    logits = np.where(mask[:, None], logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnh->btnh", probs, v)


@pytest.mark.parametrize("window_on", [None, True, False])
def test_soft_capping_and_windows_are_the_same_in_xla_and_chunked_attention(
        window_on, highest_precision):
    B, T, N, H, cap, W = 2, 11, 2, 8, 2.0, 3
    kq, kk, kv, kg = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (B, T, N, H)) * 3.0      # logits beyond the cap
    k = jax.random.normal(kk, (B, T, N, H)) * 3.0
    v = jax.random.normal(kv, (B, T, N, H))
    index = positions_like(q[..., 0, 0])
    flag = None if window_on is None else jnp.asarray(window_on)
    spec = MaskSpec(index, index, causal=True, window=W, window_on=flag, aligned=True)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    mask = (j <= i) & ((j > i - W) | (window_on is False))
    want = _reference(q, k, v, np.broadcast_to(mask, (B, T, T)), H ** -0.5, cap)
    d_out = jax.random.normal(kg, (B, T, N, H))

    def run(impl):
        def f(q, k, v):
            out = attend(q, k, v, spec, impl=impl, scale=H ** -0.5, softcap=cap, block=4)[0]
            return out, jnp.sum(out * d_out)
        out, _ = f(q, k, v)
        grads = jax.grad(lambda *a: f(*a)[1], argnums=(0, 1, 2))(q, k, v)
        return out, grads

    (out_x, grads_x), (out_c, grads_c) = run("xla"), run("chunked")
    np.testing.assert_allclose(out_x, want, atol=1e-5, rtol=0)
    np.testing.assert_allclose(out_c, want, atol=1e-5, rtol=0)
    for gx, gc in zip(grads_x, grads_c, strict=True):
        np.testing.assert_allclose(gc, gx, atol=1e-5, rtol=0)
    uncapped = attend(q, k, v, spec, impl="xla", scale=H ** -0.5)[0]
    assert not np.allclose(uncapped, out_x, atol=1e-2)          # the cap changed something


def _kinds_config(**overrides) -> models.TransformerConfig:
    """Sliding, full, sliding layers (window 3 over 12 tokens) with every Gemma 2 / 3 part."""
    fields = dict(positions="rope", norm="rmsnorm", norm_scale_offset=1.0, activation="geglu",
                  use_bias=False, num_layers=3, num_kv_heads=2, head_dim=8, sliding_window=3,
                  layer_types=("sliding", "full", "sliding"), rope_local_theta=100.0,
                  rope_theta=10_000.0, attn_logit_softcapping=1.5, final_logit_softcapping=4.0,
                  sublayer_output_norm=True, query_pre_attn_scalar=20.0, qk_norm=True,
                  scale_embeddings=True)
    return tiny(**{**fields, **overrides})


def _randomized(params, seed: int = 1):
    """Every parameter random (norm scales too), so no part is the identity."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [jax.random.normal(key, x.shape, x.dtype) * 0.3
                                     for key, x in zip(keys, leaves, strict=True)])


def test_per_layer_kinds_agree_looped_scanned_xla_chunked_and_cached(highest_precision):
    cfg = _kinds_config()
    params = _randomized(fns(cfg).init())
    tokens = random_tokens(0, (2, 12), cfg.vocab_size)
    want = fns(cfg).forward(params, tokens)
    scanned = cfg.replace(scan_layers=True)
    stacked = ph.stack_layers(params)
    for other, p in ((cfg.replace(attention_impl="chunked", attention_block=4), params),
                     (scanned, stacked),
                     (scanned.replace(attention_impl="chunked", attention_block=4), stacked),
                     (scanned.replace(remat=True), stacked),
                     (cfg.replace(remat=True), params)):
        np.testing.assert_allclose(fns(other).forward(p, tokens), want, atol=ATOL, rtol=0,
                                   err_msg=str(other.scan_layers))
    # A ragged prefill then cached steps, looped and scanned: each kind across its window.
    lens = np.array([2, 5])
    for c, p in ((cfg, params), (scanned, stacked)):
        f = fns(c)
        cache = models.KVCache.create(c, 2, 16)
        logits, cache = f.prefill(p, tokens[:, :5], jnp.asarray(lens, jnp.int32), cache)
        for b, n in enumerate(lens):
            np.testing.assert_allclose(logits[b, :n], want[b, :n], atol=ATOL, rtol=0)
        for i in range(12 - 5):
            at = lens + i
            step, cache = f.step(p, tokens[np.arange(2), at], cache)
            np.testing.assert_allclose(step, want[np.arange(2), at], atol=ATOL, rtol=0,
                                       err_msg=f"step {i}, scanned {c.scan_layers}")


@pytest.mark.parametrize("change", [
    dict(layer_types=("full", "full", "sliding")), dict(rope_local_theta=None),
    dict(attn_logit_softcapping=None), dict(final_logit_softcapping=None),
    dict(query_pre_attn_scalar=None)])
def test_each_variant_changes_the_logits(change):
    cfg = _kinds_config()
    params = _randomized(fns(cfg).init())
    tokens = random_tokens(0, (2, 12), cfg.vocab_size)
    other = cfg.replace(**change)
    assert not np.allclose(fns(other).forward(params, tokens),
                           fns(cfg).forward(params, tokens), atol=1e-3)


def test_sublayer_output_norms_are_parameters_of_their_own():
    layer = fns(_kinds_config()).init()["decoder"]["layer_0"]
    assert {"self_attention_output_norm", "mlp_output_norm"} <= set(layer)
    assert "mlp_output_norm" not in fns(_kinds_config(sublayer_output_norm=False)).init()[
        "decoder"]["layer_0"]


@pytest.mark.parametrize("fields,words", [
    (dict(layer_types=("full", "sliding")), ["layer_types", "num_layers=3"]),
    (dict(layer_types=("full", "local", "full")), ["layer_types", "'local'"]),
    (dict(sliding_window=None), ["'sliding'", "sliding_window=None"]),
    (dict(attn_logit_softcapping=0.0), ["attn_logit_softcapping=0.0"]),
    (dict(final_logit_softcapping=-1.0), ["final_logit_softcapping=-1.0"]),
    (dict(query_pre_attn_scalar=4.0, scale_attention=False), ["query_pre_attn_scalar"]),
    (dict(sublayer_output_norm=True, norm_position="post"), ["sublayer_output_norm"]),
    (dict(positions="learned"), ["rope_local_theta", "positions='rope'"]),
])
def test_inconsistent_variant_fields_are_refused_by_name(fields, words):
    with pytest.raises(ValueError) as info:
        _kinds_config(**fields)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
