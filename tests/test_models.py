"""Model-level invariants: no leakage, padding, cross-attention, GQA, scan, dtypes."""

import chex
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import fns, random_tokens, tiny


def _with_delta(f, params, args, embed_name, delta, **kwargs):
    """Logits with `delta` added to the output of the InputEmbedding named `embed_name`."""

    def interceptor(next_fun, a, kw, context):
        out = next_fun(*a, **kw)
        if context.method_name == "__call__" and context.module.name == embed_name:
            return out + delta
        return out

    with nn.intercept_methods(interceptor):
        return f.model.apply({"params": params}, *args, **kwargs)


@pytest.mark.parametrize("arch,embed",
                         [("decoder_only", "embed"), ("encoder_decoder", "tgt_embed")])
def test_no_leakage_from_future_tokens(arch, embed):
    f = fns(tiny(arch, positions="rope", num_kv_heads=2))
    params = f.init()
    src = random_tokens(0, (2, 6), f.cfg.vocab_size)
    tgt = random_tokens(1, (2, 8), f.cfg.vocab_size)
    args = (src, tgt) if f.cfg.is_encoder_decoder else (tgt,)
    # 1. Gradients of output t with respect to every later input are exactly zero.
    zeros = jnp.zeros((2, 8, f.cfg.d_model))
    jac = jax.jit(jax.jacrev(lambda d: _with_delta(f, params, args, embed, d).sum(-1)))(zeros)
    influence = np.abs(np.asarray(jac)).sum(-1)          # [b, t, b', s]
    for t in range(8):
        if t < 7:
            assert influence[:, t, :, t + 1:].max() == 0.0, f"output {t} sees a later input"
        assert influence[0, t, 0, : t + 1].min() > 0.0, f"output {t} ignores an earlier input"
    assert influence[0, :, 1].max() == 0.0, "rows of a batch see each other"
    # 2. Changing the tokens after position t changes no output at or before t.
    t = 4
    changed = tgt.at[:, t + 1:].set(random_tokens(2, (2, 3), f.cfg.vocab_size))
    a = f.forward(params, *args)
    b = f.forward(params, *((src, changed) if f.cfg.is_encoder_decoder else (changed,)))
    np.testing.assert_array_equal(a[:, : t + 1], b[:, : t + 1])
    assert not np.allclose(a[:, t + 1:], b[:, t + 1:])


def test_source_padding_is_invisible():
    f = fns(tiny("encoder_decoder"))
    params = f.init()
    src = random_tokens(3, (2, 7), f.cfg.vocab_size)
    lengths = jnp.array([4, 7])            # row 0: 4 real tokens, then 3 of padding
    tgt = random_tokens(4, (2, 5), f.cfg.vocab_size)
    # No gradient reaches the decoder from the padded source positions...
    jac = jax.jit(jax.grad(lambda d: _with_delta(f, params, (src, tgt), "src_embed", d,
                                                 src_lengths=lengths).sum()))(
        jnp.zeros((2, 7, f.cfg.d_model)))
    assert float(jnp.abs(jac[0, 4:]).max()) == 0.0
    assert float(jnp.abs(jac[0, :4]).min(-1).max()) > 0.0
    # ...and more padding changes nothing.
    longer = jnp.pad(src, ((0, 0), (0, 5)))
    np.testing.assert_allclose(f.forward(params, src, tgt, src_lengths=lengths),
                               f.forward(params, longer, tgt, src_lengths=lengths),
                               atol=1e-5, rtol=0)


def test_decoder_depends_on_the_source():
    f = fns(tiny("encoder_decoder"))
    params = f.init()
    src = random_tokens(5, (2, 6), f.cfg.vocab_size)
    tgt = random_tokens(6, (2, 5), f.cfg.vocab_size)
    other = src.at[:, 2].set((src[:, 2] + 1) % f.cfg.vocab_size + 3)
    assert not np.allclose(f.forward(params, src, tgt), f.forward(params, other, tgt))


def test_cross_keys_values_are_projected_once_not_per_step():
    """After init_cache, steps never touch the cross-attention K/V projection: poisoning its
    kernels with NaN leaves every step's logits unchanged."""
    f = fns(tiny("encoder_decoder"))
    params = f.init()
    src = random_tokens(7, (2, 6), f.cfg.vocab_size)
    cache = f.init_cache(params, 2, 8, src=src)
    # The cache holds exactly the projection of the encoder output.
    encoded = f.model.apply({"params": params}, src, method="encode")
    k_LBKSH = jnp.einsum("BSD,LDKH->LBKSH", encoded, params["cross_kv"]["key_kernel"])
    k_LBKSH = k_LBKSH + params["cross_kv"]["key_bias"][:, None, :, None]
    np.testing.assert_allclose(cache.cross_k, k_LBKSH, atol=1e-5)
    poisoned = flax.core.copy(params, {"cross_kv": jax.tree.map(
        lambda x: jnp.full_like(x, jnp.nan), params["cross_kv"])})
    tokens = jnp.full((2,), f.cfg.bos_id, jnp.int32)
    c1, c2 = cache, cache
    for _ in range(3):
        l1, c1 = f.step(params, tokens, c1)
        l2, c2 = f.step(poisoned, tokens, c2)
        np.testing.assert_array_equal(l1, l2)
        tokens = jnp.argmax(l1, -1).astype(jnp.int32)


def test_grouped_query_model_equals_multi_head_model_with_repeated_kv_weights():
    gqa = fns(tiny(num_kv_heads=2, positions="rope"))
    mha = fns(tiny(num_kv_heads=4, positions="rope"))
    params = gqa.init()

    def repeat(x):  # kernel [D, K, H] / bias [K, H] -> 4 heads
        return jnp.repeat(x, 2, axis=-2)

    mha_params = jax.tree_util.tree_map_with_path(
        lambda path, x: (repeat(x) if any(getattr(p, "key", None) in ("key", "value")
                                          for p in path) else x),
        params)
    chex.assert_trees_all_equal_shapes(mha_params, mha.init())
    tokens = random_tokens(8, (2, 9), 61)
    np.testing.assert_allclose(gqa.forward(params, tokens), mha.forward(mha_params, tokens),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
def test_scanned_layers_equal_looped_layers(arch):
    loop, scan = fns(tiny(arch)), fns(tiny(arch, scan_layers=True))
    params = loop.init()

    def stack(tree):
        if not isinstance(tree, dict):
            return tree
        if "layer_0" in tree:
            layers = [tree.pop(f"layer_{i}") for i in range(2)]
            tree["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
        return {k: stack(v) for k, v in tree.items()}

    scan_params = stack(jax.tree.map(lambda x: x, params))
    chex.assert_trees_all_equal_shapes(scan_params, scan.init())
    tokens = random_tokens(9, (2, 6), 61)
    args = (tokens, tokens) if arch == "encoder_decoder" else (tokens,)
    np.testing.assert_allclose(loop.forward(params, *args), scan.forward(scan_params, *args),
                               atol=1e-5, rtol=0)


def test_attention_weights_are_sown():
    f = fns(tiny())
    params = f.init()
    tokens = random_tokens(10, (2, 5), 61)
    _, state = f.model.apply({"params": params}, tokens, mutable=["intermediates"])
    (probs,) = state["intermediates"]["decoder"]["layer_0"]["self_attention"]["attention_weights"]
    chex.assert_shape(probs, (2, 4, 5, 5))
    np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-6)
    assert float(jnp.triu(probs, k=1).max()) == 0.0  # causal


def test_dropout_is_active_only_when_not_deterministic():
    f = fns(tiny(dropout_rate=0.3, attention_dropout_rate=0.3))
    params = f.init()
    tokens = random_tokens(11, (2, 5), 61)

    def apply(det, seed):
        return f.model.apply(
            {"params": params}, tokens, deterministic=det, rngs={"dropout": jax.random.key(seed)})

    np.testing.assert_array_equal(apply(True, 0), apply(True, 1))
    assert not np.allclose(apply(False, 0), apply(False, 1))
    np.testing.assert_array_equal(apply(False, 0), apply(False, 0))


def test_bfloat16_compute_with_float32_params():
    f32 = fns(tiny(positions="rope"))
    bf16 = fns(tiny(positions="rope", dtype="bfloat16"))
    params = f32.init()
    tokens = random_tokens(12, (2, 6), 61)
    out = bf16.forward(params, tokens)
    assert out.dtype == jnp.float32
    assert jax.tree.leaves(params)[0].dtype == jnp.float32
    np.testing.assert_allclose(out, f32.forward(params, tokens), atol=0.1)
    cache = bf16.init_cache(params, 2, 8)
    assert all(k.dtype == jnp.bfloat16 for k in cache.k)           # one buffer per layer


@pytest.mark.parametrize("scan", [False, True])
def test_remat_changes_nothing_but_memory(scan):
    plain, remat = fns(tiny(scan_layers=scan)), fns(tiny(scan_layers=scan, remat=True))
    params = plain.init()
    tokens = random_tokens(13, (2, 6), 61)

    def loss(f, p):
        return jnp.mean(f.model.apply({"params": p}, tokens) ** 2)

    np.testing.assert_allclose(remat.forward(params, tokens), plain.forward(params, tokens),
                               atol=1e-6)
    chex.assert_trees_all_close(jax.jit(jax.grad(lambda p: loss(remat, p)))(params),
                                jax.jit(jax.grad(lambda p: loss(plain, p)))(params), atol=1e-6)
