"""models.load against transformers' logits, and models.save back to transformers' tensors.

Tiny random checkpoints of every supported family (tests/pretrained_helpers.py): a loaded
model gives transformers' logits (fp32, highest matmul precision, eager attention) teacher-
forced and through a ragged prefill then cached steps; `models.save` of what was loaded
gives files transformers loads to the same tensors bit for bit; the project's own
model_type round-trips configs no Hugging Face class expresses; bfloat16 and sharded
checkpoints load exactly.
"""

from __future__ import annotations

import copy
import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from tests import pretrained_helpers as ph
from tests.helpers import fns, tiny
from tests.pretrained_helpers import (
    ATOL,
    CASES,
    assert_same_params,
    assert_same_tensors,
    hf_load,
    hf_logits,
    stack_layers,
    state_of,
    torch,
    transformers,
)

ckpt, highest_precision = ph.ckpt, ph.highest_precision        # the shared fixtures


# ---------------------------------------------------------------------------------------------
# 1. Logits: teacher-forced, and a ragged prefill then cached steps, equal transformers'.

@pytest.mark.parametrize("name", CASES)
def test_loaded_model_gives_transformers_logits_forward_prefill_and_steps(
        name, ckpt, highest_precision):
    c = ckpt(name)
    pre = models.load(c.path)
    cfg = pre.config
    assert pre.model_type == c.model_type and pre.tokenizer is None
    for field, value in c.expect.items():
        assert getattr(cfg, field) == value, field
    assert (cfg.pad_id, cfg.bos_id, cfg.eos_id) == (4, 1, 2)
    assert pre.generation.eos_ids == (2,)
    assert cfg.param_dtype == jnp.float32
    chex.assert_tree_all_finite(pre.params)
    assert pre.model == models.build(cfg)
    f = fns(cfg)                                 # pre.model.apply, jitted once per config
    params, tokens = pre.params, jnp.asarray(c.tokens)

    full = f.forward(params, tokens)
    np.testing.assert_allclose(full, c.logits, atol=ATOL, rtol=0)

    ph.assert_ragged_prefill_then_steps(f, params, c)


# ---------------------------------------------------------------------------------------------
# 2. Round trips.

@pytest.mark.parametrize("name", CASES)
def test_load_then_save_gives_files_transformers_loads_to_the_same_tensors(name, ckpt,
                                                                          tmp_path):
    c = ckpt(name)
    pre = models.load(c.path)
    assert models.save(str(tmp_path / "same"), pre.config, pre.params,
                       model_type=pre.model_type) == c.model_type
    with open(tmp_path / "same" / "config.json") as f:
        assert json.load(f)["model_type"] == c.model_type
    again = hf_load(str(tmp_path / "same"))
    assert type(again) is type(c.model)
    assert_same_tensors(c.state, again)
    # The config was written too: the same tensors compute the same logits.
    np.testing.assert_array_equal(hf_logits(again, c.tokens), c.logits)
    # Saved without a model_type: the first type that expresses the config (mistral without
    # a window is llama), still loaded by transformers to the same tensors and logits.
    default = str(tmp_path / "default")
    if models.save(default, pre.config, pre.params) == c.model_type:
        for file in ("config.json", "model.safetensors"):
            with open(tmp_path / "same" / file, "rb") as a, open(os.path.join(default, file),
                                                                 "rb") as b:
                assert a.read() == b.read(), file
    else:
        assert name == "mistral-no-window"
        assert_same_tensors(c.state, hf_load(default))
        np.testing.assert_array_equal(hf_logits(hf_load(default), c.tokens), c.logits)
    # And ours reads our own files back to the same parameters.
    assert_same_params(models.load(str(tmp_path / "same")).params, pre.params)
    # Loaded for a scanned model: the same parameters stacked; saved from it: the same file.
    scanned = models.load(c.path, scan_layers=True)
    assert scanned.config == pre.config.replace(scan_layers=True)
    assert_same_params(scanned.params, stack_layers(pre.params))
    models.save(str(tmp_path / "scanned"), scanned.config, scanned.params,
                model_type=pre.model_type)
    with open(tmp_path / "same" / "model.safetensors", "rb") as a, open(
            tmp_path / "scanned" / "model.safetensors", "rb") as b:
        assert a.read() == b.read()


def _random_params(cfg: models.TransformerConfig, seed: int) -> dict:
    """Random values of every parameter (no zero biases or unit scales, unlike an init)."""
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    args = (tokens, tokens) if cfg.is_encoder_decoder else (tokens,)
    shapes = jax.eval_shape(models.build(cfg).init, jax.random.key(0), *args)["params"]
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape), s.dtype), shapes)


ZOO_CONFIGS = {
    "transformer-tiny": models.get_config(
        "transformer-tiny", vocab_size=64, d_model=32, mlp_dim=48, max_len=32, pad_id=5,
        eos_id=6, bos_id=7),
    "decoder-sinusoidal": tiny(vocab_size=70, positions="sinusoidal", num_kv_heads=2,
                               norm_eps=1e-5),
    "decoder-learned-post-norm-window": tiny(positions="learned", norm_position="post",
                                             sliding_window=5, activation="gelu",
                                             tie_embeddings=False, eos_id=None),
}


@pytest.mark.parametrize("name", ZOO_CONFIGS)
def test_the_projects_own_model_type_round_trips_configs_no_hf_class_expresses(name, tmp_path):
    cfg = ZOO_CONFIGS[name]
    params = _random_params(cfg, seed=len(name))
    path = str(tmp_path / "zoo")
    assert models.save(path, cfg, params) == "jax_transformer_zoo"
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["model_type"] == "jax_transformer_zoo"

    pre = models.load(path)
    assert pre.config == cfg and pre.model_type == "jax_transformer_zoo"
    assert_same_params(pre.params, params)

    scanned = models.load(path, scan_layers=True)
    assert scanned.config == cfg.replace(scan_layers=True)
    assert_same_params(scanned.params, stack_layers(params))
    chex.assert_trees_all_equal_shapes_and_dtypes(
        scanned.params, _random_params(cfg.replace(scan_layers=True), 0))

    # Saving the scanned parameters writes the same tensors (one per layer); the saved
    # config keeps scan_layers, a runtime field that a load may override.
    models.save(str(tmp_path / "from_scanned"), scanned.config, scanned.params)
    unscanned = models.load(str(tmp_path / "from_scanned"), scan_layers=False)
    assert unscanned.config == cfg
    assert_same_params(unscanned.params, params)


# ---------------------------------------------------------------------------------------------
# 3. Dtypes and shards.

def test_a_bfloat16_checkpoint_loads_exactly_as_float32_or_as_bfloat16(ckpt, tmp_path):
    c = ckpt("llama-gqa-tied-llama3-head-dim")
    bf16 = copy.deepcopy(c.model).to(torch.bfloat16)
    bf16.save_pretrained(tmp_path / "bf16", safe_serialization=True)
    # The same values in float32 (exact: every bfloat16 is a float32).
    copy.deepcopy(bf16).float().save_pretrained(tmp_path / "f32", safe_serialization=True)
    reference = models.load(str(tmp_path / "f32")).params
    for x in jax.tree.leaves(reference):
        np.testing.assert_array_equal(x, x.astype(jnp.bfloat16).astype(jnp.float32))

    as_f32 = models.load(str(tmp_path / "bf16"))
    assert as_f32.config.param_dtype == jnp.float32
    assert_same_params(as_f32.params, reference)        # float32, values exact

    as_bf16 = models.load(str(tmp_path / "bf16"), param_dtype="bfloat16")
    assert as_bf16.config.param_dtype == jnp.bfloat16
    assert {x.dtype for x in jax.tree.leaves(as_bf16.params)} == {jnp.dtype(jnp.bfloat16)}
    assert_same_params(
        as_bf16.params, jax.tree.map(lambda x: x.astype(jnp.bfloat16), reference))

    # Saved as bfloat16, transformers reads back the bfloat16 tensors it wrote.
    models.save(str(tmp_path / "again"), as_bf16.config, as_bf16.params)
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "again"))
    assert_same_tensors(state_of(bf16), again)


def test_sharded_checkpoints_load_and_save(ckpt, tmp_path, highest_precision):
    c = ckpt("llama-gqa-tied-llama3-head-dim")
    c.model.save_pretrained(tmp_path / "hf_shards", max_shard_size="20KB")
    shards = [n for n in os.listdir(tmp_path / "hf_shards") if n.endswith(".safetensors")]
    assert len(shards) > 2 and "model.safetensors" not in shards
    assert os.path.exists(tmp_path / "hf_shards" / "model.safetensors.index.json")

    whole, sharded = models.load(c.path), models.load(str(tmp_path / "hf_shards"))
    assert sharded.config == whole.config
    assert_same_params(sharded.params, whole.params)
    f = fns(whole.config)
    tokens = jnp.asarray(c.tokens)
    np.testing.assert_array_equal(f.forward(sharded.params, tokens),
                                  f.forward(whole.params, tokens))
    np.testing.assert_allclose(f.forward(sharded.params, tokens), c.logits, atol=ATOL, rtol=0)

    out = tmp_path / "our_shards"
    models.save(str(out), whole.config, whole.params, max_shard_bytes=16_000)
    names = sorted(os.listdir(out))
    ours = [n for n in names if n.endswith(".safetensors")]
    assert len(ours) > 2 and "model.safetensors" not in ours
    with open(out / "model.safetensors.index.json") as f_:
        weight_map = json.load(f_)["weight_map"]
    assert sorted(set(weight_map.values())) == ours
    for shard in ours:
        assert os.path.getsize(out / shard) < 16_000 + 4_096        # + its JSON header
    assert_same_tensors(c.state, hf_load(str(out)))
    assert_same_params(models.load(str(out)).params, whole.params)


# ---------------------------------------------------------------------------------------------
# 5. Greedy decoding of a ragged batch equals transformers' `generate`, token for token.

GENERATE_CASES = ["gpt2-tied", "llama-gqa-tied-llama3-head-dim", "mistral-gqa-window-4",
                  "qwen2-gqa"]


@pytest.mark.parametrize("name", GENERATE_CASES)
def test_greedy_generate_on_a_ragged_batch_equals_transformers_generate(
        name, ckpt, highest_precision):
    """Ours decodes both prompts in one right-padded batch (3 and 6 tokens, junk padding);
    transformers decodes each alone, unpadded (its left padding would count pad slots in
    Mistral's window). Both stop at the config's end token (2) by default; the window of 4
    is shorter than every sequence here."""
    ph.assert_greedy_equals_generate(models.load(ckpt(name).path), ckpt(name), filler=63)
