"""Gemma 2 and Gemma 3 (text): the layer variants they need, then models.load against
transformers' logits and models.save back to its tensors.

1. The variants, on their own: attention logit soft-capping and per-layer kinds (sliding or
   full, with their own RoPE bases) give the same numbers under xla and chunked attention and
   under looped and scanned layers, and a ragged prefill then cached steps give the forward
   pass's logits for every kind across the window.
2. The families (as tests/test_pretrained_2025.py does for qwen3 and gemma): tiny random
   transformers models whose windows are shorter than the sequence, so every sliding and
   full pattern crosses its window, give the same logits forward (to 1e-5) and through a
   ragged prefill then cached steps; greedy decoding equals `generate`; load then save is
   bit for bit; bfloat16 loads exactly; refused values are named; the presets have
   transformers' parameter counts for the published configs.
"""

from __future__ import annotations

import copy
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models.kernels import attend
from models.masks import MaskSpec, positions_like
from models.pretrained import FAMILIES
from models.rope_scaling import LinearRopeScaling
from tests import pretrained_helpers as ph
from tests.helpers import fns, random_tokens, tiny

highest_precision = ph.highest_precision          # the shared fixture
torch, transformers = ph.torch, ph.transformers
ATOL = 1e-5

# ---------------------------------------------------------------------------------------------
# 1. The variants.


def _reference(q, k, v, mask, scale, cap):
    """softmax(cap * tanh(scale q k^T / cap), masked) v in numpy float64, heads equal in
    number (the oracle)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    logits = np.einsum("btnh,bsnh->bnts", q, k) * scale
    logits = np.tanh(logits / cap) * cap
    logits = np.where(mask[:, None], logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnh->btnh", probs, v)


@pytest.mark.parametrize("window_on", [None, True, False])
def test_soft_capping_and_windows_are_the_same_in_xla_and_chunked_attention(
        window_on, highest_precision):
    B, T, N, H, cap, W = 2, 11, 2, 8, 2.0, 3
    kq, kk, kv, kg = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (B, T, N, H)) * 3.0      # logits beyond the cap
    k = jax.random.normal(kk, (B, T, N, H)) * 3.0
    v = jax.random.normal(kv, (B, T, N, H))
    index = positions_like(q[..., 0, 0])
    flag = None if window_on is None else jnp.asarray(window_on)
    spec = MaskSpec(index, index, causal=True, window=W, window_on=flag, aligned=True)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    mask = (j <= i) & ((j > i - W) | (window_on is False))
    want = _reference(q, k, v, np.broadcast_to(mask, (B, T, T)), H ** -0.5, cap)
    d_out = jax.random.normal(kg, (B, T, N, H))

    def run(impl):
        def f(q, k, v):
            out = attend(q, k, v, spec, impl=impl, scale=H ** -0.5, softcap=cap, block=4)[0]
            return out, jnp.sum(out * d_out)
        out, _ = f(q, k, v)
        grads = jax.grad(lambda *a: f(*a)[1], argnums=(0, 1, 2))(q, k, v)
        return out, grads

    (out_x, grads_x), (out_c, grads_c) = run("xla"), run("chunked")
    np.testing.assert_allclose(out_x, want, atol=1e-5, rtol=0)
    np.testing.assert_allclose(out_c, want, atol=1e-5, rtol=0)
    for gx, gc in zip(grads_x, grads_c, strict=True):
        np.testing.assert_allclose(gc, gx, atol=1e-5, rtol=0)
    uncapped = attend(q, k, v, spec, impl="xla", scale=H ** -0.5)[0]
    assert not np.allclose(uncapped, out_x, atol=1e-2)          # the cap changed something


def _kinds_config(**overrides) -> models.TransformerConfig:
    """Sliding, full, sliding layers (window 3 over 12 tokens) with every Gemma 2 / 3 part."""
    fields = dict(positions="rope", norm="rmsnorm", norm_scale_offset=1.0, activation="geglu",
                  use_bias=False, num_layers=3, num_kv_heads=2, head_dim=8, sliding_window=3,
                  layer_types=("sliding", "full", "sliding"), rope_local_theta=100.0,
                  rope_theta=10_000.0, attn_logit_softcapping=1.5, final_logit_softcapping=4.0,
                  sublayer_output_norm=True, query_pre_attn_scalar=20.0, qk_norm=True,
                  scale_embeddings=True)
    return tiny(**{**fields, **overrides})


def _randomized(params, seed: int = 1):
    """Every parameter random (norm scales too), so no part is the identity."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [jax.random.normal(key, x.shape, x.dtype) * 0.3
                                     for key, x in zip(keys, leaves, strict=True)])


def test_per_layer_kinds_agree_looped_scanned_xla_chunked_and_cached(highest_precision):
    cfg = _kinds_config()
    params = _randomized(fns(cfg).init())
    tokens = random_tokens(0, (2, 12), cfg.vocab_size)
    want = fns(cfg).forward(params, tokens)
    scanned = cfg.replace(scan_layers=True)
    stacked = ph.stack_layers(params)
    for other, p in ((cfg.replace(attention_impl="chunked", attention_block=4), params),
                     (scanned, stacked),
                     (scanned.replace(attention_impl="chunked", attention_block=4), stacked),
                     (scanned.replace(remat=True), stacked),
                     (cfg.replace(remat=True), params)):
        np.testing.assert_allclose(fns(other).forward(p, tokens), want, atol=ATOL, rtol=0,
                                   err_msg=str(other.scan_layers))
    # A ragged prefill then cached steps, looped and scanned: each kind across its window.
    lens = np.array([2, 5])
    for c, p in ((cfg, params), (scanned, stacked)):
        f = fns(c)
        cache = models.KVCache.create(c, 2, 16)
        logits, cache = f.prefill(p, tokens[:, :5], jnp.asarray(lens, jnp.int32), cache)
        for b, n in enumerate(lens):
            np.testing.assert_allclose(logits[b, :n], want[b, :n], atol=ATOL, rtol=0)
        for i in range(12 - 5):
            at = lens + i
            step, cache = f.step(p, tokens[np.arange(2), at], cache)
            np.testing.assert_allclose(step, want[np.arange(2), at], atol=ATOL, rtol=0,
                                       err_msg=f"step {i}, scanned {c.scan_layers}")


@pytest.mark.parametrize("change", [
    dict(layer_types=("full", "full", "sliding")), dict(rope_local_theta=None),
    dict(attn_logit_softcapping=None), dict(final_logit_softcapping=None),
    dict(query_pre_attn_scalar=None)])
def test_each_variant_changes_the_logits(change):
    cfg = _kinds_config()
    params = _randomized(fns(cfg).init())
    tokens = random_tokens(0, (2, 12), cfg.vocab_size)
    other = cfg.replace(**change)
    assert not np.allclose(fns(other).forward(params, tokens),
                           fns(cfg).forward(params, tokens), atol=1e-3)


def test_sublayer_output_norms_are_parameters_of_their_own():
    layer = fns(_kinds_config()).init()["decoder"]["layer_0"]
    assert {"self_attention_output_norm", "mlp_output_norm"} <= set(layer)
    assert "mlp_output_norm" not in fns(_kinds_config(sublayer_output_norm=False)).init()[
        "decoder"]["layer_0"]


@pytest.mark.parametrize("fields,words", [
    (dict(layer_types=("full", "sliding")), ["layer_types", "num_layers=3"]),
    (dict(layer_types=("full", "local", "full")), ["layer_types", "'local'"]),
    (dict(sliding_window=None), ["'sliding'", "sliding_window=None"]),
    (dict(attn_logit_softcapping=0.0), ["attn_logit_softcapping=0.0"]),
    (dict(final_logit_softcapping=-1.0), ["final_logit_softcapping=-1.0"]),
    (dict(query_pre_attn_scalar=4.0, scale_attention=False), ["query_pre_attn_scalar"]),
    (dict(sublayer_output_norm=True, norm_position="post"), ["sublayer_output_norm"]),
    (dict(positions="learned"), ["rope_local_theta", "positions='rope'"]),
])
def test_inconsistent_variant_fields_are_refused_by_name(fields, words):
    with pytest.raises(ValueError) as info:
        _kinds_config(**fields)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


# ---------------------------------------------------------------------------------------------
# 2. The families: tiny random transformers models (windows of 3 and 4 over 10 tokens).

_SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4,
              max_position_embeddings=32, rms_norm_eps=1e-5, **ph.SPECIAL)

# name -> (model_type, transformers config class, its fields, what our config must say).
CASES = {
    # Gemma2Config's own pattern (sliding, full, sliding), soft-caps small enough to bite.
    "gemma2-alternating-window-3-caps": ("gemma2", "Gemma2Config", dict(
        _SMALL, num_hidden_layers=3, num_key_value_heads=2, head_dim=8, sliding_window=3,
        query_pre_attn_scalar=12, attn_logit_softcapping=1.0, final_logit_softcapping=2.0,
        tie_word_embeddings=True), dict(
        layer_types=("sliding", "full", "sliding"), sliding_window=3,
        query_pre_attn_scalar=12.0, attn_logit_softcapping=1.0, final_logit_softcapping=2.0,
        sublayer_output_norm=True, norm_scale_offset=1.0, activation="geglu",
        scale_embeddings=True, num_kv_heads=2, head_dim=8, tie_embeddings=True, qk_norm=False)),
    "gemma2-listed-kinds-untied-no-caps": ("gemma2", "Gemma2Config", dict(
        _SMALL, vocab_size=70, num_hidden_layers=2, num_key_value_heads=1, head_dim=16,
        sliding_window=4, layer_types=["full_attention", "sliding_attention"],
        attn_logit_softcapping=None, final_logit_softcapping=None, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000.0}), dict(
        layer_types=("full", "sliding"), attn_logit_softcapping=None,
        final_logit_softcapping=None, tie_embeddings=False, rope_theta=1_000.0,
        query_pre_attn_scalar=256.0)),
    # Gemma3TextConfig from v4-style fields: a pattern of 2 (sliding, full, sliding), the
    # sliding layers' RoPE base apart.
    "gemma3-pattern-2-local-base": ("gemma3_text", "Gemma3TextConfig", dict(
        _SMALL, num_hidden_layers=3, num_key_value_heads=2, head_dim=8, sliding_window=3,
        sliding_window_pattern=2, rope_theta=10_000.0, rope_local_base_freq=100.0,
        query_pre_attn_scalar=12, tie_word_embeddings=True), dict(
        layer_types=("sliding", "full", "sliding"), qk_norm=True, rope_theta=10_000.0,
        rope_local_theta=100.0, rope_scaling=None, attn_logit_softcapping=None,
        final_logit_softcapping=None, sublayer_output_norm=True, sliding_window=3)),
    "gemma3-listed-kinds-cap-untied": ("gemma3_text", "Gemma3TextConfig", dict(
        _SMALL, vocab_size=70, num_hidden_layers=2, num_key_value_heads=1, head_dim=16,
        sliding_window=4, layer_types=["full_attention", "sliding_attention"],
        final_logit_softcapping=2.0, tie_word_embeddings=False,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                            "rope_theta": 500.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}}),
        dict(layer_types=("full", "sliding"), rope_theta=500.0, rope_local_theta=50.0,
             rope_scaling=LinearRopeScaling(factor=4.0),
             attn_logit_softcapping=None, final_logit_softcapping=2.0, tie_embeddings=False)),
}


ckpt, _ = ph.checkpoints(CASES, "hf_checkpoints_gemma2", first_seed=400)


@pytest.mark.parametrize("name", CASES)
def test_loaded_model_gives_transformers_logits_forward_prefill_and_steps(
        name, ckpt, highest_precision):
    c = ckpt(name)
    pre, f = ph.assert_loads_with_transformers_logits(c, atol=ATOL)
    ph.assert_ragged_prefill_then_steps(f, pre.params, c, atol=ATOL)
    scanned = models.load(c.path, scan_layers=True)
    fs = fns(scanned.config)
    np.testing.assert_allclose(fs.forward(scanned.params, c.tokens), c.logits, atol=ATOL,
                               rtol=0)
    ph.assert_ragged_prefill_then_steps(fs, scanned.params, c, atol=ATOL)


@pytest.mark.parametrize("name", CASES)
def test_greedy_generate_on_a_ragged_batch_equals_transformers_generate(
        name, ckpt, highest_precision):
    c = ckpt(name)
    ph.assert_greedy_equals_generate(models.load(c.path), c, filler=3)


@pytest.mark.parametrize("name", CASES)
def test_load_then_save_gives_the_tensors_transformers_wrote_bit_for_bit(name, ckpt, tmp_path):
    c = ckpt(name)
    pre = models.load(c.path)
    out = str(tmp_path / "again")
    assert models.save(out, pre.config, pre.params) == c.model_type
    again = ph.hf_load(out)
    assert type(again) is type(c.model)
    ph.assert_same_tensors(c.state, again)
    np.testing.assert_array_equal(ph.hf_logits(again, c.tokens), c.logits)
    assert models.load(out).config == pre.config
    ph.assert_same_params(models.load(out).params, pre.params)


@pytest.mark.parametrize("name", CASES)
def test_a_bfloat16_checkpoint_loads_exactly(name, ckpt, tmp_path):
    c = ckpt(name)
    bf16 = copy.deepcopy(c.model).to(torch.bfloat16)
    bf16.save_pretrained(tmp_path / "bf16", safe_serialization=True)
    as_f32 = models.load(str(tmp_path / "bf16"))
    as_bf16 = models.load(str(tmp_path / "bf16"), param_dtype="bfloat16")
    assert {x.dtype for x in jax.tree.leaves(as_bf16.params)} == {jnp.dtype(jnp.bfloat16)}
    ph.assert_same_params(as_bf16.params,
                          jax.tree.map(lambda x: x.astype(jnp.bfloat16), as_f32.params))
    models.save(str(tmp_path / "again"), as_bf16.config, as_bf16.params)
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "again"))
    ph.assert_same_tensors(ph.state_of(bf16), again)


REFUSED = [
    ("gemma2-alternating-window-3-caps", dict(use_bidirectional_attention=True),
     ["use_bidirectional_attention", "True"]),
    ("gemma2-alternating-window-3-caps", dict(attention_bias=True), ["attention_bias"]),
    ("gemma2-alternating-window-3-caps", dict(hidden_activation="relu"),
     ["hidden_activation", "relu"]),
    ("gemma2-alternating-window-3-caps", dict(hidden_act="silu"), ["hidden_act", "silu"]),
    ("gemma2-alternating-window-3-caps", dict(sliding_window=None), ["sliding_window"]),
    ("gemma2-alternating-window-3-caps", dict(layer_types=["full_attention"] * 2),
     ["layer_types", "3 layers"]),
    ("gemma2-alternating-window-3-caps", dict(layer_types=["chunked_attention"] * 3),
     ["layer_types", "chunked_attention"]),
    ("gemma2-alternating-window-3-caps", dict(attn_logit_softcapping=-1.0),
     ["attn_logit_softcapping=-1.0"]),
    ("gemma3-pattern-2-local-base", dict(rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "rope_theta": 1e4}}),
     ["rope_parameters", "unscaled"]),
    ("gemma3-pattern-2-local-base", dict(rope_parameters={"rope_type": "default",
                                                          "rope_theta": 1e4}),
     ["rope_parameters", "full_attention"]),
    ("gemma3-pattern-2-local-base", dict(attn_logit_softcapping=50.0),
     ["attn_logit_softcapping", "50.0", "does not apply"]),
    ("gemma3-pattern-2-local-base", dict(use_bidirectional_attention=True),
     ["use_bidirectional_attention"]),
    ("gemma3-pattern-2-local-base", dict(hidden_activation="gelu_exact"),
     ["hidden_activation", "gelu_exact"]),
]


@pytest.mark.parametrize("name,fields,words", REFUSED,
                         ids=[f"{n}-{next(iter(f))}" for n, f, _ in REFUSED])
def test_a_config_value_that_cannot_be_computed_is_refused_by_name(name, fields, words, ckpt,
                                                                   tmp_path):
    path = ph.edit_config(ph.copy_dir(ckpt(name).path, tmp_path / "m"),
                          ph.set_fields(**fields))
    ph.assert_refused_by_name(path, words)


def test_gemma2_variants_are_saved_only_as_a_type_that_has_them():
    plain = models.get_config("gemma-2b", num_layers=2, vocab_size=64, d_model=32,
                              head_dim=8, num_heads=4, mlp_dim=48)
    for change in (dict(sublayer_output_norm=True), dict(attn_logit_softcapping=5.0),
                   dict(layer_types=("full", "full")), dict(query_pre_attn_scalar=8.0)):
        with pytest.raises(ValueError, match=next(iter(change))):
            FAMILIES["gemma"].config_to_hf(plain.replace(**change))
    with pytest.raises(ValueError, match="sublayer_output_norm=False"):
        FAMILIES["gemma2"].config_to_hf(plain.replace(layer_types=("full", "full"),
                                                      query_pre_attn_scalar=8.0))


# ---------------------------------------------------------------------------------------------
# 3. Presets at the published sizes have transformers' parameter count.

# The published config.json files (google/gemma-2-2b, google/gemma-3-1b-it on the hub).
PUBLISHED = {
    "gemma2-2b": ("Gemma2Config", {
        "architectures": ["Gemma2ForCausalLM"], "attention_bias": False,
        "attention_dropout": 0.0, "attn_logit_softcapping": 50.0, "bos_token_id": 2,
        "cache_implementation": "hybrid", "eos_token_id": 1, "final_logit_softcapping": 30.0,
        "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304,
        "initializer_range": 0.02, "intermediate_size": 9216, "max_position_embeddings": 8192,
        "model_type": "gemma2", "num_attention_heads": 8, "num_hidden_layers": 26,
        "num_key_value_heads": 4, "pad_token_id": 0, "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
        "torch_dtype": "float32", "transformers_version": "4.42.4", "use_cache": True,
        "vocab_size": 256000}),
    "gemma3-1b": ("Gemma3TextConfig", {
        "architectures": ["Gemma3ForCausalLM"], "attention_bias": False,
        "attention_dropout": 0.0, "attn_logit_softcapping": None, "bos_token_id": 2,
        "cache_implementation": "hybrid", "eos_token_id": [1, 106],
        "final_logit_softcapping": None, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
        "initializer_range": 0.02, "intermediate_size": 6912,
        "max_position_embeddings": 32768, "model_type": "gemma3_text",
        "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
        "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
        "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
        "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 262144}),
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
    class_name, published = PUBLISHED[preset]
    cfg = models.get_config(preset)
    ids = dict(pad_id=cfg.pad_id, eos_id=cfg.eos_id, bos_id=cfg.bos_id)
    assert FAMILIES[published["model_type"]].config_from_hf(published).replace(**ids) == cfg
    assert _our_count(cfg) == _their_count(class_name, published)
