"""Mixtral and Qwen3-MoE: models.load against transformers' logits, models.save back.

The checks of tests/test_pretrained_2025.py for the mixture-of-experts families: tiny random
transformers models (4 experts, top 2; a sliding window; Qwen3-MoE with and without
`norm_topk_prob`) give the same logits loaded here, teacher-forced, scanned, and through a
ragged prefill then cached steps, with either dispatch (`moe_dispatch`); greedy decoding
equals transformers' `generate`; load then save gives the tensors transformers wrote
(per-expert, as `save_pretrained` writes them) bit for bit, and transformers v5 reads them
back with the same logits; a bfloat16 checkpoint loads exactly; refused values are named;
and the mixtral-8x7b and qwen3-30b-a3b presets have transformers' parameter counts.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import models
from models.pretrained import FAMILIES
from tests import pretrained_helpers as ph
from tests.helpers import fns
from tests.pretrained_helpers import (
    SPECIAL,
    assert_same_params,
    assert_same_tensors,
    copy_dir,
    edit_config,
    hf_load,
    hf_logits,
    set_fields,
    stack_layers,
)
from tests.test_pretrained_2025 import _our_count, _their_count

highest_precision = ph.highest_precision
ATOL = 1e-5
_SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=32, rms_norm_eps=1e-5,
              num_experts_per_tok=2, **SPECIAL)

# name -> (model_type, transformers config class, its fields, what our config must say).
CASES = {
    "mixtral-gqa-window-4": ("mixtral", "MixtralConfig", dict(
        _SMALL, num_key_value_heads=2, num_local_experts=4, sliding_window=4,
        router_aux_loss_coef=0.02), dict(
        num_experts=4, experts_per_token=2, expert_width=48, router_renormalize=True,
        sliding_window=4, num_kv_heads=2, router_aux_loss_coef=0.02, use_bias=False,
        rope_theta=1_000_000.0, tie_embeddings=False)),
    "mixtral-top-3-tied": ("mixtral", "MixtralConfig", dict(
        _SMALL, vocab_size=72, num_key_value_heads=4, num_local_experts=5,
        num_experts_per_tok=3, tie_word_embeddings=True), dict(
        num_experts=5, experts_per_token=3, sliding_window=None, tie_embeddings=True)),
    "qwen3-moe-head-dim": ("qwen3_moe", "Qwen3MoeConfig", dict(
        _SMALL, num_key_value_heads=2, head_dim=12, num_experts=4, moe_intermediate_size=16,
        norm_topk_prob=False), dict(
        num_experts=4, expert_width=16, mlp_dim=48, router_renormalize=False, qk_norm=True,
        head_dim=12, rope_theta=10_000.0)),
    "qwen3-moe-renormalised-window-4": ("qwen3_moe", "Qwen3MoeConfig", dict(
        _SMALL, num_key_value_heads=1, num_experts=6, num_experts_per_tok=3,
        moe_intermediate_size=24, norm_topk_prob=True, use_sliding_window=True,
        sliding_window=4), dict(
        num_experts=6, experts_per_token=3, expert_width=24, router_renormalize=True,
        sliding_window=4, head_dim=8)),
}


ckpt, _ = ph.checkpoints(CASES, "hf_checkpoints_moe", first_seed=500)


def test_save_pretrained_writes_each_expert_apart(ckpt):
    """The layout the loader reads: transformers v5 fuses experts in memory and splits them
    again when saving, as the published checkpoints hold them."""
    from safetensors import safe_open
    for name, key in (("mixtral-gqa-window-4", "model.layers.1.block_sparse_moe.experts.3.w2"),
                      ("qwen3-moe-head-dim", "model.layers.1.mlp.experts.3.down_proj")):
        with safe_open(os.path.join(ckpt(name).path, "model.safetensors"), "np") as f:
            keys = set(f.keys())
        assert f"{key}.weight" in keys
        assert not any("gate_up_proj" in k for k in keys)


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_loaded_moe_gives_transformers_logits_forward_prefill_and_steps(
        name, ckpt, highest_precision):
    c = ckpt(name)
    pre, f = ph.assert_loads_with_transformers_logits(c, atol=ATOL)
    ph.assert_ragged_prefill_then_steps(f, pre.params, c, atol=ATOL)
    dense = models.load(c.path, moe_dispatch="dense")
    np.testing.assert_allclose(fns(dense.config).forward(dense.params, c.tokens), c.logits,
                               atol=ATOL, rtol=0)
    scanned = models.load(c.path, scan_layers=True, remat=True)
    np.testing.assert_allclose(fns(scanned.config).forward(scanned.params, c.tokens), c.logits,
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", CASES)
def test_greedy_generate_on_a_ragged_batch_equals_transformers_generate(
        name, ckpt, highest_precision):
    ph.assert_greedy_equals_generate(models.load(ckpt(name).path), ckpt(name), filler=3)


@pytest.mark.parametrize("name", CASES)
def test_load_then_save_gives_the_tensors_transformers_wrote_bit_for_bit(name, ckpt, tmp_path):
    c = ckpt(name)
    pre = models.load(c.path)
    out = str(tmp_path / "again")
    # Saved without a model_type, the first type that expresses the config is its own.
    assert models.save(out, pre.config, pre.params) == c.model_type
    again = hf_load(out)
    assert type(again) is type(c.model)
    assert_same_tensors(c.state, again)
    np.testing.assert_array_equal(hf_logits(again, c.tokens), c.logits)
    assert models.load(out).config == pre.config
    assert_same_params(models.load(out).params, pre.params)
    scanned = models.load(c.path, scan_layers=True)
    assert_same_params(scanned.params, stack_layers(pre.params))


@pytest.mark.parametrize("name", ["mixtral-gqa-window-4", "qwen3-moe-head-dim"])
def test_a_bfloat16_checkpoint_loads_exactly(name, ckpt, tmp_path):
    c = ckpt(name)
    ph.assert_bfloat16_loads_exactly(c, tmp_path)


REFUSED = [
    ("mixtral-gqa-window-4", dict(router_jitter_noise=0.1), ["router_jitter_noise", "0.1"]),
    ("mixtral-gqa-window-4", dict(hidden_act="gelu"), ["hidden_act", "gelu"]),
    ("mixtral-gqa-window-4", dict(num_experts_per_tok=5),
     ["experts_per_token=5", "num_experts=4"]),
    ("qwen3-moe-head-dim", dict(decoder_sparse_step=2), ["decoder_sparse_step", "2"]),
    ("qwen3-moe-head-dim", dict(mlp_only_layers=[1]), ["mlp_only_layers", "[1]"]),
    ("qwen3-moe-head-dim", dict(attention_bias=True), ["attention_bias", "True"]),
    ("qwen3-moe-head-dim", dict(num_experts=8), ["num_experts", "8", "num_local_experts=4"]),
    ("qwen3-moe-head-dim", dict(shared_expert_intermediate_size=16),
     ["shared_expert_intermediate_size"]),
]


@pytest.mark.parametrize("name,fields,words", REFUSED,
                         ids=[f"{n}-{next(iter(f))}" for n, f, _ in REFUSED])
def test_a_config_value_that_cannot_be_computed_is_refused_by_name(name, fields, words, ckpt,
                                                                   tmp_path):
    path = edit_config(copy_dir(ckpt(name).path, tmp_path / "m"), set_fields(**fields))
    ph.assert_refused_by_name(path, words)


def test_output_router_logits_and_the_published_expert_count_key_are_read(ckpt, tmp_path):
    c = ckpt("qwen3-moe-head-dim")

    def published(hf):
        hf["num_experts"] = hf.pop("num_local_experts")
        hf.update(output_router_logits=True, max_window_layers=48)
    path = edit_config(copy_dir(c.path, tmp_path / "m"), published)
    assert models.pretrained.read_config(path)[1] == models.load(c.path).config


def test_a_moe_config_is_saved_only_as_a_type_that_has_experts():
    plain = models.get_config("llama-tiny", vocab_size=64)
    moe = plain.replace(num_experts=4)
    for model_type in ("llama", "mistral", "qwen2"):
        with pytest.raises(ValueError, match="num_experts=4"):
            FAMILIES[model_type].config_to_hf(moe)
    with pytest.raises(ValueError, match="num_experts=4"):
        FAMILIES["qwen3"].config_to_hf(moe.replace(qk_norm=True))
    with pytest.raises(ValueError, match="num_experts=0"):
        FAMILIES["mixtral"].config_to_hf(plain)
    with pytest.raises(ValueError, match="num_experts=0"):
        FAMILIES["qwen3_moe"].config_to_hf(plain.replace(qk_norm=True))


# The published config.json files (mistralai/Mixtral-8x7B-v0.1, Qwen/Qwen3-30B-A3B).
PUBLISHED = {
    "mixtral-8x7b": ("MixtralConfig", {
        "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
        "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32,
        "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "num_local_experts": 8, "output_router_logits": False, "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.36.0.dev0", "use_cache": True, "vocab_size": 32000},
        46_702_792_704),
    "qwen3-30b-a3b": ("Qwen3MoeConfig", {
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1,
        "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 6144,
        "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
        "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
        "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
        "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936}, 30_532_122_624),
}


@pytest.mark.parametrize("preset", PUBLISHED)
def test_a_moe_preset_at_the_published_size_has_transformers_parameter_count(preset):
    class_name, published, count = PUBLISHED[preset]
    cfg = models.get_config(preset)
    ids = dict(pad_id=cfg.pad_id, eos_id=cfg.eos_id, bos_id=cfg.bos_id)
    assert FAMILIES[published["model_type"]].config_from_hf(published).replace(**ids) == cfg
    theirs = _their_count(class_name, published)
    assert _our_count(cfg) == theirs
    assert theirs == count
