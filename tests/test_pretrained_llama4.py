"""Llama 4's text model: models.load against transformers' logits, models.save back, and
its parts on their own (the chunk rule, NoPE layers and their temperature, interleaved
RoPE, the L2 q/k norm, input-scaled sigmoid routing with a shared expert, dense and
expert layers mixed).

Tiny random transformers Llama4ForCausalLM models give the same logits loaded here:
teacher-forced with the materialised and the chunked attention, with either expert
dispatch, scanned (where every layer has experts), and through a ragged prefill then cached
steps; greedy decoding equals transformers' `generate`; load then save gives the tensors
transformers wrote bit for bit; a bfloat16 checkpoint loads exactly; refused values are
named; and the Scout and Maverick presets have transformers' parameter counts.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

import models
from models.masks import MaskSpec
from models.pretrained import FAMILIES
from tests import pretrained_helpers as ph
from tests.helpers import fns
from tests.pretrained_helpers import (
    SPECIAL,
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
_SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=24, intermediate_size_mlp=40,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              max_position_embeddings=32, rms_norm_eps=1e-5, num_local_experts=4, **SPECIAL)

CASES = {
    # Scout's shape: experts in every layer, chunks of 3 in the rotating layers (0 and 2),
    # NoPE layers 1 and 3 with a temperature that grows within the 10 tokens, top 2 of 4.
    "llama4-chunks-3-nope-temperature": ("llama4_text", "Llama4TextConfig", dict(
        _SMALL, num_experts_per_tok=2, no_rope_layer_interval=2, attention_chunk_size=3,
        floor_scale=2, attn_scale=0.5,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0}), dict(
        layer_types=("chunked", "full", "chunked", "full"), attention_chunk_size=3,
        nope_layers=(1, 3), attn_temperature_floor=2, attn_temperature_scale=0.5,
        qk_l2_norm=True, moe_layers=(), num_experts=4, experts_per_token=2, mlp_dim=40,
        expert_width=24, shared_expert_mlp_dim=24, rope_interleaved=True)),
    # Maverick's shape: experts in layers 1 and 3 (dense 0 and 2), no chunks, no q/k norm,
    # no temperature, top 1, Llama 3 RoPE scaling.
    "llama4-mixed-dense-top-1-llama3": ("llama4_text", "Llama4TextConfig", dict(
        _SMALL, num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=None,
        use_qk_norm=False, attn_temperature_tuning=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 4.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                         "original_max_position_embeddings": 4}), dict(
        layer_types=(), attention_chunk_size=None, nope_layers=(3,), moe_layers=(1, 3),
        qk_l2_norm=False, attn_temperature_floor=None, experts_per_token=1)),
}

ckpt, _ = ph.checkpoints(CASES, "hf_checkpoints_llama4", first_seed=800)


def test_the_chunk_rule_sees_the_querys_chunk_from_each_sequences_start():
    """Causal within chunks of 3, from the indices, from a packed row's own positions
    (chunks start at each sequence's first token), and switched per layer by `chunk_on`;
    a block of the description equals the slice of the whole."""
    index = jnp.arange(8)[None]
    spec = MaskSpec(index, index, causal=True, chunk=3)
    want = np.tril(np.ones((8, 8), bool)) & ((np.arange(8)[:, None] // 3)
                                             == (np.arange(8)[None, :] // 3))
    np.testing.assert_array_equal(spec.materialize()[0], want)
    positions = jnp.asarray([[0, 1, 2, 3, 4, 0, 1, 2]])        # two sequences: 5 and 3
    segments = jnp.asarray([[1, 1, 1, 1, 1, 2, 2, 2]])
    packed = spec.replace(q_position=positions, k_position=positions, q_segment=segments,
                          k_segment=segments).materialize()[0]
    np.testing.assert_array_equal(packed[5:, 5:], np.tril(np.ones((3, 3), bool)))
    np.testing.assert_array_equal(packed[3:5, 3:5], np.tril(np.ones((2, 2), bool)))
    assert not packed[3, :3].any() and not packed[5:, :5].any()
    off = spec.replace(chunk_on=jnp.asarray(False)).materialize()[0]
    np.testing.assert_array_equal(off, np.tril(np.ones((8, 8), bool)))
    np.testing.assert_array_equal(spec.block((2, 4), (1, 5))[0], want[2:6, 1:6])


def test_a_packed_row_gives_each_sequence_its_own_logits(highest_precision):
    """llama4-tiny (chunks of 4, a NoPE layer with its temperature) on one packed row of
    two sequences equals each sequence alone, in the materialised and the chunked
    attention: chunks and temperature follow each sequence's own positions."""
    cfg = models.get_config("llama4-tiny", vocab_size=64, attn_temperature_floor=2)
    params = fns(cfg).init(0)
    a, b = np.arange(5, 11), np.arange(20, 27)
    tokens = np.concatenate([a, b])[None]
    segments = np.asarray([[1] * 6 + [2] * 7])
    positions = np.concatenate([np.arange(6), np.arange(7)])[None]
    for impl in ("xla", "chunked"):
        f = fns(cfg.replace(attention_impl=impl, attention_block=4))
        packed = f.forward(params, tokens, segment_ids=segments, positions=positions)
        np.testing.assert_allclose(packed[0, :6], f.forward(params, a[None])[0], atol=1e-5)
        np.testing.assert_allclose(packed[0, 6:], f.forward(params, b[None])[0], atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_loaded_llama4_gives_transformers_logits_forward_prefill_and_steps(
        name, ckpt, highest_precision):
    c = ckpt(name)
    pre, f = ph.assert_loads_with_transformers_logits(c, atol=ATOL)
    ph.assert_ragged_prefill_then_steps(f, pre.params, c, atol=ATOL)
    options = [dict(moe_dispatch="dense"), dict(attention_impl="chunked", attention_block=4)]
    if not pre.config.moe_layers:
        options.append(dict(scan_layers=True, remat=True))
    for option in options:
        other = models.load(c.path, **option)
        np.testing.assert_allclose(fns(other.config).forward(other.params, c.tokens), c.logits,
                                   atol=ATOL, rtol=0, err_msg=str(option))


@pytest.mark.parametrize("name", CASES)
def test_greedy_generate_on_a_ragged_batch_equals_transformers_generate(
        name, ckpt, highest_precision):
    ph.assert_greedy_equals_generate(models.load(ckpt(name).path), ckpt(name), filler=3)


@pytest.mark.parametrize("name", CASES)
def test_load_then_save_gives_the_tensors_transformers_wrote_bit_for_bit(name, ckpt, tmp_path):
    ph.assert_saves_back_bit_for_bit(ckpt(name), "llama4_text", tmp_path)


def test_the_fused_experts_split_gate_from_the_first_half(ckpt):
    """The file's gate_up columns: gate first, then up (swapping them changes the model);
    the router and the shared expert land where the model reads them."""
    c = ckpt("llama4-mixed-dense-top-1-llama3")
    pre = models.load(c.path)
    fused = c.state["model.layers.1.feed_forward.experts.gate_up_proj"].numpy()
    mlp = pre.params["decoder"]["layer_1"]["mlp"]
    np.testing.assert_array_equal(mlp["gate_kernel"], fused[..., :24])
    np.testing.assert_array_equal(mlp["up_kernel"], fused[..., 24:])
    np.testing.assert_array_equal(
        mlp["router_kernel"], c.state["model.layers.1.feed_forward.router.weight"].numpy().T)
    np.testing.assert_array_equal(
        mlp["shared_expert"]["down"]["kernel"],
        c.state["model.layers.1.feed_forward.shared_expert.down_proj.weight"].numpy().T)
    assert set(pre.params["decoder"]["layer_0"]["mlp"]) == {"gate", "up", "down"}   # dense


def test_a_bfloat16_checkpoint_loads_exactly(ckpt, tmp_path):
    ph.assert_bfloat16_loads_exactly(ckpt("llama4-chunks-3-nope-temperature"), tmp_path)


REFUSED = [
    (dict(attention_bias=True), ["attention_bias", "True"]),
    (dict(hidden_act="gelu"), ["hidden_act", "gelu", "silu"]),
    (dict(layer_types=["full_attention"]), ["layer_types", "4 layers"]),
    (dict(layer_types=["sliding_attention"] * 4), ["layer_types", "sliding_attention"]),
    (dict(attention_chunk_size=None), ["attention_chunk_size", "chunked layers need"]),
    (dict(no_rope_layers=[1, 1]), ["no_rope_layers", "4 layers"]),
    (dict(moe_layers=[]), ["moe_layers", "expert layers"]),
    (dict(model_type="llama4", text_config={}), ["llama4", "multimodal", "llama4_text"]),
]


@pytest.mark.parametrize("fields,words", REFUSED, ids=[next(iter(f)) for f, _ in REFUSED])
def test_a_config_value_that_cannot_be_computed_is_refused_by_name(fields, words, ckpt,
                                                                   tmp_path):
    path = edit_config(copy_dir(ckpt("llama4-chunks-3-nope-temperature").path, tmp_path / "m"),
                       set_fields(**fields))
    if "text_config" in fields:                                    # named by its own reader
        with pytest.raises(ValueError) as e:
            FAMILIES["llama4_text"].config_from_hf(json.load(open(f"{path}/config.json")))
        assert all(w in str(e.value) for w in words), str(e.value)
        return
    ph.assert_refused_by_name(path, words)


def test_mixed_dense_and_expert_layers_refuse_a_scanned_stack():
    with pytest.raises(ValueError, match=r"scan_layers=True.*moe_layers=\[1, 3\]"):
        models.get_config("llama4-tiny", moe_layers=(1, 3), scan_layers=True)
    with pytest.raises(ValueError, match=r"moe_layers names layers \[4\]"):
        models.get_config("llama4-tiny", moe_layers=(1, 4))
    with pytest.raises(ValueError, match="attn_temperature_floor=4 tunes the nope_layers"):
        models.get_config("llama4-tiny", nope_layers=())
    with pytest.raises(ValueError, match="router_score='sigmoid'.*num_experts > 0"):
        models.get_config("llama-tiny", router_score="sigmoid")


def _published(scout: bool) -> dict:
    """The text_config of meta-llama/Llama-4-Scout-17B-16E(-Instruct) and of
    Llama-4-Maverick-17B-128E, as a Llama4ForCausalLM's config.json."""
    layers = 48
    out = {
        "model_type": "llama4_text", "architectures": ["Llama4ForCausalLM"],
        "attention_bias": False, "attention_chunk_size": 8192, "attention_dropout": 0.0,
        "attn_scale": 0.1, "attn_temperature_tuning": True, "bos_token_id": 200000,
        "eos_token_id": [200001, 200007, 200008], "floor_scale": 8192,
        "for_llm_compressor": False, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 5120, "initializer_range": 0.02, "interleave_moe_layer_step": 1,
        "intermediate_size": 8192, "intermediate_size_mlp": 16384,
        "max_position_embeddings": 10485760, "moe_layers": list(range(layers)),
        "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(layers)],
        "num_attention_heads": 40, "num_experts_per_tok": 1, "num_hidden_layers": layers,
        "num_key_value_heads": 8, "num_local_experts": 16, "output_router_logits": False,
        "pad_token_id": 200018, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0,
        "tie_word_embeddings": False, "use_cache": True, "use_qk_norm": True,
        "vocab_size": 202048}
    if not scout:
        out.update(interleave_moe_layer_step=2, moe_layers=list(range(1, layers, 2)),
                   num_local_experts=128, use_qk_norm=False, rope_scaling=None,
                   max_position_embeddings=1048576)
    return out


PUBLISHED = {"llama4-scout": (_published(True), 107_769_861_120),
             "llama4-maverick": (_published(False), 400_711_848_960)}


@pytest.mark.parametrize("preset", PUBLISHED)
def test_a_llama4_preset_at_the_published_size_has_transformers_parameter_count(preset):
    published, count = PUBLISHED[preset]
    cfg = models.get_config(preset)
    ids = dict(pad_id=cfg.pad_id, eos_id=cfg.eos_id, bos_id=cfg.bos_id)
    assert FAMILIES["llama4_text"].config_from_hf(json.loads(json.dumps(published))).replace(
        **ids) == cfg
    theirs = _their_count("Llama4TextConfig", published)
    assert _our_count(cfg) == theirs
    assert theirs == count


@pytest.mark.slow
def test_served_speculative_and_beam_decoding_keep_the_chunks(highest_precision):
    """llama4-tiny (chunks of 4, a NoPE layer) past several chunks: served, speculative and
    beam-1 decoding give each prompt's greedy tokens (`assert_every_decoder_gives_greedy`),
    and so does the scanned model."""
    import decode
    cfg = models.get_config("llama4-tiny", vocab_size=64, max_len=48, attn_temperature_floor=3)
    _, params, padded, lengths, greedy = ph.assert_every_decoder_gives_greedy(
        cfg, "llama4_text", seed=3)
    scanned = models.build(cfg.replace(scan_layers=True))
    out = decode.generate(scanned, stack_layers(params), padded, lengths, max_new_tokens=10,
                          eos_id=None)
    np.testing.assert_array_equal(out.tokens[:, :10], greedy.tokens[:, :10])


def test_a_published_multimodal_checkpoint_loads_its_text_model(tmp_path, highest_precision):
    """Llama4ForConditionalGeneration (model_type llama4, as every published Llama 4): its
    text_config and language_model.* tensors load with transformers' text logits, the
    vision tower's tensors are named in a warning, and the model saves as llama4_text,
    which transformers' Llama4ForCausalLM reads to the same logits."""
    torch, transformers = ph.torch, ph.transformers
    text = {**_SMALL, "num_experts_per_tok": 2, "no_rope_layer_interval": 2,
            "attention_chunk_size": 3}
    vision = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=24, image_size=28, patch_size=14, vision_output_dim=16,
                  projector_input_dim=16, projector_output_dim=32)
    cfg = transformers.Llama4Config(text_config=text, vision_config=vision,
                                    attn_implementation="eager")
    torch.manual_seed(0)
    model = ph.randomize(transformers.Llama4ForConditionalGeneration(cfg), 0)
    model.save_pretrained(tmp_path / "mm")
    tokens = ph.random_tokens(64, 0)
    with torch.no_grad():
        want = model.language_model(                 # transformers 5.24's text-only call
            input_ids=torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
    with pytest.warns(UserWarning, match=r"vision_model\..*multi_modal_projector|"
                                         r"multi_modal_projector.*vision_model"):
        pre = models.load(str(tmp_path / "mm"))
    assert pre.model_type == "llama4" and pre.config.nope_layers == (1, 3)
    np.testing.assert_allclose(fns(pre.config).forward(pre.params, tokens), want, atol=ATOL,
                               rtol=0)
    assert models.save(str(tmp_path / "text"), pre.config, pre.params) == "llama4_text"
    np.testing.assert_allclose(hf_logits(hf_load(str(tmp_path / "text")), tokens), want,
                               atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="save the text model as llama4_text"):
        models.save(str(tmp_path / "again"), pre.config, pre.params, model_type="llama4")
