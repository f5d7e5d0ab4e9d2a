"""RoPE scalings (linear, dynamic NTK, YaRN, LongRoPE, Llama 3) against transformers.

Each scaling's frequencies and cos/sin factor equal transformers' `ROPE_INIT_FUNCTIONS` for
the same config.json; a tiny random Llama with each scaling, loaded, gives transformers'
logits teacher-forced and through a ragged prefill then cached steps, where the reference
for the steps is transformers' own cached decoding of each row alone (LongRoPE switches to
its long factors mid-decode there, and the keys already cached keep their short ones).
"""

from __future__ import annotations

import copy

import jax.numpy as jnp
import numpy as np
import pytest

import models
from models.pretrained import FAMILIES
from models.rope import attention_factor, rope_frequencies
from tests import pretrained_helpers as ph
from tests.helpers import fns
from tests.pretrained_helpers import PROMPT_LENS, SPECIAL, T, torch, transformers

highest_precision = ph.highest_precision
ATOL = 1e-5
_LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
              rms_norm_eps=1e-5, **SPECIAL)
H = 8
_RNG = np.random.default_rng(7)
_SHORT, _LONG = [float(x) for x in 1 + _RNG.random(H // 2)], [
    float(x) for x in 2 + 4 * _RNG.random(H // 2)]

# name -> rope_parameters (v5). Original lengths below T exercise the scalings' ranges.
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.5},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "llama3": dict(ph.LLAMA3, original_max_position_embeddings=8),
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
    "yarn-mscale-untruncated": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16,
                                "beta_slow": 2, "mscale": 0.8, "mscale_all_dim": 0.5,
                                "truncate": False, "original_max_position_embeddings": 8},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.3,
                              "original_max_position_embeddings": 16},
    "longrope": {"rope_type": "longrope", "short_factor": _SHORT, "long_factor": _LONG,
                 "original_max_position_embeddings": 6},
    "longrope-factor": {"rope_type": "longrope", "short_factor": _SHORT, "long_factor": _LONG,
                        "factor": 3.0, "original_max_position_embeddings": 6},
}
LOGIT_CASES = ["linear", "dynamic", "yarn", "yarn-mscale-untruncated", "longrope"]


def _hf_config(name: str):
    params = dict(SCALINGS[name], rope_theta=500.0)
    return transformers.LlamaConfig(**copy.deepcopy(_LLAMA), rope_parameters=params,
                                    attn_implementation="eager")


def _ours(hf_cfg, path) -> models.TransformerConfig:
    """Our config of `hf_cfg`'s config.json, as transformers writes it."""
    hf_cfg.save_pretrained(path)
    return models.pretrained.read_config(str(path))[1]


@pytest.mark.parametrize("name", SCALINGS)
def test_frequencies_and_cos_sin_factor_equal_transformers(name, tmp_path):
    hf_cfg = _hf_config(name)
    cfg = _ours(hf_cfg, tmp_path)
    init = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS[hf_cfg.rope_parameters[
        "rope_type"]]
    theirs, factor = init(hf_cfg, "cpu")
    ours = rope_frequencies(cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling)
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-6, atol=0)
    assert attention_factor(cfg.rope_scaling) == pytest.approx(factor, rel=1e-12)
    if name.startswith("longrope"):        # past the original length: the long factors
        long, _ = init(hf_cfg, "cpu", seq_len=7)
        np.testing.assert_allclose(rope_frequencies(cfg.rope_dim, cfg.rope_theta,
                                                    cfg.rope_scaling, long=True),
                                   long.numpy(), rtol=1e-6, atol=0)
        assert not np.allclose(long.numpy(), theirs.numpy())


def _cached_reference(model, tokens, n: int) -> np.ndarray:
    """transformers' logits [T, V] of one row: a prefill of its first n tokens, then one
    cached step per token."""
    ids = torch.as_tensor(tokens[None], dtype=torch.long)
    with torch.no_grad():
        out = model(ids[:, :n], use_cache=True)
        logits, cache = [out.logits[0]], out.past_key_values
        for t in range(n, len(tokens)):
            out = model(ids[:, t:t + 1], cache=cache, use_cache=True)
            logits.append(out.logits[0])
            cache = out.past_key_values
    return torch.cat(logits).float().numpy()


@pytest.mark.parametrize("name", LOGIT_CASES)
def test_a_llama_with_each_scaling_gives_transformers_logits(name, tmp_path,
                                                             highest_precision):
    torch.manual_seed(11)
    model = ph.randomize(transformers.AutoModelForCausalLM.from_config(_hf_config(name)), 11)
    model.save_pretrained(tmp_path / "m", safe_serialization=True)
    pre = models.load(str(tmp_path / "m"))
    assert pre.config.rope_scaling is not None
    tokens = ph.random_tokens(64, seed=5)
    f = fns(pre.config)
    for width in (T, 5):                   # LongRoPE: long factors, then short ones
        np.testing.assert_allclose(f.forward(pre.params, jnp.asarray(tokens[:, :width])),
                                   ph.hf_logits(model, tokens[:, :width]), atol=ATOL, rtol=0)
    P = int(PROMPT_LENS.max())
    cache = models.KVCache.create(pre.config, 2, 16)
    logits, cache = f.prefill(pre.params, jnp.asarray(tokens[:, :P]),
                              jnp.asarray(PROMPT_LENS, jnp.int32), cache)
    got = [[logits[b, :n]] for b, n in enumerate(PROMPT_LENS)]
    for i in range(T - P):
        at = PROMPT_LENS + i
        step, cache = f.step(pre.params, jnp.asarray(tokens[np.arange(2), at]), cache)
        for b in range(2):
            got[b].append(step[b][None])
    for b, n in enumerate(PROMPT_LENS):
        want = _cached_reference(model, tokens[b], int(n))
        np.testing.assert_allclose(np.concatenate(got[b])[:len(want)], want[:T - P + n],
                                   atol=ATOL, rtol=0, err_msg=f"row {b}")
    if name == "linear":                   # saved, transformers reads the same scaling
        models.save(str(tmp_path / "again"), pre.config, pre.params)
        again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "again"))
        assert again.config.rope_parameters["factor"] == 2.5
        assert models.load(str(tmp_path / "again")).config == pre.config


@pytest.mark.parametrize("name", SCALINGS)
def test_a_scaling_round_trips_through_to_dict_and_config_json(name, tmp_path):
    cfg = _ours(_hf_config(name), tmp_path)
    assert models.TransformerConfig.from_dict(cfg.to_dict()) == cfg
    written = FAMILIES["llama"].config_to_hf(cfg)
    assert FAMILIES["llama"].config_from_hf({**written, "model_type": "llama"}) == cfg


def test_dynamic_scaling_refuses_a_max_len_past_its_original_length(tmp_path):
    cfg = _ours(_hf_config("dynamic"), tmp_path)
    assert cfg.rope_scaling.original_max_len == cfg.max_len == 32
    with pytest.raises(ValueError, match="max_len=64 exceeds the dynamic"):
        cfg.replace(max_len=64)


def test_scaling_dicts_name_their_kind_and_llama3_dicts_need_none():
    c = models.TransformerConfig(positions="rope", rope_scaling={"factor": 8.0})
    assert isinstance(c.rope_scaling, models.Llama3RopeScaling)
    c = models.TransformerConfig(positions="rope", rope_scaling={"kind": "linear", "factor": 2})
    assert c.rope_scaling.factor == 2.0 and c.to_dict()["rope_scaling"]["kind"] == "linear"
    with pytest.raises(ValueError, match="kind='ntk'"):
        models.TransformerConfig(positions="rope", rope_scaling={"kind": "ntk", "factor": 2})
    with pytest.raises(ValueError, match=r"unknown keys \['beta'\]"):
        models.TransformerConfig(positions="rope", rope_scaling={"kind": "yarn", "factor": 2,
                                                                 "original_max_len": 8,
                                                                 "beta": 1})
