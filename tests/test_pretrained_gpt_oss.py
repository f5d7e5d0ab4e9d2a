"""GPT-OSS: models.load against transformers' logits, models.save back, the sinks and the
clamped experts on their own.

Tiny random transformers GptOss models (every tensor random, the sinks and all biases
included; a clamp low enough that the experts' SwiGLU clamps) give the same logits loaded
here: teacher-forced with the materialised and the chunked attention, scanned, with either
expert dispatch, and through a ragged prefill then cached steps; greedy decoding equals
transformers' `generate`; load then save gives the tensors transformers wrote bit for bit
(the experts fused and interleaved again); a bfloat16 checkpoint loads exactly; refused
values and the published files' MXFP4 tensors are named; and the gpt-oss-20b and
gpt-oss-120b presets have transformers' parameter counts.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models.pretrained import FAMILIES
from tests import pretrained_helpers as ph
from tests.helpers import fns
from tests.pretrained_helpers import (
    SPECIAL,
    copy_dir,
    edit_config,
    set_fields,
)
from tests.test_pretrained_2025 import _our_count, _their_count

highest_precision = ph.highest_precision
ATOL = 1e-5
_SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=3,
              num_attention_heads=4, head_dim=8, max_position_embeddings=32, rms_norm_eps=1e-5,
              num_experts_per_tok=2, swiglu_limit=0.3, **SPECIAL)

CASES = {
    # Sliding, full, sliding (the default kinds) with a window of 3, YaRN at x4 of 8.
    "gpt-oss-gqa-window-3-yarn": ("gpt_oss", "GptOssConfig", dict(
        _SMALL, num_key_value_heads=2, num_local_experts=4, sliding_window=3,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 8}), dict(
        num_experts=4, experts_per_token=2, expert_width=24, num_kv_heads=2,
        layer_types=("sliding", "full", "sliding"), sliding_window=3, attention_sinks=True,
        use_bias=True, activation="clamped_swiglu", swiglu_limit=0.3, tie_embeddings=False)),
    # Full attention throughout, multi-head, top 3 of 5, plain RoPE.
    "gpt-oss-mha-full-top-3": ("gpt_oss", "GptOssConfig", dict(
        _SMALL, num_key_value_heads=4, num_local_experts=5, num_experts_per_tok=3,
        layer_types=["full_attention"] * 3, swiglu_alpha=1.2,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0}), dict(
        num_experts=5, experts_per_token=3, layer_types=("full",) * 3, swiglu_alpha=1.2,
        rope_scaling=None, rope_theta=1000.0)),
}

ckpt, _ = ph.checkpoints(CASES, "hf_checkpoints_gpt_oss", first_seed=700)


def test_the_sinks_are_a_softmax_column_of_zero_value():
    """Our sinks (the attention without them, rescaled by its log-sum-exp) against
    transformers' formula written out: the sink's logit concatenated to the keys', softmax,
    the sink's column dropped; a query that sees no key gives zeros."""
    from models.attention import _with_sinks
    from models.kernels import attend
    from models.masks import MaskSpec
    r = np.random.default_rng(0)
    q, k, v = (jnp.asarray(r.normal(size=(2, 5, 4, 8)), jnp.float32) for _ in range(3))
    sinks = jnp.asarray(r.normal(size=(4,)) * 2, jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
    valid = jnp.asarray([[True] * 5, [False, True, True, True, True]])
    spec = MaskSpec(pos, pos, causal=True, k_valid=valid)
    for impl in ("xla", "chunked"):
        out, probs, lse = attend(q, k, v, spec, impl=impl, scale=8 ** -0.5, with_lse=True,
                                 with_probs=impl == "xla")
        out, probs = _with_sinks(sinks, out, probs, lse)
        logits = jnp.einsum("btnh,bsnh->bnts", q, k) * 8 ** -0.5
        mask = np.tril(np.ones((5, 5), bool))[None, None] & np.asarray(valid)[:, None, None]
        logits = jnp.where(mask, logits, -jnp.inf)
        column = jnp.broadcast_to(sinks[None, :, None, None], (2, 4, 5, 1))
        want = jax.nn.softmax(jnp.concatenate([logits, column], -1), -1)[..., :-1]
        np.testing.assert_allclose(out, jnp.einsum("bnts,bsnh->btnh", want, v), atol=1e-6)
        np.testing.assert_array_equal(out[1, 0], 0.0)       # sees nothing: zeros, not NaN
        if probs is not None:
            np.testing.assert_allclose(probs, want, atol=1e-6)


def test_chunked_attention_with_sinks_trains_as_the_materialised_one(highest_precision):
    cfg = models.get_config("gpt-oss-tiny", attention_block=4)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 512, (2, 12)), jnp.int32)
    params = fns(cfg.replace(attention_impl="xla")).init(0)
    params = jax.tree.map(lambda x: x + 0.05 * jnp.sin(jnp.arange(x.size).reshape(x.shape)),
                          params)                           # sinks and biases not zero

    def grads(impl):
        f = fns(cfg.replace(attention_impl=impl))
        return jax.grad(lambda p: jnp.mean(f.forward(p, tokens) ** 2))(params)
    chunked, xla = grads("chunked"), grads("xla")
    assert float(jnp.abs(xla["decoder"]["layer_0"]["self_attention"]["sinks"]).max()) > 0
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-6), chunked, xla)


def test_cudnn_cannot_add_the_sinks_and_says_so():
    with pytest.raises(ValueError, match="attention_sinks=True.*cudnn"):
        models.get_config("gpt-oss-tiny", attention_impl="cudnn")
    with pytest.raises(ValueError, match="attention_sinks=True.*decoder_only"):
        models.get_config("transformer-tiny", attention_sinks=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_loaded_gpt_oss_gives_transformers_logits_forward_prefill_and_steps(
        name, ckpt, highest_precision):
    c = ckpt(name)
    pre, f = ph.assert_loads_with_transformers_logits(c, atol=ATOL)
    ph.assert_ragged_prefill_then_steps(f, pre.params, c, atol=ATOL)
    for options in (dict(moe_dispatch="dense"), dict(attention_impl="chunked", attention_block=4),
                    dict(scan_layers=True, remat=True)):
        other = models.load(c.path, **options)
        np.testing.assert_allclose(fns(other.config).forward(other.params, c.tokens), c.logits,
                                   atol=ATOL, rtol=0, err_msg=str(options))


@pytest.mark.parametrize("name", CASES)
def test_greedy_generate_on_a_ragged_batch_equals_transformers_generate(
        name, ckpt, highest_precision):
    ph.assert_greedy_equals_generate(models.load(ckpt(name).path), ckpt(name), filler=3)


@pytest.mark.parametrize("name", CASES)
def test_load_then_save_gives_the_tensors_transformers_wrote_bit_for_bit(name, ckpt, tmp_path):
    ph.assert_saves_back_bit_for_bit(ckpt(name), "gpt_oss", tmp_path)


def test_the_fused_experts_split_gate_from_the_even_columns(ckpt):
    """Swapping the file's even and odd columns (gate and up) must change the model: the
    split is read, not assumed symmetric."""
    c = ckpt("gpt-oss-gqa-window-3-yarn")
    pre = models.load(c.path)
    fused = c.state["model.layers.1.mlp.experts.gate_up_proj"].numpy()
    mlp = pre.params["decoder"]["layer_1"]["mlp"]
    np.testing.assert_array_equal(mlp["gate_kernel"], fused[..., 0::2])
    np.testing.assert_array_equal(mlp["up_kernel"], fused[..., 1::2])
    bias = c.state["model.layers.1.mlp.experts.gate_up_proj_bias"].numpy()
    np.testing.assert_array_equal(mlp["gate_bias"], bias[..., 0::2])
    np.testing.assert_array_equal(pre.params["decoder"]["layer_1"]["self_attention"]["sinks"],
                                  c.state["model.layers.1.self_attn.sinks"].numpy())


def test_a_bfloat16_checkpoint_loads_exactly(ckpt, tmp_path):
    c = ckpt("gpt-oss-gqa-window-3-yarn")
    ph.assert_bfloat16_loads_exactly(c, tmp_path)


REFUSED = [
    (dict(attention_bias=False), ["attention_bias", "False"]),
    (dict(quantization_config={"quant_method": "mxfp4"}), ["quantization_config", "mxfp4"]),
    (dict(layer_types=["full_attention"]), ["layer_types", "3 layers"]),
    (dict(sliding_window=None), ["sliding_window", "sliding layers need a window"]),
    (dict(experts_per_token=3), ["experts_per_token", "3", "num_experts_per_tok=2"]),
    (dict(num_experts_per_tok=5), ["experts_per_token=5", "num_experts=4"]),
]


@pytest.mark.parametrize("fields,words", REFUSED, ids=[next(iter(f)) for f, _ in REFUSED])
def test_a_config_value_that_cannot_be_computed_is_refused_by_name(fields, words, ckpt,
                                                                   tmp_path):
    path = edit_config(copy_dir(ckpt("gpt-oss-gqa-window-3-yarn").path, tmp_path / "m"),
                       set_fields(**fields))
    ph.assert_refused_by_name(path, words)


def test_the_published_mxfp4_expert_tensors_are_refused_by_name(ckpt, tmp_path):
    """The published files hold each expert projection as `*_blocks` and `*_scales`."""
    from safetensors.numpy import load_file, save_file
    path = copy_dir(ckpt("gpt-oss-gqa-window-3-yarn").path, tmp_path / "m")
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    for name in [k for k in tensors if k.endswith("experts.gate_up_proj")]:
        fused = tensors.pop(name)
        tensors[f"{name}_blocks"] = np.zeros((*fused.shape[:2], 1, 16), np.uint8)
        tensors[f"{name}_scales"] = np.zeros((*fused.shape[:2], 1), np.uint8)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError) as e:
        models.load(path)
    for word in ("lacks 3 tensor(s)", "model.layers.0.mlp.experts.gate_up_proj,",
                 "holds 6 the config does not use", "layers.2.mlp.experts.gate_up_proj_scales"):
        assert word in str(e.value), (word, str(e.value))


def test_a_moe_config_without_experts_is_not_saved_as_gpt_oss():
    dense = models.get_config("gpt-oss-tiny", num_experts=0)
    with pytest.raises(ValueError, match="num_experts=0"):
        FAMILIES["gpt_oss"].config_to_hf(dense)


def _published(layers: int, experts: int) -> dict:
    """openai/gpt-oss-20b's and -120b's config.json (less its quantization_config)."""
    return {
        "architectures": ["GptOssForCausalLM"], "attention_bias": True,
        "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4,
        "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
        "initial_context_length": 4096, "initializer_range": 0.02,
        "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * (layers // 2),
        "max_position_embeddings": 131072, "model_type": "gpt_oss",
        "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": layers,
        "num_key_value_heads": 8, "num_local_experts": experts,
        "output_router_logits": False, "pad_token_id": 199999, "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                         "original_max_position_embeddings": 4096, "rope_type": "yarn",
                         "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
        "swiglu_limit": 7.0, "tie_word_embeddings": False,
        "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088}


PUBLISHED = {"gpt-oss-20b": (_published(24, 32), 20_914_757_184),
             "gpt-oss-120b": (_published(36, 128), 116_829_156_672)}


@pytest.mark.parametrize("preset", PUBLISHED)
def test_a_gpt_oss_preset_at_the_published_size_has_transformers_parameter_count(preset):
    published, count = PUBLISHED[preset]
    cfg = models.get_config(preset)
    ids = dict(pad_id=cfg.pad_id, eos_id=cfg.eos_id, bos_id=cfg.bos_id)
    assert FAMILIES["gpt_oss"].config_from_hf(json.loads(json.dumps(published))).replace(
        **ids) == cfg
    fields = {k: v for k, v in published.items()
              if k not in ("experts_per_token", "initial_context_length")}
    theirs = _their_count("GptOssConfig", fields)
    assert _our_count(cfg) == theirs
    assert theirs == count


def test_served_speculative_and_beam_decoding_carry_the_sinks(highest_precision):
    """gpt-oss-tiny with every sink and bias non-zero: served, speculative and beam-1
    decoding give each prompt's greedy tokens (`assert_every_decoder_gives_greedy`)."""
    cfg = models.get_config("gpt-oss-tiny", vocab_size=64, max_len=48, sliding_window=5)
    ph.assert_every_decoder_gives_greedy(cfg, "gpt_oss", seed=3)
