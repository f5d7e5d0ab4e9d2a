"""The attention implementations against the materialised core: `chunked` equals `xla` in
its forward pass and its gradients, for every mask description the models build and for
both generative families and the encoder-only one; `auto` and the refusals.

Blocks of 4 (8 for the kernel tests) make every sequence here span several query and key
blocks, so the online softmax's recurrence across blocks, the skipped blocks and the
padding of the last block are all exercised.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models import kernels
from models.errors import UserError
from models.kernels.chunked import chunked_attention
from models.masks import MaskSpec
from models.relative import RelativeBias
from tests.helpers import fns, random_tokens, tiny
from tests.test_parity import COVER, KV_HEADS, SEQ2SEQ_VARIANTS, _check_parity

ATOL = 2e-5


def _qkv(seed, B=2, T=13, S=13, N=4, K=2, H=8, Bk=None):
    ks = jax.random.split(jax.random.key(seed), 3)
    Bk = B if Bk is None else Bk
    return (jax.random.normal(ks[0], (B, T, N, H)), jax.random.normal(ks[1], (Bk, S, K, H)),
            jax.random.normal(ks[2], (Bk, S, K, H)))


def _specs(B, T, S):
    """Every kind of description the models make, for T queries over S keys."""
    rng = np.random.default_rng(0)
    index = jnp.broadcast_to(jnp.arange(T), (B, T))
    slots = jnp.broadcast_to(jnp.arange(S), (B, S))
    offset = jnp.asarray([[S - T], [S - T - 2]]) + jnp.arange(T)[None, :]   # cached positions
    seg = jnp.asarray(rng.integers(0, 3, (B, T)))                     # 0: padding
    valid = jnp.arange(S)[None, :] < jnp.asarray([[S], [S - 5]])
    return {
        "none": MaskSpec(),
        "causal": MaskSpec(index, index, causal=True, aligned=True),
        "window": MaskSpec(index, index, causal=True, window=3, aligned=True),
        "segments": MaskSpec(index, index, seg, seg, causal=True, aligned=True),
        "padding": MaskSpec(q_valid=valid[:, :T], k_valid=valid[:, :S] if T == S else valid),
        "cached": MaskSpec(offset, slots, causal=True, window=5),
        "cross": MaskSpec(k_valid=valid),
    }


KINDS = list(_specs(2, 13, 13))


def _both(q, k, v, spec, bias=None, block=8, **kw):
    xla, _ = kernels.xla_attention(q, k, v, spec, bias, scale=q.shape[-1] ** -0.5, **kw)
    chunked = chunked_attention(q, k, v, spec, bias, scale=q.shape[-1] ** -0.5,
                                q_block=block, k_block=block, **kw)
    return xla, chunked


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_equals_xla_forward_and_gradients_for_every_mask(kind):
    T = 13
    S = 17 if kind in ("cached", "cross") else T
    q, k, v = _qkv(1, T=T, S=S)
    spec = _specs(2, T, S)[kind]
    xla, chunked = _both(q, k, v, spec)
    chex.assert_trees_all_close(chunked, xla, atol=ATOL)
    w = jax.random.normal(jax.random.key(2), xla.shape)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * w)
    g_xla = jax.grad(loss(lambda *a: _both(*a, spec)[0]), argnums=(0, 1, 2))(q, k, v)
    g_chunked = jax.grad(loss(lambda *a: _both(*a, spec)[1]), argnums=(0, 1, 2))(q, k, v)
    chex.assert_trees_all_close(g_chunked, g_xla, atol=ATOL)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_the_relative_bias_and_its_table_gradient_are_computed_per_block(bidirectional):
    T = 21
    q, k, v = _qkv(3, T=T, S=T)
    index = jnp.broadcast_to(jnp.arange(T), (2, T))
    spec = MaskSpec(index, index, causal=not bidirectional, aligned=True)
    table = jax.random.normal(jax.random.key(4), (8, 4))

    def out(which, table):
        bias = RelativeBias(table, index, index, bidirectional=bidirectional, num_buckets=8,
                            max_distance=12)
        return _both(q, k, v, spec, bias)[which]
    chex.assert_trees_all_close(out(1, table), out(0, table), atol=ATOL)
    w = jax.random.normal(jax.random.key(5), (2, T, 4, 8))
    grads = [jax.grad(lambda t, i=i: jnp.sum(out(i, t) * w))(table) for i in (0, 1)]
    chex.assert_trees_all_close(grads[1], grads[0], atol=ATOL)
    assert float(jnp.abs(grads[0]).max()) > 0.1     # the table does get a gradient


@pytest.mark.parametrize("K", [4, 1])
def test_grouped_queries_and_beams_sharing_keys(K):
    """K kv heads for 4 query heads (GQA, MQA), and 3 query rows per key row (beams over
    one source), with the source's padding on the key side."""
    q, k, v = _qkv(6, B=6, T=5, S=19, K=K, Bk=2)
    spec = MaskSpec(k_valid=jnp.arange(19)[None, :] < jnp.asarray([[19], [11]]))
    xla, chunked = _both(q, k, v, spec, block=4)
    chex.assert_trees_all_close(chunked, xla, atol=ATOL)


def test_a_query_that_sees_no_key_gives_zeros_and_finite_gradients():
    q, k, v = _qkv(7, T=9, S=9)
    spec = MaskSpec(k_valid=jnp.zeros((2, 9), bool).at[0].set(True))
    out = chunked_attention(q, k, v, spec, scale=0.35, q_block=4, k_block=4)
    np.testing.assert_array_equal(out[1], 0.0)
    grads = jax.grad(lambda q, k, v: jnp.sum(chunked_attention(
        q, k, v, spec, scale=0.35, q_block=4, k_block=4) ** 2), argnums=(0, 1, 2))(q, k, v)
    chex.assert_tree_all_finite(grads)


def test_dropout_uses_one_mask_in_both_passes_and_keeps_the_expectation():
    q, k, v = _qkv(8, B=1, T=6, S=6, N=2, K=2, H=4)
    spec = MaskSpec()

    def f(q, k, v, key=None):
        key = jax.random.key(0) if key is None else key
        return chunked_attention(q, k, v, spec, scale=0.5, dropout_rate=0.3,
                                 dropout_rng=key, q_block=4, k_block=4)
    # The gradient is that of the function with its drawn mask held fixed.
    jax.test_util.check_grads(f, (q, k, v), order=1, modes=["rev"], atol=2e-2, rtol=2e-2)
    keys = jax.random.split(jax.random.key(1), 400)
    mean = jnp.mean(jax.vmap(lambda key: f(q, k, v, key))(keys), axis=0)
    plain = chunked_attention(q, k, v, spec, scale=0.5, q_block=4, k_block=4)
    np.testing.assert_allclose(mean, plain, atol=0.15)


# The central parity (forward = prefill = steps) under chunked attention, blocks of 4.
CHUNKED = dict(attention_impl="chunked", attention_block=4)


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
@pytest.mark.parametrize("kv,positions,scan", COVER[:3])
def test_forward_prefill_step_parity_under_chunked_attention(arch, kv, positions, scan):
    _check_parity(tiny(arch, num_kv_heads=KV_HEADS[kv], positions=positions,
                       scan_layers=scan, **CHUNKED))


@pytest.mark.parametrize("arch,name", [("encoder_decoder", "t5"), ("decoder_only", "t5"),
                                       ("encoder_decoder", "bart")])
def test_checkpoint_variants_under_chunked_attention(arch, name):
    _check_parity(tiny(arch, **SEQ2SEQ_VARIANTS[name], **CHUNKED))


def test_sliding_window_under_chunked_attention():
    _check_parity(tiny("decoder_only", positions="rope", num_kv_heads=2, sliding_window=4,
                       **CHUNKED))


def _packed_batch(cfg, T=12):
    """A packed row of two examples and a row with padding, with per-segment positions."""
    seg = jnp.array([[1] * 5 + [2] * 6 + [0], [1] * 9 + [0] * 3])
    pos = jnp.array([list(range(5)) + list(range(6)) + [0], list(range(9)) + [0] * 3])
    return random_tokens(11, (2, T), cfg.vocab_size), seg, pos


def _grads_of_both(cfg, loss):
    out = []
    for impl in ("xla", "chunked"):
        f = fns(cfg.replace(attention_impl=impl))
        params = f.init()
        out.append(jax.jit(jax.value_and_grad(lambda p, f=f: loss(f, p)))(params))
    return out


@pytest.mark.parametrize("variant", ["gqa-window-rope", "t5-relative"])
def test_training_gradients_of_chunked_equal_xla_decoder_only(variant):
    extra = (dict(num_kv_heads=2, sliding_window=3, positions="rope") if variant.startswith("gqa")
             else dict(SEQ2SEQ_VARIANTS["t5"]))
    cfg = tiny("decoder_only", attention_block=4, **extra)
    tokens, seg, pos = _packed_batch(cfg)

    def loss(f, p):
        logits = f.forward(p, tokens, segment_ids=seg, positions=pos)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 7] * (seg > 0))
    (l_xla, g_xla), (l_chunked, g_chunked) = _grads_of_both(cfg, loss)
    np.testing.assert_allclose(l_chunked, l_xla, atol=1e-6)
    chex.assert_trees_all_close(g_chunked, g_xla, atol=ATOL)


def test_training_gradients_of_chunked_equal_xla_encoder_decoder_packed():
    cfg = tiny("encoder_decoder", attention_block=4, num_kv_heads=2, **{
        k: v for k, v in SEQ2SEQ_VARIANTS["t5"].items()})
    src, src_seg, src_pos = _packed_batch(cfg)
    tgt = random_tokens(12, (2, 12), cfg.vocab_size)

    def loss(f, p):
        logits = f.forward(p, src, tgt, src_segment_ids=src_seg, tgt_segment_ids=src_seg,
                           src_positions=src_pos, tgt_positions=src_pos)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 5] * (src_seg > 0))
    (l_xla, g_xla), (l_chunked, g_chunked) = _grads_of_both(cfg, loss)
    np.testing.assert_allclose(l_chunked, l_xla, atol=1e-6)
    chex.assert_trees_all_close(g_chunked, g_xla, atol=ATOL)


def test_encoder_only_under_chunked_equals_xla_with_padding_and_segments():
    cfg = tiny("encoder_only", attention_block=4, num_token_types=2, positions="learned")
    tokens, seg, pos = _packed_batch(cfg)
    lengths = jnp.array([12, 9])

    def loss(f, p):
        a = f.forward(p, tokens, segment_ids=seg, positions=pos)
        b = f.forward(p, tokens, lengths=lengths)
        return jnp.mean(a[..., 3] * (seg > 0)) + jnp.mean(b[:, :9, 4])
    (l_xla, g_xla), (l_chunked, g_chunked) = _grads_of_both(cfg, loss)
    np.testing.assert_allclose(l_chunked, l_xla, atol=1e-6)
    chex.assert_trees_all_close(g_chunked, g_xla, atol=ATOL)


def test_auto_picks_xla_for_short_attention_and_probabilities_chunked_for_long():
    def shapes(T, S):
        return (jax.ShapeDtypeStruct((1, T, 8, 64), jnp.float32),
                jax.ShapeDtypeStruct((1, S, 8, 64), jnp.float32))
    assert kernels.choose("auto", *shapes(1, 65536), MaskSpec()) == "xla"    # a decode step
    assert kernels.choose("auto", *shapes(512, 512), MaskSpec()) == "xla"
    assert kernels.choose("auto", *shapes(4096, 4096), MaskSpec()) == "chunked"
    assert kernels.choose("auto", *shapes(4096, 4096), MaskSpec(), with_probs=True) == "xla"
    assert kernels.choose("chunked", *shapes(8, 8), MaskSpec()) == "chunked"


def test_what_an_implementation_cannot_compute_is_refused_by_name():
    q, k = (jax.ShapeDtypeStruct((1, 8, 4, 16), jnp.float32),) * 2
    with pytest.raises(UserError, match="attention_impl='chunked' does not compute the "
                                        "attention probabilities"):
        kernels.choose("chunked", q, k, MaskSpec(), with_probs=True)
    why = (r"its kernels run float16 or bfloat16, not float32" if jax.default_backend() == "gpu"
           else rf"it needs a GPU \(the backend is {jax.default_backend()}\)")
    with pytest.raises(UserError, match=r"attention_impl='cudnn' cannot compute this "
                                        r"attention: " + why):
        kernels.choose("cudnn", q, k, MaskSpec())
    with pytest.raises(UserError, match=r"attention_impl='flash' is not one of"):
        models.TransformerConfig(attention_impl="flash")
    cfg = tiny(attention_impl="chunked")
    f = fns(cfg)
    with pytest.raises(UserError, match="only 'xla' does"):
        f.model.apply({"params": f.init()}, random_tokens(1, (1, 6), 61),
                      mutable=["intermediates"])


def test_remat_policies_change_nothing_but_memory():
    base = tiny("decoder_only", num_kv_heads=2, positions="rope")
    tokens = random_tokens(13, (2, 9), base.vocab_size)
    grads = []
    for extra in ({}, dict(remat=True), dict(remat=True, remat_policy="dots"),
                  dict(remat=True, remat_policy="names")):
        f = fns(base.replace(**extra))
        params = f.init()
        grads.append(jax.grad(lambda p, f=f: jnp.sum(f.forward(p, tokens)[..., 5]))(params))
    for g in grads[1:]:
        chex.assert_trees_all_close(g, grads[0], atol=1e-5)
    with pytest.raises(UserError, match="remat_policy='dots' chooses what remat keeps"):
        base.replace(remat_policy="dots")
