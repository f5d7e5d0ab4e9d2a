"""Phi-3: models.load against transformers' logits, models.save back to its tensors.

The checks of tests/test_pretrained_2025.py for `phi3`: tiny random Phi3ForCausalLM models
(fused qkv_proj and gate_up_proj; partial rotary; a sliding window; LongRoPE) give the same
logits loaded here, teacher-forced and through a ragged prefill then cached steps (against
transformers' own cached decoding of each row: LongRoPE switches factors mid-decode there);
greedy decoding equals transformers' `generate`; load then save gives transformers' tensors
bit for bit; a bfloat16 checkpoint loads exactly; refused values are named; and the
phi3-mini preset has transformers' parameter count for Phi-3-mini's published config.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

import models
from models.pretrained import FAMILIES
from tests import pretrained_helpers as ph
from tests.helpers import fns
from tests.pretrained_helpers import (
    PROMPT_LENS,
    SPECIAL,
    T,
    assert_same_params,
    assert_same_tensors,
    copy_dir,
    edit_config,
    hf_load,
    hf_logits,
    set_fields,
)
from tests.test_pretrained_2025 import _our_count, _their_count
from tests.test_rope_scaling import _cached_reference

highest_precision = ph.highest_precision
ATOL = 1e-5
_SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=32, rms_norm_eps=1e-5, **SPECIAL)
_RNG = np.random.default_rng(3)
LONGROPE = {"rope_type": "longrope", "rope_theta": 500.0,
            "short_factor": [float(x) for x in 1 + _RNG.random(4)],
            "long_factor": [float(x) for x in 2 + 4 * _RNG.random(4)]}

# name -> (the transformers config's fields, what our config must say).
CASES = {
    "phi3-mha-untied": (dict(_SMALL, num_key_value_heads=4), dict(
        num_kv_heads=4, tie_embeddings=False, sliding_window=None, rope_scaling=None,
        partial_rotary_factor=1.0, use_bias=False)),
    "phi3-gqa-tied-window-4-partial": (dict(
        _SMALL, vocab_size=72, num_key_value_heads=2, tie_word_embeddings=True,
        sliding_window=4, partial_rotary_factor=0.5), dict(
        num_kv_heads=2, tie_embeddings=True, sliding_window=4, partial_rotary_factor=0.5)),
    # Long factors past 8 tokens: the forward of T = 10 uses them, a prefill of 8 does not.
    "phi3-longrope": (dict(_SMALL, num_key_value_heads=2, rope_parameters=LONGROPE,
                           original_max_position_embeddings=8), dict(
        num_kv_heads=2, rope_theta=500.0)),
}


ckpt, _ = ph.checkpoints({name: ("phi3", "Phi3Config", *case) for name, case in CASES.items()},
                         "hf_checkpoints_phi3", first_seed=400)


@pytest.mark.parametrize("name", CASES)
def test_loaded_phi3_gives_transformers_logits_forward_prefill_and_steps(
        name, ckpt, highest_precision):
    c = ckpt(name)
    pre, f = ph.assert_loads_with_transformers_logits(c, atol=ATOL)
    P = int(PROMPT_LENS.max())
    cache = models.KVCache.create(pre.config, 2, 16)
    logits, cache = f.prefill(pre.params, jnp.asarray(c.tokens[:, :P]),
                              jnp.asarray(PROMPT_LENS, jnp.int32), cache)
    got = [[np.asarray(logits[b, :n])] for b, n in enumerate(PROMPT_LENS)]
    for i in range(T - P):
        at = PROMPT_LENS + i
        step, cache = f.step(pre.params, jnp.asarray(c.tokens[np.arange(2), at]), cache)
        for b in range(2):
            got[b].append(np.asarray(step[b])[None])
    for b, n in enumerate(PROMPT_LENS):
        want = _cached_reference(c.model, c.tokens[b], int(n))[:T - P + n]
        np.testing.assert_allclose(np.concatenate(got[b]), want, atol=ATOL, rtol=0,
                                   err_msg=f"row {b}")
    scanned = models.load(c.path, scan_layers=True)
    np.testing.assert_allclose(fns(scanned.config).forward(scanned.params, c.tokens), c.logits,
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", CASES)
def test_greedy_generate_on_a_ragged_batch_equals_transformers_generate(
        name, ckpt, highest_precision):
    c = ckpt(name)
    pre = models.load(c.path)
    # Phi3ForCausalLM's generate re-runs the whole sequence, once, when it first grows past
    # original_max_position_embeddings (all keys then rotate by the long factors); ours
    # keeps the cache (see models.rope_scaling.LongRopeScaling), so the LongRoPE case stops
    # at 8 tokens.
    ph.assert_greedy_equals_generate(pre, c, filler=3,
                                     n_new=2 if name == "phi3-longrope" else 10)


@pytest.mark.parametrize("name", CASES)
def test_load_then_save_gives_the_tensors_transformers_wrote_bit_for_bit(name, ckpt, tmp_path):
    c = ckpt(name)
    pre = models.load(c.path)
    out = str(tmp_path / "again")
    models.save(out, pre.config, pre.params, model_type="phi3")
    again = hf_load(out)
    assert type(again) is type(c.model)
    assert_same_tensors(c.state, again)
    np.testing.assert_array_equal(hf_logits(again, c.tokens), c.logits)
    assert models.load(out).config == pre.config
    assert_same_params(models.load(out).params, pre.params)


def test_a_bfloat16_checkpoint_loads_exactly(ckpt, tmp_path):
    c = ckpt("phi3-gqa-tied-window-4-partial")
    ph.assert_bfloat16_loads_exactly(c, tmp_path, model_type="phi3")


def test_sharded_checkpoints_split_and_fuse_across_shards(ckpt, tmp_path):
    """Shards of 8 kB put a layer's fused qkv_proj and gate_up_proj in files apart from
    its other tensors: they load as one file does, and ours save so transformers reads them."""
    c = ckpt("phi3-gqa-tied-window-4-partial")
    c.model.save_pretrained(tmp_path / "hf_shards", max_shard_size="8KB")
    shards = [n for n in os.listdir(tmp_path / "hf_shards") if n.endswith(".safetensors")]
    assert len(shards) > 2
    whole, sharded = models.load(c.path), models.load(str(tmp_path / "hf_shards"))
    assert sharded.config == whole.config
    assert_same_params(sharded.params, whole.params)
    models.save(str(tmp_path / "ours"), whole.config, whole.params, model_type="phi3",
                max_shard_bytes=8_000)
    assert len([n for n in os.listdir(tmp_path / "ours") if n.endswith(".safetensors")]) > 2
    assert_same_tensors(c.state, hf_load(str(tmp_path / "ours")))


REFUSED = [
    ("phi3-mha-untied", dict(hidden_act="gelu"), ["hidden_act", "gelu"]),
    ("phi3-mha-untied", dict(resid_pdrop=0.1), ["resid_pdrop", "0.1"]),
    ("phi3-mha-untied", dict(embd_pdrop=0.1), ["embd_pdrop", "0.1"]),
    ("phi3-mha-untied", dict(head_dim=16), ["head_dim", "16"]),
    ("phi3-mha-untied", dict(partial_rotary_factor=0.375), ["partial_rotary_factor", "0.375"]),
    ("phi3-mha-untied", dict(rope_parameters={"rope_type": "linear", "factor": 2.0,
                                              "rope_theta": 1e4}),
     ["rope_parameters", "longrope"]),
    ("phi3-longrope", dict(rope_parameters=dict(LONGROPE, short_factor=[1.0, 2.0])),
     ["short_factor has 2 values", "long_factor 4"]),
    ("phi3-longrope", dict(rope_parameters=dict(LONGROPE, mscale=2.0)),
     ["rope_parameters", "mscale"]),
]


@pytest.mark.parametrize("name,fields,words", REFUSED,
                         ids=[f"{n}-{next(iter(f))}" for n, f, _ in REFUSED])
def test_a_config_value_that_cannot_be_computed_is_refused_by_name(name, fields, words, ckpt,
                                                                   tmp_path):
    path = edit_config(copy_dir(ckpt(name).path, tmp_path / "m"), set_fields(**fields))
    ph.assert_refused_by_name(path, words)


def test_the_v4_su_spelling_reads_as_longrope(ckpt, tmp_path):
    c = ckpt("phi3-longrope")

    def v4(hf):
        params = hf.pop("rope_parameters")
        hf.update(rope_theta=params.pop("rope_theta"), rope_scaling=dict(
            type="su", short_factor=params["short_factor"], long_factor=params["long_factor"]))
    path = edit_config(copy_dir(c.path, tmp_path / "m"), v4)
    assert models.pretrained.read_config(path)[1] == models.load(c.path).config


# The published config.json of microsoft/Phi-3-mini-4k-instruct, less its auto_map (remote
# code, which `load` refuses; transformers has the class built in).
PUBLISHED = {
    "architectures": ["Phi3ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
    "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 3072,
    "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 4096,
    "model_type": "phi3", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 32, "original_max_position_embeddings": 4096,
    "pad_token_id": 32000, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 10000.0, "sliding_window": 2047, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.40.2", "use_cache": True,
    "vocab_size": 32064}


def test_the_phi3_mini_preset_has_transformers_parameter_count():
    cfg = models.get_config("phi3-mini")
    ids = dict(pad_id=cfg.pad_id, eos_id=cfg.eos_id, bos_id=cfg.bos_id)
    assert FAMILIES["phi3"].config_from_hf(PUBLISHED).replace(**ids) == cfg
    assert _our_count(cfg) == _their_count("Phi3Config", PUBLISHED) == 3_821_079_552
