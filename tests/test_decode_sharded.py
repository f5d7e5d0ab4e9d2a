"""Decoding with parameters split over a tensor axis of 4 (fake CPU) devices: the tokens
are the single-device ones, and the KV cache is split by kv heads, never held whole."""

import functools

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import decode
from decode.placement import cache_sharding
from models.axes import param_shardings
from tests.helpers import fns, random_tokens, tiny
from train.sharding import make_mesh

TENSOR = 4
N = 5                      # new tokens
PROMPT_LENGTHS = [3, 7]    # padded to width 8


# Llama 4's layers (`llama4_text`): a chunked RoPE layer with experts, then a full NoPE one
# with the dense MLP.
LLAMA4 = dict(positions="rope", norm="rmsnorm", activation="swiglu", use_bias=False,
              num_layers=2, layer_types=("chunked", "full"), attention_chunk_size=3,
              nope_layers=(1,), attn_temperature_floor=2, rope_interleaved=True,
              qk_l2_norm=True, num_experts=4, experts_per_token=1, router_score="sigmoid",
              router_scales_input=True, router_renormalize=False, shared_expert_mlp_dim=16,
              moe_layers=(0,))


# T5Gemma's layers (`t5gemma`): Gemma 2's in both stacks, the encoder's window two-sided.
T5GEMMA = dict(positions="rope", norm="rmsnorm", norm_scale_offset=1.0, activation="geglu",
               use_bias=False, share_embeddings=False, scale_embeddings=True,
               sublayer_output_norm=True, num_encoder_layers=2, num_decoder_layers=2,
               layer_types=("sliding", "full"), sliding_window=3, attn_logit_softcapping=5.0,
               final_logit_softcapping=3.0, query_pre_attn_scalar=8.0)
# DeepSeek-V3's layers (`deepseek_v3`): latent attention (the latent cache whole on every
# device: one "head"), a dense layer then group-limited, biased sigmoid routing.
DEEPSEEK_V3 = dict(positions="rope", norm="rmsnorm", activation="swiglu", use_bias=False,
                   num_layers=2, num_kv_heads=8, head_dim=12, kv_lora_rank=8, q_lora_rank=12,
                   qk_rope_head_dim=4, v_head_dim=6, rope_interleaved=True, num_experts=4,
                   experts_per_token=2, router_score="sigmoid", router_score_bias=True,
                   router_groups=2, router_top_groups=1, routed_scaling=2.0,
                   shared_expert_mlp_dim=16, moe_layers=(1,))
# Qwen3-Next's layers (`qwen3_next`): a Gated DeltaNet layer (its heads split over tensor,
# its recurrent state in the cache, not split) then gated attention; experts with a gated
# shared expert.
QWEN3_NEXT = dict(positions="rope", norm="rmsnorm", norm_scale_offset=1.0, activation="swiglu",
                  use_bias=False, num_layers=2, layer_types=("linear", "full"), qk_norm=True,
                  attention_output_gate=True, partial_rotary_factor=0.5,
                  linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8,
                  linear_value_head_dim=4, linear_chunk_size=4, num_experts=4,
                  experts_per_token=2, expert_mlp_dim=16, shared_expert_mlp_dim=16,
                  shared_expert_gate=True)
VARIANTS = {"llama4": ("decoder_only", LLAMA4), "t5gemma": ("encoder_decoder", T5GEMMA),
            "deepseek_v3": ("decoder_only", DEEPSEEK_V3),
            "qwen3_next": ("decoder_only", QWEN3_NEXT)}


@functools.cache
def setup(arch):
    """A GQA model (8 query heads, 4 kv heads, vocabulary 64: all divide the tensor axis),
    its parameters on one device and the same ones split over tensor = 4, and prompts.
    `arch` "llama4" or "t5gemma": its family with `VARIANTS`' layers."""
    arch, variant = VARIANTS.get(arch, (arch, {}))
    cfg = tiny(arch, **{
        **dict(num_heads=8, num_kv_heads=4, vocab_size=64, num_layers=1, num_encoder_layers=1,
               num_decoder_layers=1), **variant})
    f = fns(cfg)
    params = f.init()
    mesh = make_mesh((1, 1, TENSOR))
    sharded = jax.device_put(params, param_shardings(f.model, mesh))
    tokens = random_tokens(0, (len(PROMPT_LENGTHS), max(PROMPT_LENGTHS)), cfg.vocab_size)
    prompts, lengths = decode.pad_prompts(
        [tokens[b, :n].tolist() for b, n in enumerate(PROMPT_LENGTHS)])
    return f.model, params, sharded, mesh, prompts, lengths


def cache_split(lowered, cfg, rows: int, slots: int) -> tuple[bool, bool]:
    """(the compiled program holds the per-device K/V buffers [rows, K / 4, slots, H] (with
    a leading L when scanned), it holds the whole ones [rows, K, slots, H]), read off the
    partitioned HLO. A latent cache's one "head" cannot split: (False, True)."""
    text = lowered.compile().as_text()
    L, (K, H, _) = cfg.decoder_layers, cfg.cache_shape
    layers = f"{L}," if cfg.scan_layers else ""     # stacked, or one buffer per layer
    split, whole = (f"f32[{layers}{rows},{k},{slots},{H}]" for k in (K // TENSOR, K))
    return split in text, whole in text


def test_cache_sharding_follows_the_params_kv_heads():
    model, params, sharded, mesh, prompts, lengths = setup("encoder_decoder")
    assert cache_sharding(params) is None
    assert cache_sharding(sharded) == NamedSharding(mesh, P(None, None, "tensor", None, None))
    # Only sharded parameters add the static key: unsharded calls compile as before.
    _, static = decode.generate_arguments(model, params, prompts, lengths, max_new_tokens=N)
    assert "cache_sharding" not in static
    _, static = decode.beam_search_arguments(model, sharded, prompts, lengths,
                                             max_new_tokens=N)
    assert static["cache_sharding"] == cache_sharding(sharded)


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder", "llama4", "t5gemma",
                                  "deepseek_v3", "qwen3_next"])
def test_tensor_parallel_greedy_equals_one_device(arch):
    model, params, sharded, _, prompts, lengths = setup(arch)
    kw = dict(max_new_tokens=N, eos_id=None)
    one = decode.generate(model, params, prompts, lengths, **kw)
    split = decode.generate(model, sharded, prompts, lengths, **kw)
    np.testing.assert_array_equal(split.tokens, one.tokens)
    np.testing.assert_array_equal(split.lengths, one.lengths)
    np.testing.assert_allclose(split.logprobs, one.logprobs, rtol=1e-5, atol=1e-5)

    cfg, B, width = model.config, prompts.shape[0], prompts.shape[1]
    lowered = decode.generate.lower(model, sharded, prompts, lengths, **kw)
    assert cache_split(lowered, cfg, B, split.cache_len) == (not cfg.latent, cfg.latent)
    if cfg.is_encoder_decoder:   # cross K/V: one row per source, the source's slots
        assert cache_split(lowered, cfg, B, width) == (True, False)


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder", "t5gemma", "deepseek_v3",
                                  "qwen3_next"])
def test_tensor_parallel_beam_search_equals_one_device(arch):
    model, params, sharded, _, prompts, lengths = setup(arch)
    W = 3
    kw = dict(beam_size=W, max_new_tokens=N, length_penalty=0.6)
    one = decode.beam_search(model, params, prompts, lengths, **kw)
    split = decode.beam_search(model, sharded, prompts, lengths, **kw)
    np.testing.assert_array_equal(split.tokens, one.tokens)
    np.testing.assert_array_equal(split.lengths, one.lengths)
    np.testing.assert_allclose(split.scores, one.scores, rtol=1e-5, atol=1e-5)

    cfg, B, width = model.config, prompts.shape[0], prompts.shape[1]
    slots = (1 if cfg.is_encoder_decoder else width) + N
    # Self-attention: B * W rows of their own (gathered), or the table cache's B source
    # rows of W regions (models.BeamKVCache); cross-attention: B rows.
    for beam_cache, rows, self_slots in (("gathered", B * W, slots), ("table", B, W * slots)):
        lowered = decode.beam_search.lower(model, sharded, prompts, lengths,
                                           beam_cache=beam_cache, **kw)
        assert cache_split(lowered, cfg, rows, self_slots) == (not cfg.latent, cfg.latent)
        if cfg.is_encoder_decoder:
            assert cache_split(lowered, cfg, B, width) == (True, False)
