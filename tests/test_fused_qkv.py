"""One product for a self-attention's queries, keys and values in the decoding step
(`models.attention.fuse_qkv`, applied by `decode.model_fns.model_step_fn`), and the
per-call host work of a decoding call done once per parameter structure
(`decode.placement`)."""

import re

import chex
import jax
import jax.numpy as jnp
import pytest

import decode
import models
from decode import placement
from models.attention import fuse_qkv
from models.lora import LoraConfig
from tests.helpers import fns, random_tokens, tiny

# Grouped kv heads, biased projections and q/k norms: every part the joined kernel must
# split back exactly.
GQA = dict(num_heads=4, num_kv_heads=2, qkv_bias=True, qk_norm=True, positions="rope",
           norm="rmsnorm")


@pytest.mark.parametrize("scan", [False, True])
def test_joined_projections_give_the_models_logits_forward_and_step(scan):
    cfg = tiny(**GQA, scan_layers=scan)
    f = fns(cfg)
    params = f.init()
    fused = fuse_qkv(params)
    attention = (fused["decoder"]["layers"] if scan else fused["decoder"]["layer_0"])[
        "self_attention"]
    assert not {"query", "key", "value"} & set(attention)
    L = (cfg.num_layers,) if scan else ()
    chex.assert_shape(attention["qkv_kernel"], (*L, cfg.d_model, 4 + 2 + 2, cfg.head_dim))
    chex.assert_shape(attention["qkv_bias"], (*L, 4 + 2 + 2, cfg.head_dim))
    assert {"query_norm", "key_norm", "out"} <= set(attention)   # the rest stays

    tokens = random_tokens(0, (2, 6), cfg.vocab_size)
    chex.assert_trees_all_close(f.forward(fused, tokens), f.forward(params, tokens),
                                atol=1e-6, rtol=1e-6)
    lengths = jnp.array([6, 4], jnp.int32)
    logits, cache = f.prefill(params, tokens, lengths, f.init_cache(params, 2, 10))
    nxt = jnp.argmax(logits[jnp.arange(2), lengths - 1], -1).astype(jnp.int32)
    want, want_cache = f.step(params, nxt, cache)
    got, got_cache = f.step(fused, nxt, cache)
    chex.assert_trees_all_close(got, want, atol=1e-6, rtol=1e-6)
    chex.assert_trees_all_close(got_cache, want_cache, atol=1e-6, rtol=1e-6)


def test_adapted_quantized_and_latent_projections_stay_apart():
    cfg = tiny(**GQA)
    params = fns(cfg).init()
    lora = cfg.replace(lora=LoraConfig(rank=2, alpha=4, targets=("query", "value")))
    adapted = fns(lora).init()
    assert jax.tree.structure(fuse_qkv(adapted)) == jax.tree.structure(adapted)
    quantized = models.quantize(params, cfg, "int8")
    assert jax.tree.structure(fuse_qkv(quantized)) == jax.tree.structure(quantized)
    wide = jax.tree.map(lambda x: x, params)        # a query twice as wide (a gated one)
    attention = wide["decoder"]["layer_0"]["self_attention"]
    attention["query"] = {k: jnp.concatenate([x, x], -1) for k, x in attention["query"].items()}
    assert "query" in fuse_qkv(wide)["decoder"]["layer_0"]["self_attention"]
    # Another layer's query, key and value (a Gated DeltaNet's) are not a self-attention's.
    other = {"layer_0": {"linear_attention": params["decoder"]["layer_0"]["self_attention"]}}
    assert jax.tree.structure(fuse_qkv(other)) == jax.tree.structure(other)
    # A tree of other projections (the cross-attention's query alone) is untouched.
    seq2seq = fns(tiny("encoder_decoder")).init()
    fused = fuse_qkv(seq2seq)
    assert "query" in fused["decoder"]["layer_0"]["cross_attention"]
    assert "qkv_kernel" in fused["decoder"]["layer_0"]["self_attention"]


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder"])
def test_the_decoding_step_reads_one_joined_kernel(arch):
    """generate's step multiplies by the joined [D, N+2K, H] kernel (the prefill by the
    three): the step is where a batch-1 product's fixed cost shows."""
    seq2seq = {k: v for k, v in GQA.items() if k != "qk_norm"}  # no norms across
    cfg = tiny(arch, **(GQA if arch == "decoder_only" else seq2seq))
    model, params = models.build(cfg), fns(cfg).init()
    prompts = random_tokens(1, (1, 5), cfg.vocab_size)
    lowered = decode.generate.lower(model, params, prompts, jnp.array([5], jnp.int32),
                                    max_new_tokens=3, eos_id=None)
    joined = f"{cfg.d_model},8,{cfg.head_dim}"
    assert re.search(rf"tensor<{cfg.d_model}x8x{cfg.head_dim}xf32>", lowered.as_text()), joined


def test_kv_kernels_are_found_per_tree_structure():
    """The kernels' positions are kept per structure: a second tree of another structure
    gets its own, and a tree of the same structure its own leaves."""
    a = {"layer": {"self_attention": {"key": {"kernel": 1}, "value": {"kernel": 2},
                                      "query": {"kernel": 3}}}}
    b = {"cross_kv": {"key_kernel": 4, "value_kernel": 5}, "other": {"kernel": 6}}
    assert placement._kv_kernels(a) == [1, 2]
    assert placement._kv_kernels(b) == [4, 5]
    same_as_a = jax.tree.map(lambda x: x * 10, a)
    assert placement._kv_kernels(same_as_a) == [10, 20]
