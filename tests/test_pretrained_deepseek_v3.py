"""DeepSeek-V3: models.load against transformers' logits, models.save back, the latent
cache and the group-limited routing on their own.

Tiny random transformers DeepseekV3 models (every tensor random, the experts' selection
bias included) give the same logits loaded here: teacher-forced with the materialised and
the chunked attention, with either expert dispatch, scanned, and through a ragged prefill
then cached steps (whose attention reads the latent with the projections absorbed);
greedy decoding equals transformers' `generate`; load then save gives the tensors
transformers wrote bit for bit; a bfloat16 checkpoint loads exactly; refused values are
named; and the deepseek-v3 preset has transformers' parameter count.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models.cache_int8 import bytes_per_token
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
)
from tests.test_pretrained_2025 import _our_count, _their_count

highest_precision = ph.highest_precision
ATOL = 1e-5
_SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=40, moe_intermediate_size=12,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
              kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6,
              max_position_embeddings=32, **SPECIAL)

CASES = {
    # Low-rank queries, a dense layer then two expert layers (2 of 8 among the best 2 of 4
    # groups), interleaved RoPE with YaRN x4 of 8 whose mscale (1.0 against 0.8) scales the
    # logits and cos/sin.
    "deepseek-v3-q-lora-groups-yarn": ("deepseek_v3", "DeepseekV3Config", dict(
        _SMALL, q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
        topk_group=2, first_k_dense_replace=1, n_shared_experts=1,
        routed_scaling_factor=2.5, rope_interleave=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.8,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 8}), dict(
        num_experts=8, experts_per_token=2, router_groups=4, router_top_groups=2,
        moe_layers=(1, 2), kv_lora_rank=16, q_lora_rank=24, head_dim=12, v_head_dim=6,
        shared_expert_mlp_dim=12, routed_scaling=2.5, rope_interleaved=True)),
    # Full-rank queries, every layer experts (top 3 of 6, no groups, unnormalised), two
    # shared experts, RoPE in halves without scaling.
    "deepseek-v3-q-proj-ungrouped": ("deepseek_v3", "DeepseekV3Config", dict(
        _SMALL, q_lora_rank=None, n_routed_experts=6, num_experts_per_tok=3, n_group=1,
        topk_group=1, first_k_dense_replace=0, n_shared_experts=2, norm_topk_prob=False,
        routed_scaling_factor=1.5, rope_interleave=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0}), dict(
        num_experts=6, experts_per_token=3, router_groups=1, moe_layers=(), q_lora_rank=None,
        shared_expert_mlp_dim=24, router_renormalize=False, rope_interleaved=False,
        query_pre_attn_scalar=None)),
}

ckpt, _ = ph.checkpoints(CASES, "hf_checkpoints_deepseek_v3", first_seed=900)


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_loaded_deepseek_v3_gives_transformers_logits_forward_prefill_and_steps(
        name, ckpt, highest_precision):
    c = ckpt(name)
    pre, f = ph.assert_loads_with_transformers_logits(c, atol=ATOL)
    ph.assert_ragged_prefill_then_steps(f, pre.params, c, atol=ATOL)
    options = [dict(moe_dispatch="dense"), dict(attention_impl="chunked", attention_block=4)]
    if not pre.config.moe_layers:                     # one MLP kind: the stack may scan
        options.append(dict(scan_layers=True, remat=True))
    for option in options:
        other = models.load(c.path, **option)
        np.testing.assert_allclose(fns(other.config).forward(other.params, c.tokens), c.logits,
                                   atol=ATOL, rtol=0, err_msg=str(option))


def test_the_cache_holds_the_latent_and_a_step_reads_it_absorbed(ckpt, highest_precision):
    """The cache per token and layer is kv_lora_rank + qk_rope_head_dim numbers (no values),
    and the read-only step (the absorbed projections over the latent) gives the writing
    step's logits, which give transformers'."""
    c = ckpt("deepseek-v3-q-lora-groups-yarn")
    pre = models.load(c.path)
    cfg, model, tokens = pre.config, pre.model, jnp.asarray(c.tokens)
    cache = models.KVCache.create(cfg, 2, 16)
    assert cache.k[0].shape == (2, 1, 16, 16 + 4) and cache.v[0].shape == (2, 1, 16, 0)
    assert bytes_per_token(cfg) == cfg.num_layers * (16 + 4) * 4
    apply = jax.jit(lambda method, *a: model.apply({"params": pre.params}, *a, method=method),
                    static_argnums=0)
    _, cache = apply("prefill", tokens[:, :5], jnp.asarray([5, 3], jnp.int32), cache)
    written, after = apply("step", tokens[np.arange(2), [5, 3]], cache)
    read, new_kv = apply("read_step", tokens[np.arange(2), [5, 3]], cache)
    np.testing.assert_allclose(read, written, atol=ATOL, rtol=0)
    np.testing.assert_allclose(read, c.logits[np.arange(2), [5, 3]], atol=ATOL, rtol=0)
    committed = cache.commit(new_kv)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), committed, after)


@pytest.mark.parametrize("name", CASES)
def test_greedy_generate_on_a_ragged_batch_equals_transformers_generate(
        name, ckpt, highest_precision):
    ph.assert_greedy_equals_generate(models.load(ckpt(name).path), ckpt(name), filler=3)


@pytest.mark.parametrize("name", CASES)
def test_load_then_save_gives_the_tensors_transformers_wrote_bit_for_bit(name, ckpt, tmp_path):
    ph.assert_saves_back_bit_for_bit(ckpt(name), "deepseek_v3", tmp_path)


def test_the_selection_bias_chooses_the_experts_and_does_not_weigh_them(ckpt):
    """The file's e_score_correction_bias is loaded where the router reads it, and the
    routing chooses by score + bias among the best groups but weighs by the score alone."""
    from models.moe import route
    c = ckpt("deepseek-v3-q-lora-groups-yarn")
    pre = models.load(c.path)
    bias = c.state["model.layers.1.mlp.gate.e_score_correction_bias"].numpy()
    assert np.abs(bias).max() > 0.1
    np.testing.assert_array_equal(pre.params["decoder"]["layer_1"]["mlp"]["router_score_bias"],
                                  bias)
    logits = jnp.asarray([[0.0, 0.1, 2.0, 1.9, -1.0, -0.9, 0.5, 0.4]])
    bias = jnp.asarray([0.0, 0.0, -3.0, 0.0, 5.0, 0.0, 0.0, 0.0])
    weights, experts = route(logits, 2, renormalize=False, score="sigmoid",
                             choice_bias_E=bias, groups=4, top_groups=2, scaling=2.0)
    # groups by their two best biased scores: {4, 5} (the bias) and {6, 7} beat {2, 3}
    # (its first expert biased down) and {0, 1}; within them 4 then 6.
    assert sorted(np.asarray(experts[0]).tolist()) == [4, 6]
    np.testing.assert_allclose(np.sort(weights[0]),
                               np.sort(2.0 * jax.nn.sigmoid(logits[0, [4, 6]])), rtol=1e-6)


def test_the_published_multi_token_prediction_layer_is_skipped_with_a_warning(ckpt, tmp_path):
    """The published files hold one more layer past the last (its decoder layer's tensors
    and enorm, hnorm, eh_proj, shared_head): skipped, named in the warning, the logits
    unchanged; a stray tensor inside a real layer is still refused by name."""
    from safetensors.numpy import load_file, save_file
    c = ckpt("deepseek-v3-q-lora-groups-yarn")
    path = copy_dir(c.path, tmp_path / "m")
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    mtp = {k.replace("layers.2.", "layers.3."): v for k, v in tensors.items()
           if k.startswith("model.layers.2.")}
    mtp.update({f"model.layers.3.{name}.weight": np.ones((32,), np.float32)
                for name in ("enorm", "hnorm", "shared_head.norm")})
    mtp["model.layers.3.eh_proj.weight"] = np.ones((32, 64), np.float32)
    save_file({**tensors, **mtp}, file, metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"model\.layers\.3\..*are skipped"):
        pre = models.load(path)
    np.testing.assert_allclose(fns(pre.config).forward(pre.params, c.tokens), c.logits,
                               atol=ATOL, rtol=0)
    save_file({**tensors, "model.layers.1.self_attn.q_proj.weight": np.ones((48, 32),
                                                                         np.float32)},
              file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"1 tensor\(s\) the config does not use: "
                                         r"model\.layers\.1\.self_attn\.q_proj\.weight"):
        models.load(path)


def test_a_bfloat16_checkpoint_loads_exactly(ckpt, tmp_path):
    ph.assert_bfloat16_loads_exactly(ckpt("deepseek-v3-q-lora-groups-yarn"), tmp_path)


REFUSED = [
    (dict(attention_bias=True), ["attention_bias", "True"]),
    (dict(quantization_config={"quant_method": "fp8"}), ["quantization_config", "fp8"]),
    (dict(num_key_value_heads=2), ["num_key_value_heads", "2", "num_attention_heads=4"]),
    (dict(scoring_func="softmax"), ["scoring_func", "softmax", "'sigmoid'"]),
    (dict(topk_method="greedy"), ["topk_method", "greedy", "noaux_tc"]),
    (dict(hidden_act="gelu"), ["hidden_act", "gelu"]),
    (dict(first_k_dense_replace=3), ["first_k_dense_replace", "3"]),
    (dict(qk_head_dim=16), ["qk_head_dim", "16", "12"]),
    (dict(n_group=3), ["router_groups=3", "num_experts=8"]),
]


@pytest.mark.parametrize("fields,words", REFUSED, ids=[next(iter(f)) for f, _ in REFUSED])
def test_a_config_value_that_cannot_be_computed_is_refused_by_name(fields, words, ckpt,
                                                                   tmp_path):
    path = edit_config(copy_dir(ckpt("deepseek-v3-q-lora-groups-yarn").path, tmp_path / "m"),
                       set_fields(**fields))
    ph.assert_refused_by_name(path, words)


def test_latent_attention_refuses_what_it_does_not_compute():
    tiny = models.get_config("deepseek-v3-tiny")
    for change, words in ((dict(num_kv_heads=2), "num_kv_heads=4"),
                          (dict(sliding_window=4), "sliding_window=None"),
                          (dict(qk_rope_head_dim=24), "below head_dim=24"),
                          (dict(kv_lora_rank=None), "q_lora_rank=24 shapes latent"),
                          (dict(lora={"rank": 2, "targets": ["query"]}),
                           r"'query' names no projection.*query_a")):
        with pytest.raises(ValueError, match=words):
            tiny.replace(**change)
    with pytest.raises(ValueError, match="int8.*latent attention"):
        models.KVCache.create(tiny, 1, 8, dtype="int8")
    with pytest.raises(ValueError, match="cudnn.*latent attention"):
        from models.kernels import attend
        from models.masks import MaskSpec
        pos = jnp.zeros((1, 2), jnp.int32)
        attend(jnp.zeros((1, 2, 4, 8), jnp.bfloat16), jnp.zeros((1, 2, 1, 8), jnp.bfloat16),
               jnp.zeros((1, 2, 1, 6), jnp.bfloat16), MaskSpec(pos, pos, causal=True),
               impl="cudnn", scale=1.0)


PUBLISHED_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1,
    "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "seq_aux": True, "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 129280}


def test_the_deepseek_v3_preset_is_the_published_config_with_transformers_count():
    """deepseek-ai/DeepSeek-V3's config.json (less its FP8 quantization_config) reads as the
    preset; built abstractly, ours counts 671,026,419,200 parameters (the MTP module apart),
    transformers 14,848 fewer: the 58 expert layers' 256 selection biases, its buffers."""
    cfg = models.get_config("deepseek-v3")
    published = dict(PUBLISHED_V3)
    assert FAMILIES["deepseek_v3"].config_from_hf(dict(published)).replace(
        pad_id=cfg.pad_id) == cfg
    fields = {k: v for k, v in published.items()
              if k not in ("aux_loss_alpha", "ep_size", "moe_layer_freq", "scoring_func",
                           "seq_aux", "topk_method")}
    fields["rope_parameters"] = {**fields.pop("rope_scaling"), "rope_type": "yarn",
                                 "rope_theta": fields.pop("rope_theta")}
    fields["rope_parameters"].pop("type")
    theirs = _their_count("DeepseekV3Config", fields)
    assert _our_count(cfg) == theirs + 58 * 256 == 671_026_419_200


def test_served_speculative_and_beam_decoding_carry_the_latent_cache(highest_precision):
    """deepseek-v3-tiny with every weight moved: served (paged latent cache), speculative
    and beam-1 decoding give each prompt's greedy tokens."""
    cfg = models.get_config("deepseek-v3-tiny", vocab_size=64, max_len=48)
    ph.assert_every_decoder_gives_greedy(cfg, "deepseek_v3", seed=5)


def test_three_steps_over_an_fsdp2_tensor2_mesh_equal_one_device():
    """DeepSeek-V3's layers (latent attention with its heads split over tensor, a dense
    layer, then biased group-limited experts), trained three steps with the parameters split
    over fsdp and tensor: the parameters of three steps on one device."""
    import chex

    from tests import test_sharding as ts
    from tests.test_decode_sharded import DEEPSEEK_V3
    cfg = ts._variant("decoder_only", gqa=False, scan=False).replace(
        **DEEPSEEK_V3, router_aux_loss_coef=0.1)
    sh, make_state = ts._sharded(cfg, (1, 2, 2))
    state = sh.init_state(make_state)
    kv_b = state.params["decoder"]["layer_0"]["self_attention"]["kv_b_kernel"]  # [r, N, X]
    assert kv_b.sharding.spec[1] == "tensor"
    for b in ts._batches(cfg):
        state, _ = sh.train_step(state, jax.tree.map(lambda x: x.reshape(4, -1, ts.W), b))
    chex.assert_trees_all_close(sh.host_state(state).params, ts._one_device(cfg), atol=2e-5)


def test_int8_weights_quantize_the_latent_projections_and_the_experts(ckpt):
    """`quantize="int8"`: every Projection of the latent attention (query_a, query_b, kv_a,
    out) and the experts are int8; kv_b, read whole by each call, stays in the float dtype;
    the logits follow the float ones."""
    from models.quant import Quantized
    c = ckpt("deepseek-v3-q-lora-groups-yarn")
    pre = models.load(c.path, quantize="int8")
    attn = pre.params["decoder"]["layer_1"]["self_attention"]
    assert all(isinstance(attn[name]["kernel"], Quantized)
               for name in ("query_a", "query_b", "kv_a", "out"))
    assert not isinstance(attn["kv_b_kernel"], Quantized)
    assert isinstance(pre.params["decoder"]["layer_1"]["mlp"]["gate_kernel"], Quantized)
    logits = np.asarray(pre.model.apply({"params": pre.params}, jnp.asarray(c.tokens)))
    assert np.abs(logits - c.logits).max() < 0.03 * np.abs(c.logits).max()


@pytest.mark.parametrize("name,targets,modules", [
    ("deepseek-v3-q-lora-groups-yarn", ("query_a", "query_b", "kv_a", "out"),
     ["kv_a_proj_with_mqa", "o_proj", "q_a_proj", "q_b_proj"]),
    ("deepseek-v3-q-proj-ungrouped", ("self_attention",),
     ["kv_a_proj_with_mqa", "o_proj", "q_proj"])])
def test_adapters_on_latent_attention_load_in_peft_with_our_logits(
        name, targets, modules, ckpt, tmp_path, highest_precision):
    """LoRA on the latent attention's projections (the low-rank query pair or q_proj, the
    latent's kv_a, the output): PEFT reads the adapter we write onto transformers'
    DeepSeek-V3 to our logits, beside the experts (which take none)."""
    import json

    import peft

    from models import lora
    from models.lora import LoraConfig
    from models.pretrained import peft as peft_files
    from tests.helpers import random_adapters
    c = ckpt(name)
    pre = models.load(c.path)
    cfg = pre.config.replace(lora=LoraConfig(rank=2, targets=targets))
    adapters = random_adapters(cfg, seed=4)
    out = str(tmp_path / "adapter")
    models.save_adapter(out, cfg, adapters)
    with open(f"{out}/{peft_files.CONFIG}") as f:
        assert sorted(json.load(f)["target_modules"]) == modules
    model = peft.PeftModel.from_pretrained(hf_load(c.path), out).eval()
    theirs = hf_logits(model, c.tokens)
    ours = np.asarray(fns(cfg).forward(lora.join(pre.params, adapters), c.tokens))
    assert np.abs(ours - c.logits).max() > 1e-2
    np.testing.assert_allclose(ours, theirs, atol=ATOL, rtol=0)
    again = models.load(c.path, adapter=out)
    chex_tree = jax.tree.map(np.asarray, lora.split(again.params)[1])
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), chex_tree,
                 jax.tree.map(np.asarray, adapters))
