"""Qwen3 and Gemma: models.load against transformers' logits, models.save back to its tensors.

The same checks as tests/test_pretrained_decoders.py, for the families added with issue 28:
tiny random transformers models (fixed torch seeds, random norm scales and weights) give the
same logits loaded here, teacher-forced (to 1e-5) and through a ragged prefill then cached
steps; greedy decoding equals transformers' `generate`; load then save gives the tensors
transformers wrote, bit for bit; a bfloat16 checkpoint loads exactly; every config value we
cannot compute is refused by name; and each family's preset at its published size has
transformers' parameter count for the published config.json (counted on torch's meta device,
nothing allocated; ours by `jax.eval_shape`).
"""

from __future__ import annotations

import copy
import math

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
    assert_same_params,
    assert_same_tensors,
    copy_dir,
    edit_config,
    hf_load,
    hf_logits,
    set_fields,
    stack_layers,
    state_of,
    torch,
    transformers,
)

highest_precision = ph.highest_precision          # the shared fixture
ATOL = 1e-5

_SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=32, rms_norm_eps=1e-5, **SPECIAL)

# name -> (model_type, transformers config class, its fields, what our config must say).
CASES = {
    "qwen3-gqa-head-dim": ("qwen3", "Qwen3Config", dict(
        _SMALL, num_key_value_heads=2, head_dim=12, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 5_000.0}), dict(
        qk_norm=True, num_kv_heads=2, head_dim=12, tie_embeddings=False, use_bias=False,
        qkv_bias=False, sliding_window=None, rope_theta=5_000.0, norm_eps=1e-5)),
    "qwen3-mqa-tied-window-4": ("qwen3", "Qwen3Config", dict(
        _SMALL, vocab_size=72, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True,
        use_sliding_window=True, sliding_window=4, max_window_layers=0), dict(
        qk_norm=True, num_kv_heads=1, tie_embeddings=True, sliding_window=4)),
    # Full attention in layer 0, windows of 3 from max_window_layers=1 on.
    "qwen3-mixed-kinds-window-3": ("qwen3", "Qwen3Config", dict(
        _SMALL, num_hidden_layers=3, num_key_value_heads=2, head_dim=8,
        use_sliding_window=True, sliding_window=3, max_window_layers=1), dict(
        qk_norm=True, sliding_window=3, layer_types=("full", "sliding", "sliding"))),
    "gemma-mqa-tied-head-dim": ("gemma", "GemmaConfig", dict(
        _SMALL, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True,
        hidden_act="gelu_pytorch_tanh"), dict(
        activation="geglu", norm_scale_offset=1.0, scale_embeddings=True, num_kv_heads=1,
        head_dim=16, tie_embeddings=True, use_bias=False, qk_norm=False, norm_eps=1e-5)),
    # The original releases' spelling: hidden_act "gelu" (the tanh form; transformers saves
    # it as gelu_pytorch_tanh, and the published config of section 4 reads "gelu" as it is),
    # and hidden_activation, which v4 preferred, naming the same function.
    "gemma-gqa-untied-legacy-gelu": ("gemma", "GemmaConfig", dict(
        _SMALL, vocab_size=70, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
        hidden_act="gelu", hidden_activation="gelu_pytorch_tanh",
        rope_parameters={"rope_type": "default", "rope_theta": 1_000.0}), dict(
        activation="geglu", num_kv_heads=2, tie_embeddings=False, rope_theta=1_000.0)),
}


ckpt, _ = ph.checkpoints(CASES, "hf_checkpoints_2025", first_seed=300)


# ---------------------------------------------------------------------------------------------
# 1. Logits: teacher-forced, and a ragged prefill then cached steps.

@pytest.mark.parametrize("name", CASES)
def test_loaded_model_gives_transformers_logits_forward_prefill_and_steps(
        name, ckpt, highest_precision):
    c = ckpt(name)
    pre, f = ph.assert_loads_with_transformers_logits(c, atol=ATOL)
    ph.assert_ragged_prefill_then_steps(f, pre.params, c, atol=ATOL)
    # The scanned stack computes the same.
    scanned = models.load(c.path, scan_layers=True)
    np.testing.assert_allclose(fns(scanned.config).forward(scanned.params, c.tokens), c.logits,
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", CASES)
def test_greedy_generate_on_a_ragged_batch_equals_transformers_generate(
        name, ckpt, highest_precision):
    ph.assert_greedy_equals_generate(models.load(ckpt(name).path), ckpt(name), filler=3)


# ---------------------------------------------------------------------------------------------
# 2. Round trips and dtypes.

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


@pytest.mark.parametrize("name", CASES)
def test_a_bfloat16_checkpoint_loads_exactly(name, ckpt, tmp_path):
    c = ckpt(name)
    bf16 = copy.deepcopy(c.model).to(torch.bfloat16)
    bf16.save_pretrained(tmp_path / "bf16", safe_serialization=True)
    want = {k: v.float().numpy() for k, v in state_of(bf16).items()}
    as_f32 = models.load(str(tmp_path / "bf16"))
    as_bf16 = models.load(str(tmp_path / "bf16"), param_dtype="bfloat16")
    assert {x.dtype for x in jax.tree.leaves(as_bf16.params)} == {jnp.dtype(jnp.bfloat16)}
    assert_same_params(as_bf16.params,
                       jax.tree.map(lambda x: x.astype(jnp.bfloat16), as_f32.params))
    models.save(str(tmp_path / "again"), as_bf16.config, as_bf16.params)
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "again"))
    assert_same_tensors(state_of(bf16), again)
    got = {k: v.float().numpy() for k, v in state_of(again).items()}
    assert all(np.array_equal(got[k], want[k]) for k in want)


# ---------------------------------------------------------------------------------------------
# 3. What cannot be computed is refused, naming the field and the value.

REFUSED = [
    ("qwen3-gqa-head-dim", dict(attention_bias=True), ["attention_bias", "True"]),
    ("qwen3-gqa-head-dim", dict(hidden_act="gelu"), ["hidden_act", "gelu"]),
    ("qwen3-gqa-head-dim", dict(rope_parameters={"rope_type": "proportional", "factor": 2.0,
                                                 "rope_theta": 1e4}),
     ["rope_type", "proportional"]),
    ("qwen3-gqa-head-dim", dict(layer_types=["sliding_attention"] * 2, sliding_window=4),
     ["layer_types", "use_sliding_window"]),
    ("qwen3-gqa-head-dim", dict(layer_types=["full_attention"]), ["layer_types", "2 layers"]),
    ("qwen3-gqa-head-dim", dict(mlp_bias=True), ["mlp_bias"]),
    ("gemma-mqa-tied-head-dim", dict(attention_bias=True), ["attention_bias", "True"]),
    ("gemma-mqa-tied-head-dim", dict(hidden_act="gelu_exact"), ["hidden_act", "gelu_exact"]),
    ("gemma-mqa-tied-head-dim", dict(hidden_act="relu"), ["hidden_act", "relu"]),
    ("gemma-mqa-tied-head-dim", dict(hidden_act="gelu", hidden_activation="silu"),
     ["hidden_activation", "silu", "v4 and v5"]),
    ("gemma-mqa-tied-head-dim", dict(use_bidirectional_attention=True),
     ["use_bidirectional_attention", "True"]),
    ("gemma-mqa-tied-head-dim", dict(rope_parameters={"rope_type": "linear",
                                                      "rope_theta": 1e4}),
     ["linear", "needs factor"]),
    ("gemma-mqa-tied-head-dim", dict(final_logit_softcapping=30.0),
     ["final_logit_softcapping"]),
]


@pytest.mark.parametrize("name,fields,words", REFUSED,
                         ids=[f"{n}-{next(iter(f))}" for n, f, _ in REFUSED])
def test_a_config_value_that_cannot_be_computed_is_refused_by_name(name, fields, words, ckpt,
                                                                   tmp_path):
    path = edit_config(copy_dir(ckpt(name).path, tmp_path / "m"), set_fields(**fields))
    ph.assert_refused_by_name(path, words)


def test_sizes_a_qwen3_config_omits_are_qwen3configs_defaults(ckpt, tmp_path):
    def drop(hf):
        del hf["head_dim"], hf["num_key_value_heads"]
    path = edit_config(copy_dir(ckpt("qwen3-gqa-head-dim").path, tmp_path / "m"), drop)
    theirs = transformers.AutoConfig.from_pretrained(path)
    with pytest.raises(ValueError, match="num_kv_heads=32"):      # 4 heads, 32 kv heads
        models.pretrained.read_config(path)
    assert (theirs.head_dim, theirs.num_key_value_heads) == (128, 32)
    edit_config(path, set_fields(num_key_value_heads=None))         # null: num_heads
    ours = models.pretrained.read_config(path)[1]
    assert (ours.head_dim, ours.num_kv_heads) == (128, 4)


def test_a_qk_norm_config_is_saved_only_as_a_type_that_has_the_norms():
    plain = models.get_config("llama-tiny", vocab_size=64)
    for model_type in ("llama", "mistral", "qwen2"):
        with pytest.raises(ValueError, match="qk_norm=True"):
            FAMILIES[model_type].config_to_hf(plain.replace(qk_norm=True))
    with pytest.raises(ValueError, match="qk_norm=False"):
        FAMILIES["qwen3"].config_to_hf(plain)


# ---------------------------------------------------------------------------------------------
# 4. Presets at the published sizes have transformers' parameter count.

# The published config.json files (Qwen/Qwen3-0.6B, google/gemma-2b on the hub).
PUBLISHED = {
    "qwen3-0.6b": ("Qwen3Config", {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
        "initializer_range": 0.02, "intermediate_size": 3072,
        "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
        "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
        "vocab_size": 151936}, 596_049_920),
    "gemma-2b": ("GemmaConfig", {
        "architectures": ["GemmaForCausalLM"], "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 2, "eos_token_id": 1, "head_dim": 256,
        "hidden_act": "gelu", "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 16384,
        "max_position_embeddings": 8192, "model_type": "gemma", "num_attention_heads": 8,
        "num_hidden_layers": 18, "num_key_value_heads": 1, "pad_token_id": 0,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000.0,
        "torch_dtype": "bfloat16", "transformers_version": "4.38.0.dev0", "use_cache": True,
        "vocab_size": 256000}, 2_506_172_416),
}


def _our_count(cfg: models.TransformerConfig) -> int:
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    shapes = jax.eval_shape(models.build(cfg).init, jax.random.key(0), tokens)["params"]
    return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))


def _their_count(class_name: str, fields: dict) -> int:
    hf = {k: v for k, v in fields.items() if k not in ("architectures", "model_type")}
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            getattr(transformers, class_name)(**hf))
    return sum(p.numel() for p in model.parameters())          # tied tensors once


@pytest.mark.parametrize("preset", PUBLISHED)
def test_a_preset_at_the_published_size_has_transformers_parameter_count(preset):
    class_name, published, count = PUBLISHED[preset]
    cfg = models.get_config(preset)
    # The preset is the published architecture (its special ids are the project's own).
    ids = dict(pad_id=cfg.pad_id, eos_id=cfg.eos_id, bos_id=cfg.bos_id)
    assert FAMILIES[published["model_type"]].config_from_hf(published).replace(**ids) == cfg
    assert _our_count(cfg) == _their_count(class_name, published) == count


# ---------------------------------------------------------------------------------------------
# 5. Gemma's embedding scale is sqrt(D) rounded to the compute dtype, as transformers rounds it.

def test_gemma_scales_embeddings_by_sqrt_d_rounded_to_the_compute_dtype(ckpt):
    c = ckpt("gemma-mqa-tied-head-dim")
    pre = models.load(c.path, dtype="bfloat16", param_dtype="bfloat16")
    tokens = jnp.asarray(c.tokens)
    ours = pre.model.apply({"params": pre.params}, tokens, jnp.zeros_like(tokens), True,
                           method=lambda m, *a: m.embed(*a))
    model = copy.deepcopy(c.model).to(torch.bfloat16)
    with torch.no_grad():            # transformers' scaled embedding (sqrt(D) in its dtype)
        theirs = model.model.embed_tokens(torch.as_tensor(c.tokens, dtype=torch.long))
    assert 32 ** 0.5 != float(torch.tensor(32 ** 0.5, dtype=torch.bfloat16))   # it rounds
    unrounded = pre.params["tokens"]["embedding"].astype(jnp.float32)[tokens] * 32 ** 0.5
    assert not np.array_equal(np.asarray(unrounded.astype(jnp.bfloat16).astype(jnp.float32)),
                              theirs.float().numpy())
    np.testing.assert_array_equal(np.asarray(ours.astype(jnp.float32)),
                                  theirs.float().numpy())
