"""cuDNN's fused attention (`attention_impl="cudnn"`) against the materialised core, on a
GPU only: forward and gradients for every mask cuDNN takes (causal, sliding window, right
padding by lengths, cross-attention), grouped queries included; a Llama-style model's
logits and training gradients under `cudnn` and under `xla`; and `auto` choosing cuDNN
where it applies, with the compiled program really calling it.

Everything runs in bfloat16 (cuDNN's kernels run float16 and bfloat16); the oracle is the
materialised core on the same values in float32, and each implementation's bfloat16 error
against it is bounded alike. On a CPU the module is skipped (the refusals are tested in
tests/test_attention_impls.py); `python -m bench.accelerator` runs it on a GPU.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import kernels
from models.kernels import cudnn
from models.masks import MaskSpec
from tests.helpers import fns, random_tokens, tiny

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu",
                                reason="cuDNN's attention needs a GPU")

B, T, N, K, H = 2, 128, 8, 2, 64
BF16 = dict(atol=3e-2, rtol=3e-2)      # a few bfloat16 steps (eps 2^-8) on values of O(1)


def _qkv(seed, T=T, S=T, K=K):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(ks[0], (B, T, N, H)), jax.random.normal(ks[1], (B, S, K, H)),
            jax.random.normal(ks[2], (B, S, K, H)))


def _specs():
    """Every description cuDNN takes: T = S, teacher-forced; `cross` has S = 2T (made in
    the tests, not at import: collecting makes no array)."""
    index = jnp.broadcast_to(jnp.arange(T), (B, T))
    lengths = jnp.asarray([T, T - 37])
    valid = jnp.arange(T)[None, :] < lengths[:, None]
    cross_valid = jnp.arange(2 * T)[None, :] < jnp.asarray([[2 * T], [T + 9]])
    return {
        "none": MaskSpec(),
        "causal": MaskSpec(index, index, causal=True, aligned=True),
        "window": MaskSpec(index, index, causal=True, window=17, aligned=True),
        "causal_padded": MaskSpec(index, index, q_valid=valid, k_valid=valid, causal=True,
                                  aligned=True),
        "cross": MaskSpec(k_valid=cross_valid),
    }


KINDS = ("none", "causal", "window", "causal_padded", "cross")


def _rows(spec):
    """float32 [B, T, 1, 1]: 1 at the queries whose output means something (padded query
    rows are each implementation's own business)."""
    q_valid = jnp.ones((B, T), bool) if spec.q_valid is None else spec.q_valid
    return q_valid.astype(jnp.float32)[:, :, None, None]


def _run(impl, spec, q, k, v):
    scale = H ** -0.5
    if impl == "cudnn":
        return cudnn.cudnn_attention(q, k, v, spec, scale=scale)
    return kernels.xla_attention(q, k, v, spec, scale=scale)[0]


@pytest.mark.parametrize("kv_heads", [K, N])
@pytest.mark.parametrize("kind", KINDS)
def test_cudnn_equals_the_materialised_core_forward_and_gradients(kind, kv_heads):
    spec = _specs()[kind]
    q, k, v = _qkv(1, S=2 * T if kind == "cross" else T, K=kv_heads)
    q16, k16, v16 = (x.astype(jnp.bfloat16) for x in (q, k, v))
    assert cudnn.unsupported(q16, k16, spec, None, dropout_rate=0.0) is None
    rows = _rows(spec)
    w = jax.random.normal(jax.random.key(2), (B, T, N, H)) * rows

    def loss(impl):
        return lambda q, k, v: jnp.sum(_run(impl, spec, q, k, v).astype(jnp.float32) * w)

    oracle = _run("xla", spec, q16.astype(jnp.float32), k16.astype(jnp.float32),
                  v16.astype(jnp.float32)) * rows
    for impl in ("cudnn", "xla"):
        out = _run(impl, spec, q16, k16, v16).astype(jnp.float32) * rows
        chex.assert_tree_all_finite(out)
        np.testing.assert_allclose(out, oracle, **BF16, err_msg=f"{impl} forward")
    g_oracle = jax.grad(loss("xla"), argnums=(0, 1, 2))(
        *(x.astype(jnp.float32) for x in (q16, k16, v16)))
    scale = max(float(jnp.abs(g).max()) for g in g_oracle)
    g_cudnn = jax.jit(jax.grad(loss("cudnn"), argnums=(0, 1, 2)))(q16, k16, v16)
    for name, got, want in zip("qkv", g_cudnn, g_oracle, strict=True):
        chex.assert_tree_all_finite(got)
        np.testing.assert_allclose(got.astype(jnp.float32) / scale, want / scale, **BF16,
                                   err_msg=f"d{name}")


def test_auto_chooses_cudnn_for_bfloat16_training_attention_and_not_elsewhere():
    q, k, _ = (x.astype(jnp.bfloat16) for x in _qkv(3))
    causal = _specs()["causal"]
    assert kernels.choose("auto", q, k, causal) == "cudnn"
    assert kernels.choose("auto", q.astype(jnp.float32), k.astype(jnp.float32),
                          causal) in ("xla", "chunked")
    assert kernels.choose("auto", q, k, causal, with_probs=True) == "xla"
    offset = MaskSpec(jnp.broadcast_to(jnp.arange(T) + 3, (B, T)),
                      jnp.broadcast_to(jnp.arange(T), (B, T)), causal=True)
    assert kernels.choose("auto", q, k, offset) != "cudnn"          # a cached prefill


LLAMA = dict(positions="rope", norm="rmsnorm", activation="swiglu", use_bias=False,
             num_kv_heads=2, d_model=256, num_heads=4, mlp_dim=512, vocab_size=512,
             max_len=T, dtype="bfloat16")


@pytest.mark.parametrize("scan", [False, True])
def test_a_bfloat16_llama_under_cudnn_equals_xla_logits_and_gradients(scan):
    base = tiny("decoder_only", scan_layers=scan, **LLAMA)
    tokens = random_tokens(4, (B, T), base.vocab_size)
    results = {}
    for impl in ("cudnn", "xla"):
        f = fns(base.replace(attention_impl=impl))
        params = f.init()

        def loss(p, f=f):               # whole rows: no segment ids, which cuDNN refuses
            logits = f.model.apply({"params": p}, tokens).astype(jnp.float32)
            logp = jax.nn.log_softmax(logits[:, :-1])
            return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
        results[impl] = jax.jit(jax.value_and_grad(loss))(params)
    (l_cudnn, g_cudnn), (l_xla, g_xla) = results["cudnn"], results["xla"]
    np.testing.assert_allclose(l_cudnn, l_xla, rtol=1e-2)
    chex.assert_tree_all_finite(g_cudnn)
    for got, want in zip(jax.tree.leaves(g_cudnn), jax.tree.leaves(g_xla), strict=True):
        scale = float(jnp.abs(want.astype(jnp.float32)).max()) + 1e-6
        np.testing.assert_allclose(got.astype(jnp.float32) / scale,
                                   want.astype(jnp.float32) / scale, atol=5e-2)


def test_the_compiled_training_step_calls_cudnn_under_auto():
    cfg = tiny("decoder_only", **LLAMA)                         # attention_impl="auto"
    f = fns(cfg)
    params = f.init()
    tokens = random_tokens(5, (B, T), cfg.vocab_size)

    def loss(p):
        return jnp.mean(f.model.apply({"params": p}, tokens).astype(jnp.float32))
    lowered = jax.jit(jax.grad(loss)).lower(params).as_text()
    assert "__cudnn$fmhaSoftmax" in lowered and "__cudnn$fmhaSoftmaxBackward" in lowered
