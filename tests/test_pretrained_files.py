"""What models.load refuses, and the files around the weights.

Tensors missing, unexpected or of the wrong shape are named; a base model's files (no
"model." / "transformer." prefix) load; every config value the project cannot compute
exactly is refused naming the field and the value; pickled weights are refused without
unpickling them; a shard index cannot point outside the directory; both spellings of the
RoPE settings read the same; tokenizer files load through the protocol and save back.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil

import numpy as np
import pytest

import models
from models.pretrained import read_config
from tests import pretrained_helpers as ph
from tests.pretrained_helpers import (
    LLAMA3,
    assert_same_params,
    copy_dir,
    edit_config,
    torch,
    transformers,
)

ckpt, seq2seq_ckpt = ph.ckpt, ph.seq2seq_ckpt                  # the shared fixtures
highest_precision = ph.highest_precision
safetensors_torch = pytest.importorskip("safetensors.torch")


# ---------------------------------------------------------------------------------------------
# (Sections numbered as in tests/test_pretrained_decoders.py.) 1. Special ids outside the vocab.

def _outside_ids(path: str, **ids) -> str:
    """The directory with config.json's and generation_config.json's ids set to `ids`."""
    edit_config(path, lambda hf: hf.update(ids))
    with open(os.path.join(path, "generation_config.json")) as f:
        generation = json.load(f)
    generation.update({k: v for k, v in ids.items() if k != "pad_token_id"})
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(generation, f)
    return path


def _warnings_naming(record, word: str) -> list[str]:
    return [str(w.message) for w in record if word in str(w.message)]


def test_end_and_start_ids_outside_the_vocabulary_load_with_one_warning_naming_them(
        ckpt, tmp_path, highest_precision):
    # GPT2Config's defaults (bos = eos = 50256, no pad) in a 64-token vocabulary: transformers
    # runs this config (that token is never produced), and so do we.
    c = ckpt("gpt2-tied")
    path = _outside_ids(copy_dir(c.path, tmp_path / "m"), bos_token_id=50256,
                        eos_token_id=50256, pad_token_id=None)
    with pytest.warns(UserWarning) as record:
        pre = models.load(path)
    (message,) = _warnings_naming(record, "50256")
    assert "eos_token_id 50256" in message and "bos_token_id 50256" in message, message
    assert "vocab_size=64" in message
    assert (pre.config.eos_id, pre.config.bos_id, pre.config.pad_id) == (None, None, None)
    assert pre.generation.eos_ids is None
    np.testing.assert_allclose(pre.model.apply({"params": pre.params}, c.tokens), c.logits,
                               atol=ph.ATOL, rtol=0)


def test_a_list_of_end_ids_keeps_those_inside_the_vocabulary(ckpt, tmp_path):
    path = _outside_ids(copy_dir(ckpt("llama-mha-untied-bias").path, tmp_path / "m"),
                        eos_token_id=[500, 2, 3])
    with pytest.warns(UserWarning) as record:
        pre = models.load(path)
    (message,) = _warnings_naming(record, "500")
    assert "eos_token_id 500" in message
    assert pre.config.eos_id == 2 and pre.generation.eos_ids == (2, 3)


def test_an_end_id_outside_the_vocabulary_in_generation_config_alone_is_named(ckpt, tmp_path):
    path = copy_dir(ckpt("llama-mha-untied-bias").path, tmp_path / "m")
    with open(os.path.join(path, "generation_config.json")) as f:
        generation = json.load(f)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({**generation, "eos_token_id": [2, 64]}, f)
    with pytest.warns(UserWarning, match=r"generation_config.json: eos_token_id 64 outside"):
        pre = models.load(path)
    assert pre.config.eos_id == 2 and pre.generation.eos_ids == (2,)


def test_an_encoder_decoders_start_id_outside_the_vocabulary_is_still_refused(
        seq2seq_ckpt, tmp_path):
    # The decoder reads its start token, so it must have an embedding.
    path = edit_config(copy_dir(seq2seq_ckpt("bart").path, tmp_path / "m"),
                       lambda hf: hf.update(decoder_start_token_id=64))
    with pytest.raises(ValueError, match=r"bos_id=64"):
        read_config(path)


# ---------------------------------------------------------------------------------------------
# 4. Tensors missing, unexpected or of the wrong shape are named; base-model files load.

def _rewrite_weights(path: str, edit) -> str:
    file = os.path.join(path, "model.safetensors")
    tensors = safetensors_torch.load_file(file)
    edit(tensors)
    safetensors_torch.save_file(tensors, file, metadata={"format": "pt"})
    return path


def test_a_missing_tensor_is_named(ckpt, tmp_path):
    key = "model.layers.1.mlp.up_proj.weight"
    path = _rewrite_weights(copy_dir(ckpt("llama-mha-untied-bias").path, tmp_path / "m"),
                            lambda t: t.pop(key))
    with pytest.raises(ValueError, match=rf"lacks 1 tensor.*{re.escape(key)}$"):
        models.load(path)


@pytest.mark.parametrize("name,key", [
    ("llama-mha-untied-bias", "model.layers.0.mlp.extra.weight"),
    ("gpt2-tied", "transformer.h.0.mlp.extra.weight"),
    # A bias the family does not have (Qwen2's MLP has none).
    ("qwen2-mqa-tied", "model.layers.0.mlp.up_proj.bias"),
])
def test_an_unexpected_tensor_is_named(name, key, ckpt, tmp_path):
    path = _rewrite_weights(copy_dir(ckpt(name).path, tmp_path / "m"),
                            lambda t: t.update({key: torch.zeros(3)}))
    unused = rf"1 tensor\(s\) the config does not use: {re.escape(key)}$"
    with pytest.raises(ValueError, match=unused):
        models.load(path)


@pytest.mark.parametrize("name,key,shape", [
    ("llama-mha-untied-bias", "model.layers.0.mlp.up_proj.weight", (48, 30)),   # transposed
    ("llama-mha-untied-bias", "model.layers.1.self_attn.q_proj.weight", (24, 32)),  # to heads
    ("llama-mha-untied-bias", "model.embed_tokens.weight", (64, 30)),
    ("gpt2-tied", "transformer.h.0.attn.c_attn.weight", (32, 72)),               # split in 3
])
def test_a_tensor_of_the_wrong_shape_is_named_with_both_shapes(name, key, shape, ckpt,
                                                               tmp_path):
    c = ckpt(name)
    right = tuple(c.state[key].shape)
    path = _rewrite_weights(copy_dir(c.path, tmp_path / "m"),
                            lambda t: t.update({key: torch.zeros(shape)}))
    with pytest.raises(ValueError) as e:
        models.load(path)
    message = str(e.value)
    assert key in message
    # Both shapes, as the file stores them or as the model holds them (transposed).
    assert ((str(shape) in message and str(right) in message)
            or (str(shape[::-1]) in message and str(right[::-1]) in message)), message


@pytest.mark.parametrize("name,base", [("llama-gqa-tied-llama3-head-dim", "model"),
                                       ("gpt2-tied", "transformer")])
def test_a_base_model_checkpoint_without_the_prefix_loads(name, base, ckpt, tmp_path):
    c = ckpt(name)
    getattr(c.model, base).save_pretrained(tmp_path / "base", safe_serialization=True)
    keys = safetensors_torch.load_file(str(tmp_path / "base" / "model.safetensors"))
    assert keys and not any(k.startswith(base + ".") for k in keys)
    pre = models.load(str(tmp_path / "base"))
    whole = models.load(c.path)
    assert pre.config == whole.config
    assert_same_params(pre.params, whole.params)


@pytest.mark.parametrize("name,buffers", [
    # Old GPT-2 files (the published ones, saved without the prefix) hold causal-mask
    # buffers; old Llama files hold RoPE frequencies. Neither is a weight.
    ("gpt2-tied", ["transformer.h.0.attn.bias", "transformer.h.1.attn.masked_bias"]),
    ("llama-mha-untied-bias", ["model.layers.1.self_attn.rotary_emb.inv_freq"]),
])
def test_buffers_old_checkpoints_stored_are_skipped(name, buffers, ckpt, tmp_path):
    c = ckpt(name)
    path = _rewrite_weights(copy_dir(c.path, tmp_path / "m"), lambda t: t.update(
        {k: torch.ones(1, 1, 4, 4) for k in buffers}))
    assert_same_params(models.load(path).params, models.load(c.path).params)


# ---------------------------------------------------------------------------------------------
# 5. Config values that cannot be computed exactly are refused by name.

_set = ph.set_fields


def _v4_rope(rope_scaling, rope_theta=10_000.0):
    def edit(hf):
        del hf["rope_parameters"]
        hf.update(rope_theta=rope_theta, rope_scaling=rope_scaling)
    return edit


REFUSED = {
    "llama-yarn-without-factor": ("llama-mha-untied-bias", _set(rope_parameters={
        "rope_type": "yarn", "rope_theta": 10_000.0, "original_max_position_embeddings": 16}),
        ["rope_type", "yarn", "needs factor"]),
    "llama-proportional": ("llama-mha-untied-bias", _set(rope_parameters={
        "rope_type": "proportional", "factor": 2.0, "rope_theta": 10_000.0}),
        ["rope_type", "proportional"]),
    "llama-v4-su": ("llama-mha-untied-bias", _v4_rope({"type": "su", "factor": 2.0}),
                    ["rope_type", "su"]),
    "llama-v4-longrope-factor-count": ("llama-mha-untied-bias", _v4_rope(
        {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}),
        ["longrope", "1 factors for 4"]),
    "llama-yarn-unknown-key": ("llama-mha-untied-bias", _set(rope_parameters={
        "rope_type": "yarn", "factor": 2.0, "rope_theta": 10_000.0, "beta_medium": 3}),
        ["beta_medium", "yarn"]),
    "llama-gelu": ("llama-mha-untied-bias", _set(hidden_act="gelu"), ["hidden_act", "gelu"]),
    "llama-attention-bias-only": ("llama-mha-untied-bias",
                                  _set(attention_bias=True, mlp_bias=False),
                                  ["mlp_bias", "attention_bias", "False"]),
    "llama-mlp-bias-only": ("llama-gqa-tied-llama3-head-dim",
                            _set(attention_bias=False, mlp_bias=True),
                            ["mlp_bias", "attention_bias", "True"]),
    "llama-unknown-field": ("llama-mha-untied-bias", _set(foo_bar=3), ["foo_bar", "3"]),
    "gpt2-unknown-field": ("gpt2-tied", _set(foo_bar=3), ["foo_bar", "3"]),
    "gpt2-inverse-layer-idx": ("gpt2-tied", _set(scale_attn_by_inverse_layer_idx=True),
                               ["scale_attn_by_inverse_layer_idx", "True"]),
    "gpt2-swish": ("gpt2-tied", _set(activation_function="swish"),
                   ["activation_function", "swish"]),
    "qwen2-sliding-window": ("qwen2-gqa", _set(use_sliding_window=True, sliding_window=4),
                             ["use_sliding_window", "True"]),
    "qwen2-sliding-layer-types": ("qwen2-gqa", _set(layer_types=[
        "sliding_attention", "full_attention"]), ["layer_types", "sliding_attention"]),
    "mistral-layer-types": ("mistral-gqa-window-4", _set(layer_types=[
        "sliding_attention", "full_attention"]), ["layer_types", "sliding_attention"]),
    "llama-partial-rotary": ("llama-mha-untied-bias", _set(partial_rotary_factor=0.5),
                             ["partial_rotary_factor", "0.5"]),
    "qwen2-partial-rotary-v5": ("qwen2-gqa", _set(rope_parameters={
        "rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5}),
        ["partial_rotary_factor", "0.5"]),
    "auto-map": ("llama-mha-untied-bias", _set(auto_map={
        "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}),
        ["auto_map", "modeling_evil.EvilForCausalLM"]),
    # Remote code under a model type of its own: refused for the code, not the type.
    "auto-map-custom-type": ("llama-mha-untied-bias", _set(model_type="evil", auto_map={
        "AutoConfig": "configuration_evil.EvilConfig"}), ["auto_map", "EvilConfig"]),
    "falcon": ("llama-mha-untied-bias", _set(model_type="falcon"), ["model_type", "falcon"]),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_config_value_that_cannot_be_computed_is_refused_naming_field_and_value(
        case, ckpt, tmp_path):
    name, edit, words = REFUSED[case]
    path = edit_config(copy_dir(ckpt(name).path, tmp_path / "m"), edit)   # weights and all
    with pytest.raises(ValueError) as e:
        models.load(path)
    for word in words:
        assert word in str(e.value), (word, str(e.value))


class _Trap:
    """Unpickling this writes a file: proof that something unpickled it."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("content", ["not a pickle", "a trap pickle"])
def test_pickled_weights_alone_are_refused_without_unpickling(content, ckpt, tmp_path):
    path = str(tmp_path / "m")
    os.makedirs(path)
    shutil.copy(os.path.join(ckpt("llama-mha-untied-bias").path, "config.json"), path)
    marker = str(tmp_path / "unpickled")
    data = (b"\x00\x01 this is not a pickle \xff" if content == "not a pickle"
            else pickle.dumps(_Trap(marker)))
    with open(os.path.join(path, "pytorch_model.bin"), "wb") as f:
        f.write(data)
    with pytest.raises(ValueError, match=r"pytorch_model\.bin") as e:
        models.load(path)
    assert "safetensors" in str(e.value) and "onvert" in str(e.value)
    assert "save_pretrained" in str(e.value)
    assert not os.path.exists(marker)


@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_a_shard_index_naming_a_file_outside_the_directory_is_refused(where, ckpt, tmp_path):
    c = ckpt("llama-mha-untied-bias")
    path = str(tmp_path / "m")
    os.makedirs(path)
    shutil.copy(os.path.join(c.path, "config.json"), path)
    # A real shard sits there, so reading it would have succeeded.
    outside = str(tmp_path / "x.safetensors")
    shutil.copy(os.path.join(c.path, "model.safetensors"), outside)
    name = "../x.safetensors" if where == "parent" else outside
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": dict.fromkeys(c.state, name)}, f)
    with pytest.raises(ValueError, match="refusing to read outside") as e:
        models.load(path)
    assert repr(name) in str(e.value)


def test_v4_and_v5_rope_spellings_read_the_same(ckpt, tmp_path):
    c = ckpt("llama-gqa-tied-llama3-head-dim")
    v5 = read_config(c.path)[1]
    assert v5.rope_theta == 5_000.0 and v5.rope_scaling == c.expect["rope_scaling"]
    scaling = {k: v for k, v in LLAMA3.items() if k != "rope_type"}
    for n, kind in enumerate(["type", "rope_type"]):        # both v4 spellings of the kind
        path = edit_config(copy_dir(c.path, tmp_path / f"v4_{n}"), _v4_rope(
            {kind: "llama3", **scaling}, rope_theta=5_000.0))
        with open(os.path.join(path, "config.json")) as f:
            assert "rope_parameters" not in json.load(f)
        assert read_config(path)[1] == v5
    # Without scaling, a v4 top-level rope_theta is read too.
    plain = ckpt("mistral-no-window")
    path = edit_config(copy_dir(plain.path, tmp_path / "plain"),
                        _v4_rope(None, rope_theta=1234.0))
    assert read_config(path)[1] == read_config(plain.path)[1].replace(rope_theta=1234.0)


# ---------------------------------------------------------------------------------------------
# 6. Tokenizers.

def _hf_tokenizer():
    from tokenizers import Tokenizer, models as tk_models, pre_tokenizers, trainers
    tok = Tokenizer(tk_models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    sentences = ["the cat sat on the mat", "a dog ate the bone", "the bird sang a song",
                 "cats and dogs are friends"]
    tok.train_from_iterator(sentences, trainers.WordLevelTrainer(
        special_tokens=["<pad>", "<s>", "</s>", "<unk>"]))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>")


def test_tokenizer_files_load_through_the_protocol_and_save_back(ckpt, tmp_path):
    c = ckpt("llama-mha-untied-bias")
    hf_tok = _hf_tokenizer()
    path = copy_dir(c.path, tmp_path / "m")
    hf_tok.save_pretrained(path)
    assert len(hf_tok) <= 64

    pre = models.load(path)
    tok = pre.tokenizer
    assert isinstance(tok, models.tokenizer.HFTokenizer)
    assert tok.vocab_size == len(hf_tok)
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (
        hf_tok.pad_token_id, hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.unk_token_id)
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
    texts = ["the cat ate the song", "a bird and a zebra"]          # "zebra" is unknown
    ids = [tok.encode(t) for t in texts]
    assert ids == [hf_tok.encode(t, add_special_tokens=False) for t in texts]
    assert tok.unk_id in ids[1] and tok.encode_batch(texts) == ids
    assert tok.decode(ids[0]) == hf_tok.decode(ids[0], skip_special_tokens=True)
    assert tok.decode(ids[0]) == "the cat ate the song"
    # Decoding stops at the first eos; pad and bos are not text.
    assert tok.decode([tok.bos_id, *ids[0], tok.eos_id, *ids[1], tok.pad_id]) == tok.decode(
        ids[0])

    models.save(str(tmp_path / "out"), pre.config, pre.params, tokenizer=tok)
    back = models.load(str(tmp_path / "out")).tokenizer
    assert back.identity == tok.identity and back.vocab_size == tok.vocab_size
    assert [back.encode(t) for t in texts] == ids
    assert (back.pad_id, back.bos_id, back.eos_id, back.unk_id) == (0, 1, 2, 3)
    # transformers reads the saved files as the same tokenizer.
    again = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert [again.encode(t, add_special_tokens=False) for t in texts] == ids


def test_a_directory_without_tokenizer_files_loads_with_no_tokenizer(ckpt):
    c = ckpt("gpt2-tied")
    assert not any(n.startswith("tokenizer") or n.startswith("vocab")
                   for n in os.listdir(c.path))
    assert models.load(c.path).tokenizer is None


def test_a_flipped_byte_in_an_export_is_found_and_named(ckpt, tmp_path):
    """models.save writes zoo_integrity.json last; models.load checks every file against it
    (a Hugging Face directory without one loads as it is)."""
    pre = models.load(ckpt("llama-mha-untied-bias").path)
    out = str(tmp_path / "export")
    models.save(out, pre.config, pre.params)
    assert os.path.exists(os.path.join(out, "zoo_integrity.json"))
    models.load(out)                                     # unchanged: loads
    weights = os.path.join(out, "model.safetensors")
    with open(weights, "r+b") as f:                      # a byte in the middle of the data
        f.seek(os.path.getsize(weights) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(ValueError, match=r"has changed since it was saved: model.safetensors "
                                         r"differs from its manifest"):
        models.load(out)


def test_a_tensor_that_is_not_floating_point_is_refused_by_name(ckpt, tmp_path):
    key = "model.layers.0.mlp.up_proj.weight"
    path = _rewrite_weights(copy_dir(ckpt("llama-mha-untied-bias").path, tmp_path / "m"),
                            lambda t: t.update({key: t[key].to(ph.torch.int32)}))
    with pytest.raises(ValueError, match=rf"tensor {re.escape(key)} holds int32, not "
                                         "floating-point weights"):
        models.load(path)


def _poison(t: dict) -> None:
    """Two NaN and one Inf in one tensor, one -Inf in another (a bfloat16 copy of it)."""
    up, norm = "model.layers.0.mlp.up_proj.weight", "model.layers.1.input_layernorm.weight"
    t[up][0, :2], t[up][3, 4] = float("nan"), float("inf")
    t[norm] = t[norm].to(torch.bfloat16)
    t[norm][5] = float("-inf")


def test_weights_holding_nan_or_inf_are_named_with_counts_unless_allowed(ckpt, tmp_path):
    c = ckpt("llama-mha-untied-bias")
    path = _rewrite_weights(copy_dir(c.path, tmp_path / "m"), _poison)
    with pytest.raises(ValueError) as info:
        models.load(path)
    message = str(info.value)
    assert "2 tensor(s) holding NaN or Inf" in message, message
    assert "model.layers.0.mlp.up_proj.weight: 2 NaN, 1 Inf of 1536 values" in message
    assert "model.layers.1.input_layernorm.weight: 0 NaN, 1 Inf of 32 values" in message
    assert "allow_non_finite=True" in message

    with pytest.warns(UserWarning, match=r"up_proj.weight: 2 NaN, 1 Inf"):
        pre = models.load(path, allow_non_finite=True)
    up = np.asarray(pre.params["decoder"]["layer_0"]["mlp"]["up"]["kernel"])   # [D, F]
    assert np.isnan(up[:2, 0]).all() and up[4, 3] == np.inf
    assert np.isfinite(up).sum() == up.size - 3
    norm = np.asarray(pre.params["decoder"]["layer_1"]["self_attention_norm"]["scale"])
    assert norm[5] == -np.inf and np.isfinite(norm).sum() == 31


def test_rope_theta_given_twice_must_agree(ckpt, tmp_path):
    path = copy_dir(ckpt("llama-mha-untied-bias").path, tmp_path / "m")
    ph.edit_config(path, lambda hf: hf.update(rope_theta=hf["rope_parameters"]["rope_theta"]))
    assert read_config(path)[1].rope_theta == 10_000.0          # the same value twice: fine
    ph.edit_config(path, lambda hf: hf.update(rope_theta=500.0))
    with pytest.raises(ValueError, match=r"rope_theta=500.0 is not supported \(the RoPE "
                                         r"settings say 10000.0\)"):
        read_config(path)
