"""LoRA adapters in PEFT's directory layout (models/pretrained/peft.py, peft_map.py,
peft_checks.py) against PEFT itself, on the tiny random GPT-2, Llama, T5 and BART
checkpoints of tests/pretrained_helpers.py:

- ours -> PEFT: random adapters on several projections (GPT-2's fused c_attn from separate
  query and value adapters; T5's and BART's cross-attention keys and values, which are
  stacked over layers here), `models.save_adapter`, `peft.PeftModel.from_pretrained`: the
  same logits, and PEFT holds exactly the tensors written;
- PEFT -> ours: `peft.get_peft_model` (B random, a rank_pattern, GPT-2's c_attn, rsLoRA
  once), `save_pretrained`, `models.load(base, adapter=...)`: PEFT's logits, adapted and
  merged; saved again, the same tensors;
- ours -> directory -> ours gives the same tensors (scanned layers, the project's own type);
- each refusal, by name.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import models
from models import lora
from models.errors import UserError
from models.lora import LoraConfig, projection_widths
from models.pretrained import peft as peft_files, read_adapter, zoo
from tests import pretrained_helpers as ph
from tests.helpers import fns, random_adapters, tiny
from tests.pretrained_helpers import hf_load, hf_logits, hf_seq2seq_load, hf_seq2seq_logits, torch

peft = pytest.importorskip("peft")
ckpt, seq2seq_ckpt, encoder_ckpt = ph.ckpt, ph.seq2seq_ckpt, ph.encoder_ckpt
highest_precision = ph.highest_precision

ATOL = 2e-5
# Merged weights (W + s A B, rounded once more) against PEFT's unmerged forward: T5Gemma's
# soft-capped, sqrt(D)-scaled stacks put that rounding at up to 2.6e-5; a wrong merge is off
# by more than 1e-2 (the adapters' own effect, asserted).
MERGED_ATOL = 4e-5


@dataclasses.dataclass(frozen=True)
class Case:
    """A checkpoint (`checkpoint` of tests/pretrained_helpers.py), the adapters we make on
    it (`ours`: LoraConfig fields) and those PEFT makes (`theirs`: peft.LoraConfig fields)."""

    checkpoint: str
    seq2seq: bool
    ours: dict
    theirs: dict


CROSS = ("self_attention.query", "self_attention.value", "cross_attention.query",
         "cross_attention.key", "cross_attention.value")
CASES = {
    # query and value share c_attn at one scale (4 / 8 = 2 / 4).
    "gpt2": Case("gpt2-tied", False, dict(
        rank=4, alpha=8, targets=("query", "value", "out", "up", "down"),
        overrides=(("value", 2, 4.0),)), dict(
        target_modules=["c_attn", "c_fc"], rank_pattern={"c_fc": 2}, alpha_pattern={"c_fc": 5})),
    "llama": Case("llama-gqa-tied-llama3-head-dim", False, dict(
        rank=4, alpha=8, targets=("query", "value", "gate", "down"),
        overrides=(("down", 2, 6.0),)), dict(
        target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"],
        rank_pattern={"v_proj": 2})),
    "t5": Case("t5-v1.1", True, dict(
        rank=4, alpha=8, targets=(*CROSS, "decoder.mlp.down"), rslora=True,
        overrides=(("cross_attention.key", 2, 3.0),)), dict(
        target_modules=["q", "k", "v", "wo"], rank_pattern={"EncDecAttention.k": 2},
        use_rslora=True)),
    "bart": Case("bart", True, dict(rank=4, alpha=8, targets=CROSS), dict(
        target_modules=["q_proj", "k_proj", "v_proj", "fc2"],
        rank_pattern={"encoder_attn.v_proj": 2}, alpha_pattern={"encoder_attn.v_proj": 3})),
    # The pre-norm translators on BART's layer names: adapters on every attention and the
    # decoder's second MLP projection, one at another rank and scale.
    **{name: Case(name, True, dict(rank=4, alpha=8, targets=(*CROSS, "mlp.down"),
                                   overrides=(("cross_attention.value", 2, 3.0),)), dict(
        target_modules=["q_proj", "k_proj", "v_proj", "fc2"],
        rank_pattern={"encoder_attn.v_proj": 2}, alpha_pattern={"encoder_attn.v_proj": 6}))
       for name in ("m2m100", "mbart", "pegasus")},
    # Gemma 2's layers in both stacks; the decoder's cross-attention adapters by name.
    "t5gemma": Case("t5gemma", True, dict(
        rank=4, alpha=8, targets=(*CROSS, "decoder.mlp.down"),
        overrides=(("cross_attention.value", 2, 8.0),)), dict(
        target_modules=["q_proj", "k_proj", "v_proj", "down_proj"],
        rank_pattern={"cross_attn.v_proj": 2}, alpha_pattern={"cross_attn.v_proj": 8})),
}


def _checkpoint(case: Case, ckpt, seq2seq_ckpt):
    return (seq2seq_ckpt if case.seq2seq else ckpt)(case.checkpoint)


def _hf_model(case: Case, c):
    return (hf_seq2seq_load if case.seq2seq else hf_load)(c.path)


def _hf_logits(case: Case, model, c) -> np.ndarray:
    if case.seq2seq:
        return hf_seq2seq_logits(model, c.src, c.src_lens, c.tgt_in)
    return hf_logits(model, c.tokens)


def _our_logits(case: Case, cfg, params, c) -> np.ndarray:
    f = fns(cfg)
    if case.seq2seq:
        return np.asarray(f.forward(params, jnp.asarray(c.src), jnp.asarray(c.tgt_in),
                                    src_lengths=jnp.asarray(c.src_lens)))
    return np.asarray(f.forward(params, jnp.asarray(c.tokens)))


def _adapted(case: Case, c, seed: int = 0, **runtime):
    """(config with our adapters, base params, random adapters) on the case's base."""
    pre = models.load(c.path, **runtime)
    cfg = pre.config.replace(lora=LoraConfig(**case.ours))
    return cfg, pre.params, random_adapters(cfg, seed)


def _file_tensors(directory: str) -> dict:
    return load_file(os.path.join(directory, peft_files.WEIGHTS))


# ---------------------------------------------------------------------------------------------
# (a) ours -> PEFT.

@pytest.mark.parametrize("name", CASES)
def test_our_adapter_loads_in_peft_with_our_logits(name, tmp_path, ckpt, seq2seq_ckpt,
                                                    highest_precision):
    case = CASES[name]
    c = _checkpoint(case, ckpt, seq2seq_ckpt)
    cfg, base, adapters = _adapted(case, c)
    params = lora.join(base, adapters)
    ours = _our_logits(case, cfg, params, c)
    assert np.abs(ours - c.logits).max() > 1e-2          # the adapters change the logits
    out = str(tmp_path / "adapter")
    assert models.save_adapter(out, cfg, params, base_name_or_path=c.path) == c.model_type
    with open(os.path.join(out, peft_files.CONFIG)) as f:
        written = json.load(f)
    assert written["task_type"] == ("SEQ_2_SEQ_LM" if case.seq2seq else "CAUSAL_LM")
    assert written["fan_in_fan_out"] == (name == "gpt2")
    assert written["base_model_name_or_path"] == c.path

    model = peft.PeftModel.from_pretrained(_hf_model(case, c), out).eval()
    stored = _file_tensors(out)
    held = peft.get_peft_model_state_dict(model)
    assert sorted(held) == sorted(stored)     # PEFT adapted exactly the modules written
    for key, value in stored.items():
        np.testing.assert_array_equal(held[key].numpy(), value, err_msg=key)
    np.testing.assert_allclose(_hf_logits(case, model, c), ours, atol=ATOL, rtol=0)


def test_gpt2_query_and_value_share_c_attn_in_blocks(tmp_path, ckpt):
    """Separate query (rank 4) and value (rank 2) adapters are one c_attn adapter of rank
    6: lora_A their rows, lora_B each in its own rows and columns, zero for the keys."""
    case = CASES["gpt2"]
    c = _checkpoint(case, ckpt, None)
    cfg, base, adapters = _adapted(case, c)
    out = str(tmp_path / "adapter")
    models.save_adapter(out, cfg, adapters)
    key = "base_model.model.transformer.h.1.attn.c_attn"
    a_RI, b_OR = (_file_tensors(out)[f"{key}.lora_{x}.weight"] for x in "AB")
    layer = adapters["decoder"]["layer_1"]["self_attention"]
    q_a, v_a = (np.asarray(layer[p]["lora_a"]) for p in ("query", "value"))
    np.testing.assert_array_equal(a_RI, np.concatenate([q_a.T, v_a.T]))
    d = cfg.d_model
    np.testing.assert_array_equal(b_OR[:d, :4], np.asarray(layer["query"]["lora_b"]).reshape(
        4, d).T)
    np.testing.assert_array_equal(b_OR[2 * d:, 4:], np.asarray(layer["value"]["lora_b"]).reshape(
        2, d).T)
    assert not b_OR[:d, 4:].any() and not b_OR[d:2 * d].any() and not b_OR[2 * d:, :4].any()
    with open(os.path.join(out, peft_files.CONFIG)) as f:
        written = json.load(f)
    assert written["rank_pattern"] == {"c_attn": 6} and written["alpha_pattern"] == {"c_attn": 12}


def test_targets_no_name_suffix_selects_alone_are_one_regex(tmp_path, seq2seq_ckpt):
    """BART's decoder self-attention queries share every name suffix with the encoder's but
    the layer's path: target_modules is one regex that PEFT matches whole, and PEFT adapts
    exactly the modules written (rank_pattern too: the MLP's fc1 at rank 2)."""
    c = seq2seq_ckpt("bart")
    cfg = models.load(c.path).config.replace(lora=LoraConfig(
        rank=4, targets=("decoder.self_attention.query", "encoder.mlp.up"),
        overrides=(("encoder.mlp.up", 2, 16.0),)))
    out = str(tmp_path / "adapter")
    models.save_adapter(out, cfg, random_adapters(cfg, seed=4))
    with open(os.path.join(out, peft_files.CONFIG)) as f:
        written = json.load(f)
    assert written["target_modules"] == (r"(?:model\.decoder\.layers\.\d+\.self_attn\.q_proj"
                                         r"|model\.encoder\.layers\.\d+\.fc1)")
    assert written["rank_pattern"] == {"fc1": 2}
    model = peft.PeftModel.from_pretrained(hf_seq2seq_load(c.path), out)
    assert sorted(peft.get_peft_model_state_dict(model)) == sorted(_file_tensors(out))


@pytest.mark.parametrize("name", ["bert-mlm", "roberta-classifier-3-layers-relu"])
def test_encoder_only_adapters_load_in_peft_with_our_logits(name, tmp_path, encoder_ckpt,
                                                            highest_precision):
    """BERT's and RoBERTa's "output.dense" is both the attention's out and the MLP's down:
    one name suffix selects both."""
    c = encoder_ckpt(name)
    pre = models.load(c.path)
    cfg = pre.config.replace(lora=LoraConfig(targets=("query", "value", "out", "down")))
    adapters = random_adapters(cfg, seed=2)
    out = str(tmp_path / "adapter")
    models.save_adapter(out, cfg, adapters)
    with open(os.path.join(out, peft_files.CONFIG)) as f:
        written = json.load(f)
    assert written["task_type"] == "FEATURE_EXTRACTION"
    assert written["target_modules"] == ["output.dense", "query", "value"]
    model = peft.PeftModel.from_pretrained(ph.hf_encoder_load(c.path, c.class_name), out)
    theirs = ph.hf_encoder_logits(model.eval(), c.tokens, c.lengths, c.token_types)
    kwargs = {"lengths": jnp.asarray(c.lengths)}
    if c.token_types is not None:
        kwargs["token_types"] = jnp.asarray(c.token_types)
    ours = np.asarray(models.build(cfg).apply(
        {"params": lora.join(pre.params, adapters)}, jnp.asarray(c.tokens),
        method="classify" if cfg.num_labels else None, **kwargs))
    real = (np.arange(c.tokens.shape[1]) < c.lengths[:, None]) if ours.ndim == 3 else ...
    np.testing.assert_allclose(ours[real], theirs[real], atol=ATOL, rtol=0)
    _assert_round_trip(cfg, adapters, out, c.path)


# ---------------------------------------------------------------------------------------------
# (b) PEFT -> ours.

@pytest.mark.parametrize("name", CASES)
def test_peft_adapter_loads_with_peft_logits_adapted_and_merged(
        name, tmp_path, ckpt, seq2seq_ckpt, highest_precision):
    case = CASES[name]
    c = _checkpoint(case, ckpt, seq2seq_ckpt)
    torch.manual_seed(7)
    model = peft.get_peft_model(_hf_model(case, c), peft.LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False, **case.theirs)).eval()
    theirs = _hf_logits(case, model, c)
    assert np.abs(theirs - c.logits).max() > 1e-2
    out = str(tmp_path / "peft")
    model.save_pretrained(out)

    pre = models.load(c.path, adapter=out)
    assert pre.config.lora is not None and pre.config.lora.rslora == bool(
        case.theirs.get("use_rslora"))
    np.testing.assert_allclose(_our_logits(case, pre.config, pre.params, c), theirs,
                               atol=ATOL, rtol=0)
    merged = models.load(c.path, adapter=out, merge=True)
    assert merged.config.lora is None and merged.config == pre.config.replace(lora=None)
    np.testing.assert_allclose(_our_logits(case, merged.config, merged.params, c), theirs,
                               atol=MERGED_ATOL, rtol=0)

    again = str(tmp_path / "again")            # saved back: PEFT's tensors, bit for bit
    models.save_adapter(again, pre.config, pre.params)
    want, got = _file_tensors(out), _file_tensors(again)
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_a_fused_c_attn_adapter_gives_query_key_and_value_its_whole_rank(tmp_path, ckpt):
    """PEFT's c_attn adapter of rank 4: query, key and value adapters of rank 4, each with
    lora_A whole and its own rows of lora_B; c_fc at rank 2 with alpha 5 an override."""
    c = ckpt("gpt2-tied")
    torch.manual_seed(7)
    model = peft.get_peft_model(hf_load(c.path), peft.LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False, **CASES["gpt2"].theirs))
    out = str(tmp_path / "peft")
    model.save_pretrained(out)
    config, adapters = read_adapter(out, c.path)
    assert config == LoraConfig(
        rank=4, alpha=8, targets=("decoder.self_attention.query", "decoder.self_attention.key",
                                  "decoder.self_attention.value", "decoder.mlp.up"),
        overrides=(("decoder.mlp.up", 2, 5.0),))
    a_RI, b_OR = (_file_tensors(out)[f"base_model.model.transformer.h.0.attn.c_attn.lora_{x}"
                                     ".weight"] for x in "AB")
    layer = adapters["decoder"]["layer_0"]["self_attention"]
    d = 32
    for k, part in enumerate(("query", "key", "value")):
        np.testing.assert_array_equal(layer[part]["lora_a"], a_RI.T)
        np.testing.assert_array_equal(np.asarray(layer[part]["lora_b"]).reshape(4, d),
                                      b_OR[k * d:(k + 1) * d].T)


# ---------------------------------------------------------------------------------------------
# (c) ours -> directory -> ours.

def _assert_round_trip(cfg, adapters, out: str, base: str, **runtime) -> None:
    config, back = read_adapter(out, base, **runtime)
    chex.assert_trees_all_equal(back, adapters, strict=True)
    for site in projection_widths(cfg):
        assert config.shape_of(site) == cfg.lora.shape_of(site), site


@pytest.mark.parametrize("scan", [False, True], ids=["looped", "scanned"])
@pytest.mark.parametrize("name", CASES)
def test_round_trip_gives_the_same_tensors(name, scan, tmp_path, ckpt, seq2seq_ckpt):
    case = CASES[name]
    c = _checkpoint(case, ckpt, seq2seq_ckpt)
    cfg, _, adapters = _adapted(case, c, seed=3, scan_layers=scan)
    out = str(tmp_path / "adapter")
    models.save_adapter(out, cfg, adapters)          # the adapters alone
    _assert_round_trip(cfg, adapters, out, c.path, scan_layers=scan)


def test_an_adapter_loads_onto_a_mesh(llama_adapter):
    """With `mesh`, the adapters go onto their shards like the base: the same values."""
    base, out = llama_adapter
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(1, 2, 2), models.axes.AXES)
    whole = models.load(base, adapter=out, scan_layers=True)
    placed = models.load(base, adapter=out, scan_layers=True, mesh=mesh)
    b_LrF = placed.params["decoder"]["layers"]["mlp"]["gate"]["lora_b"]       # [L, r, F]
    assert b_LrF.sharding.mesh == mesh and b_LrF.sharding.spec[-1] == "tensor"
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, placed.params), whole.params)


def test_the_projects_own_type_saves_and_loads_adapters(tmp_path):
    """An encoder-decoder of the project's own type: its own module names, the
    cross-attention's keys and values per layer."""
    cfg = tiny("encoder_decoder", lora=LoraConfig(rank=3, alpha=5, targets=(
        "query", "cross_attention.key", "value", "encoder.mlp.up")))
    base = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), lora.split(jax.eval_shape(
        models.build(cfg).init, jax.random.key(0), jnp.ones((1, 1), jnp.int32),
        jnp.ones((1, 1), jnp.int32))["params"])[0])
    base_dir, out = str(tmp_path / "base"), str(tmp_path / "adapter")
    models.save(base_dir, cfg.replace(lora=None), base, model_type=zoo.MODEL_TYPE)
    adapters = random_adapters(cfg, seed=5)
    assert models.save_adapter(out, cfg, lora.join(base, adapters),
                               base_name_or_path=base_dir) == zoo.MODEL_TYPE
    names = _file_tensors(out)
    assert "base_model.model.decoder.layer_1.cross_attention.key.lora_B.weight" in names
    assert "base_model.model.encoder.layer_0.mlp.up.lora_A.weight" in names
    _assert_round_trip(cfg, adapters, out, base_dir)
    pre = models.load(base_dir, adapter=out)
    assert pre.config == cfg.replace(lora=pre.config.lora)


# ---------------------------------------------------------------------------------------------
# (d) Refusals, each by name.

@pytest.fixture
def llama_adapter(tmp_path, ckpt):
    """(base path, a directory of our adapters on the Llama case: q, v, gate, down)."""
    case = CASES["llama"]
    c = _checkpoint(case, ckpt, None)
    cfg, base, adapters = _adapted(case, c)
    out = str(tmp_path / "adapter")
    models.save_adapter(out, cfg, adapters, base_name_or_path=c.path)
    return c.path, out


def _edit_json(directory: str, **fields) -> str:
    path = os.path.join(directory, peft_files.CONFIG)
    with open(path) as f:
        hf = json.load(f)
    hf.update(fields)
    with open(path, "w") as f:
        json.dump(hf, f)
    return directory


def _edit_tensors(directory: str, edit) -> str:
    """Edits the adapter's tensors in place, keeping the file's metadata."""
    path = os.path.join(directory, peft_files.WEIGHTS)
    with safe_open(path, framework="numpy") as f:
        metadata = f.metadata()
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata=metadata)
    return directory


def _refused(base: str, adapter: str, *words, **kwargs) -> None:
    with pytest.raises(UserError) as info:
        models.load(base, adapter=adapter, **kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize("field, value", [
    ("peft_type", "IA3"), ("use_dora", True), ("bias", "lora_only"),
    ("modules_to_save", ["lm_head"]), ("layers_to_transform", [0]),
    ("layers_pattern", "layers"), ("lora_bias", True), ("init_lora_weights", "pissa"),
    ("a_future_switch", 3),
])
def test_config_fields_this_project_cannot_compute_are_refused(field, value, llama_adapter):
    base, out = llama_adapter
    _refused(base, _edit_json(out, **{field: value}), field, repr(value))


Q = "base_model.model.model.layers.{}.self_attn.q_proj.lora_{}.weight"


@pytest.mark.parametrize("edit, words", [
    (lambda t: t.update({Q.format(0, "A").replace("q_proj", "qq_proj"): t.pop(
        Q.format(0, "A"))}), ["qq_proj", "no module of this base"]),
    (lambda t: t.update({"base_model.model.model.embed_tokens.lora_A.weight":
                         t[Q.format(0, "A")]}), ["embed_tokens", "cannot carry an adapter here"]),
    (lambda t: t.update({Q.format(0, "A").replace("lora_A.weight", "lora_magnitude_vector"):
                         t[Q.format(0, "A")][0]}), ["lora_magnitude_vector", "not a LoRA A or B"]),
    (lambda t: [t.pop(Q.format(1, x)) for x in "AB"],
     ["decoder.self_attention.query", "1 of its 2 layers", "model.layers.1.self_attn.q_proj"]),
    (lambda t: t.pop(Q.format(1, "B")), ["q_proj.lora_A.weight without its .lora_B.weight"]),
    (lambda t: t.update({Q.format(0, "B"): t[Q.format(0, "B")][:, :3]}),
     [Q.format(0, "B"), "(48, 3)", "(48, 4)", "another base"]),
], ids=["unknown-module", "unadaptable-module", "magnitude", "some-layers", "a-without-b",
        "rank-mismatch"])
def test_tensors_the_base_cannot_take_are_refused(edit, words, llama_adapter):
    base, out = llama_adapter
    _refused(base, _edit_tensors(out, edit), *words)


def _poison_adapter(t: dict) -> None:
    """Two NaN in one lora_B, one -Inf in one lora_A."""
    t[Q.format(1, "B")][5, :2] = np.nan
    t[Q.format(0, "A")][3, 7] = -np.inf


def test_adapter_tensors_holding_nan_or_inf_are_named_with_counts_unless_allowed(
        llama_adapter):
    base, out = llama_adapter
    clean = models.load(base, adapter=out)
    _edit_tensors(out, _poison_adapter)
    with pytest.raises(UserError) as info:
        models.load(base, adapter=out)
    message = str(info.value)
    assert f"adapter {out} has 2 tensor(s) holding NaN or Inf" in message, message
    assert f"{Q.format(0, 'A')}: 0 NaN, 1 Inf of 128 values" in message, message
    assert f"{Q.format(1, 'B')}: 2 NaN, 0 Inf of 192 values" in message, message
    assert "allow_non_finite=True" in message
    with pytest.raises(UserError, match=r"lora_B.weight: 2 NaN"):
        read_adapter(out, base)
    with pytest.warns(UserWarning, match=r"adapter .*lora_A.weight: 0 NaN, 1 Inf") as caught:
        pre = models.load(base, adapter=out, allow_non_finite=True)
    assert caught[0].filename == __file__            # pointed at the caller of models.load
    query = pre.params["decoder"]["layer_0"]["self_attention"]["query"]
    clean_query = clean.params["decoder"]["layer_0"]["self_attention"]["query"]
    assert int(np.isinf(np.asarray(query["lora_a"])).sum()) == 1
    chex.assert_trees_all_equal(query["kernel"], clean_query["kernel"])   # the base untouched
    b1 = np.asarray(pre.params["decoder"]["layer_1"]["self_attention"]["query"]["lora_b"])
    assert int(np.isnan(b1).sum()) == 2


def test_a_module_peft_would_not_select_or_another_rank_is_refused(llama_adapter, tmp_path):
    base, out = llama_adapter
    again, third = (str(shutil.copytree(out, tmp_path / n)) for n in ("again", "third"))
    _refused(base, _edit_json(out, target_modules=["q_proj", "gate_proj", "down_proj"]),
             "v_proj", "target_modules")
    _refused(base, _edit_json(again, rank_pattern={"q_proj": 3}), "rank 4", "rank 3")

    def rank_3_in_layer_1(t):
        t[Q.format(1, "A")], t[Q.format(1, "B")] = t[Q.format(1, "A")][:3], t[Q.format(1, "B")][
            :, :3]
    _edit_tensors(_edit_json(third, rank_pattern={"down_proj": 2,      # as written, and:
                                                  "layers.1.self_attn.q_proj": 3}),
                  rank_3_in_layer_1)
    _refused(base, third, "model.layers.1.self_attn.q_proj (layer 1) rank 3",
             "decoder.self_attention.query rank 4", "one rank and alpha per projection")


def test_an_adapter_made_for_another_base_is_refused(tmp_path, ckpt, llama_adapter):
    """By its name, then (when told to skip that) by its shapes: the other Llama has 4
    key/value heads of 8 where this one has 2 of 12."""
    other = ckpt("llama-mha-untied-bias")
    pre = models.load(other.path)
    cfg = pre.config.replace(lora=LoraConfig(targets=("query",)))
    out = str(tmp_path / "other")
    models.save_adapter(out, cfg, random_adapters(cfg, 0), base_name_or_path=other.path)
    base, _ = llama_adapter
    _refused(base, out, "llama-mha-untied-bias", "check_base_name=False")
    _refused(base, out, "q_proj.lora_B.weight", "(32, 8)", "(48, 8)", "another base",
             check_base_name=False)


@pytest.mark.parametrize("name", ["", "org/llama-gqa-tied-llama3-head-dim"])
def test_base_names_that_name_the_base_are_accepted(name, llama_adapter):
    base, out = llama_adapter
    assert models.load(base, adapter=_edit_json(out, base_model_name_or_path=name)).config.lora


def test_an_adapter_made_on_the_base_model_alone_loads(tmp_path, ckpt):
    """PEFT on `GPT2Model` (no head) names the modules without "transformer."."""
    case = CASES["gpt2"]
    c = _checkpoint(case, ckpt, None)
    cfg, _, adapters = _adapted(case, c)
    out = str(tmp_path / "adapter")
    models.save_adapter(out, cfg, adapters)
    _edit_tensors(out, lambda t: t.update(
        {k.replace(".transformer.", ".", 1): t.pop(k) for k in list(t)}))
    assert all(".transformer." not in k for k in _file_tensors(out))
    _assert_round_trip(cfg, adapters, out, c.path)


def test_an_adapter_directory_alone_loads_onto_the_base_it_names(llama_adapter, tmp_path):
    base, out = llama_adapter
    alone, given = models.load(out), models.load(base, adapter=out)
    assert alone.config == given.config
    chex.assert_trees_all_equal(alone.params, given.params)
    with pytest.raises(UserError, match="is itself an adapter directory"):
        models.load(out, adapter=out)
    with pytest.raises(UserError, match="names no base"):
        models.load(_edit_json(str(shutil.copytree(out, tmp_path / "a")),
                               base_model_name_or_path=None))
    with pytest.raises(UserError, match="'org/some-model', which is not a model directory"):
        models.load(_edit_json(out, base_model_name_or_path="org/some-model"))


def test_all_linear_targets_and_harmless_fields_are_accepted(llama_adapter):
    base, out = llama_adapter
    _edit_json(out, target_modules="all-linear", init_lora_weights="gaussian",
               peft_version="0.21.2", eva_config=None, inference_mode=False)
    assert models.load(base, adapter=out).config.lora.targets == (
        "decoder.self_attention.query", "decoder.self_attention.value", "decoder.mlp.gate",
        "decoder.mlp.down")


def test_saving_an_adapted_model_whole_is_refused(tmp_path, ckpt):
    case = CASES["gpt2"]
    cfg, base, adapters = _adapted(case, _checkpoint(case, ckpt, None))
    with pytest.raises(UserError, match=r"models\.lora\.merge.*models\.save_adapter"):
        models.save(str(tmp_path / "m"), cfg, lora.join(base, adapters))
    with pytest.raises(UserError, match="config.lora is None"):
        models.save_adapter(str(tmp_path / "a"), cfg.replace(lora=None), base)
    with pytest.raises(UserError, match="merge=True needs an adapter"):
        models.load(ckpt("gpt2-tied").path, merge=True)


def test_fused_projections_at_different_scales_are_refused(tmp_path, ckpt):
    """c_attn holds query and value: PEFT gives the module one scale."""
    c = ckpt("gpt2-tied")
    cfg = models.load(c.path).config.replace(lora=LoraConfig(
        rank=4, alpha=8, targets=("query", "value"), overrides=(("value", 2, 8.0),)))
    with pytest.raises(UserError, match=r"transformer\.h\.\{i\}\.attn\.c_attn.*different "
                                        r"scales.*query 2.*value 4"):
        models.save_adapter(str(tmp_path / "a"), cfg, random_adapters(cfg, 0))
