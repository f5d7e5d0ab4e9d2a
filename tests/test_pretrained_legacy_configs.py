"""Config files written before transformers v5, or without a field that has a default.

transformers v5's `save_pretrained` writes `layer_types`, `rope_parameters` and
`original_max_position_embeddings` explicitly, so checkpoints it saves never reach the
readers that derive those from older fields (Qwen3's `max_window_layers`, Gemma 3's
top-level `rope_theta` / `rope_scaling` / `rope_local_base_freq`) or fill them in when they
are absent (Mixtral's RoPE base, Phi-3's original length). Published checkpoints hold
exactly such files. Each case saves a tiny random model, rewrites its config.json into the
older form (values away from the defaults, so a reader that ignores a field shows), checks
that transformers reads the rewritten file as intended, and compares our logits with
transformers' on it.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

import models
from tests import pretrained_helpers as ph
from tests.helpers import fns

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
highest_precision = ph.highest_precision

ATOL = 1e-5
_SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4,
              max_position_embeddings=32, rms_norm_eps=1e-5, **ph.SPECIAL)
_KINDS = {"full_attention": "full", "sliding_attention": "sliding"}


def _qwen3_layers(hf: dict) -> None:
    del hf["layer_types"]              # the kinds follow from max_window_layers alone


def _gemma3_v4(hf: dict) -> None:
    for key in ("layer_types", "rope_parameters"):
        del hf[key]
    hf.update(rope_theta=50_000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
              rope_local_base_freq=100.0, sliding_window_pattern=2)


def _no_rope(hf: dict) -> None:
    hf.pop("rope_theta", None)
    del hf["rope_parameters"]          # Mixtral's default base is 1e6, not Llama's 1e4


def _no_original_length(hf: dict) -> None:
    del hf["original_max_position_embeddings"]          # Phi-3's default is 4096
    del hf["rope_parameters"]["original_max_position_embeddings"]


# name -> (config class, its fields, the rewrite of config.json, what transformers must
# read from the rewritten file: so the case tests the reader it names).
CASES = {
    "qwen3-max-window-layers": (
        "Qwen3Config", dict(_SMALL, num_hidden_layers=3, num_key_value_heads=2, head_dim=8,
                            use_sliding_window=True, sliding_window=3, max_window_layers=1),
        _qwen3_layers, dict(layer_types=["full_attention", "sliding_attention",
                                         "sliding_attention"])),
    "gemma3-v4-rope": (
        "Gemma3TextConfig", dict(_SMALL, num_hidden_layers=3, num_key_value_heads=2,
                                 head_dim=8, sliding_window=3, query_pre_attn_scalar=12),
        _gemma3_v4, dict(
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                "rope_theta": 50_000.0},
                             "sliding_attention": {"rope_type": "default",
                                                   "rope_theta": 100.0}})),
    "mixtral-default-rope-base": (
        "MixtralConfig", dict(_SMALL, num_hidden_layers=2, num_key_value_heads=2,
                              num_local_experts=4, num_experts_per_tok=2),
        _no_rope, dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "phi3-longrope-default-original-length": (
        "Phi3Config", dict(_SMALL, num_hidden_layers=2, num_key_value_heads=2,
                           max_position_embeddings=16_384, rope_parameters={
                               "rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 2.5],
                               "long_factor": [3.0, 4.0, 5.0, 6.0]}),
        _no_original_length, dict(original_max_position_embeddings=4096)),
}


def _subset(want, got) -> bool:
    """`want`'s keys hold `got`'s values (dicts compared key by key, recursively)."""
    if isinstance(want, dict):
        return isinstance(got, dict) and all(_subset(v, got.get(k)) for k, v in want.items())
    return want == got


@pytest.mark.parametrize("name", CASES)
def test_an_older_config_file_gives_transformers_logits(name, tmp_path, highest_precision):
    class_name, fields, rewrite, premise = CASES[name]
    seed = 700 + list(CASES).index(name)
    hf_cfg = getattr(transformers, class_name)(**fields, attn_implementation="eager")
    torch.manual_seed(seed)
    model = ph.randomize(transformers.AutoModelForCausalLM.from_config(hf_cfg), seed)
    path = str(tmp_path / name)
    model.save_pretrained(path, safe_serialization=True)
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    rewrite(hf)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    theirs = ph.hf_load(path)
    for key, value in premise.items():
        assert _subset(value, getattr(theirs.config, key)), (key, getattr(theirs.config, key))
    tokens = ph.random_tokens(hf_cfg.vocab_size, seed)
    pre = models.load(path)
    if "layer_types" in premise:
        assert pre.config.layer_types == tuple(_KINDS[k] for k in premise["layer_types"])
    np.testing.assert_allclose(fns(pre.config).forward(pre.params, jnp.asarray(tokens)),
                               ph.hf_logits(theirs, tokens), atol=ATOL, rtol=0)
