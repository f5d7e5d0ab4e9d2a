"""models.load / models.save of the encoder-only families (BERT, RoBERTa) against
transformers, as tests/test_pretrained_seq2seq.py does for the encoder-decoders.

Tiny random checkpoints (tests/pretrained_helpers.py, ENCODER_CASES) of BertForMaskedLM,
BertForSequenceClassification, RobertaForMaskedLM and RobertaForSequenceClassification on
a ragged batch with token types: a loaded model gives transformers' masked-LM logits at the
real positions and its class logits (fp32, highest matmul precision, eager attention);
`models.save` of what was loaded gives files transformers loads to the same tensors bit for
bit; a base model saved alone loads with a new head and a warning that names it; old
gamma/beta names and tied copies load to the same parameters; config values the families
cannot compute are refused by name.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models.pretrained import FAMILIES, read_config
from models.pretrained.family import Inexpressible
from models.pretrained.mapping import initial_params, parameter_shapes
from tests import pretrained_helpers as ph
from tests.pretrained_helpers import (
    ATOL,
    ENCODER_CASES,
    assert_same_params,
    assert_same_tensors,
    copy_dir,
    edit_config,
    hf_encoder_load,
    hf_encoder_logits,
    stack_layers,
    torch,
    transformers,
)

encoder_ckpt, highest_precision = ph.encoder_ckpt, ph.highest_precision   # shared fixtures
safetensors_torch = pytest.importorskip("safetensors.torch")


def _our_logits(pre, c) -> np.ndarray:
    kwargs = dict(lengths=jnp.asarray(c.lengths))
    if c.token_types is not None:
        kwargs["token_types"] = jnp.asarray(c.token_types)
    method = "classify" if pre.config.num_labels else None
    fn = jax.jit(lambda p, t, kw: pre.model.apply({"params": p}, t, method=method, **kw))
    return np.asarray(fn(pre.params, jnp.asarray(c.tokens), kwargs))


def _assert_close_at_real_positions(ours, theirs, lengths) -> float:
    """Per-token logits compared where the rows have tokens; the largest difference."""
    worst = 0.0
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(ours[b, :n], theirs[b, :n], atol=ATOL, rtol=0,
                                   err_msg=f"row {b}")
        worst = max(worst, float(np.abs(ours[b, :n] - theirs[b, :n]).max()))
    return worst


def _rewrite_weights(path: str, edit) -> str:
    file = os.path.join(path, "model.safetensors")
    tensors = safetensors_torch.load_file(file)
    edit(tensors)
    safetensors_torch.save_file(tensors, file, metadata={"format": "pt"})
    return path


# ---------------------------------------------------------------------------------------------
# 1. Logits against transformers.

@pytest.mark.parametrize("name", ENCODER_CASES)
def test_loaded_model_gives_transformers_logits(name, encoder_ckpt, highest_precision):
    c = encoder_ckpt(name)
    pre = models.load(c.path)
    cfg = pre.config
    assert pre.model_type == c.model_type and pre.tokenizer is None
    for field, value in c.expect.items():
        assert getattr(cfg, field) == value, field
    assert cfg.architecture == "encoder_only" and pre.model == models.build(cfg)
    ours = _our_logits(pre, c)
    if cfg.num_labels:           # one row of C logits from each row's first token
        assert ours.shape == c.logits.shape == (len(c.lengths), cfg.num_labels)
        np.testing.assert_allclose(ours, c.logits, atol=ATOL, rtol=0)
        worst = float(np.abs(ours - c.logits).max())
    else:
        worst = _assert_close_at_real_positions(ours, c.logits, c.lengths)
    print(f"{name}: max |logits - transformers'| = {worst:.2e}")


# ---------------------------------------------------------------------------------------------
# 2. Round trips.

@pytest.mark.parametrize("name", ENCODER_CASES)
def test_load_then_save_gives_files_transformers_loads_to_the_same_tensors(
        name, encoder_ckpt, tmp_path):
    c = encoder_ckpt(name)
    pre = models.load(c.path)
    same = str(tmp_path / "same")
    # Saved without a model_type: the first type that expresses it is the checkpoint's.
    assert models.save(same, pre.config, pre.params) == c.model_type
    with open(os.path.join(same, "config.json")) as f:
        hf = json.load(f)
    assert hf["model_type"] == c.model_type and hf["architectures"] == [c.class_name]
    if pre.config.num_labels:        # the names, or transformers' LABEL_i without them
        names = pre.config.label_names or [f"LABEL_{i}" for i in range(pre.config.num_labels)]
        assert hf["id2label"] == {str(i): n for i, n in enumerate(names)}
        assert hf["label2id"] == {n: i for i, n in enumerate(names)}
    again = hf_encoder_load(same, c.class_name)
    assert type(again) is type(c.model)
    if pre.config.num_labels:
        assert again.config.id2label == dict(enumerate(names))
    assert_same_tensors(c.state, again)
    np.testing.assert_array_equal(
        hf_encoder_logits(again, c.tokens, c.lengths, c.token_types), c.logits)
    # Ours reads its own files back, also scanned (3 layers in one case: the stack's depth
    # is num_layers, not num_encoder_layers), and a scanned model saves the same file.
    back = models.load(same)
    assert back.config == pre.config
    assert_same_params(back.params, pre.params)
    if not pre.config.first_attention_norm:       # ModernBERT: one unnormed layer, looped
        return
    scanned = models.load(c.path, scan_layers=True)
    assert_same_params(scanned.params, stack_layers(pre.params))
    models.save(str(tmp_path / "scanned"), scanned.config, scanned.params)
    with open(os.path.join(same, "model.safetensors"), "rb") as a, open(
            tmp_path / "scanned" / "model.safetensors", "rb") as b:
        assert a.read() == b.read()


def test_presets_save_as_their_namesakes_and_other_encoders_as_the_projects_own_type(
        tmp_path):
    rng = np.random.default_rng(0)

    def random_params(cfg):
        tree: dict = {}
        for path, shape in parameter_shapes(cfg).items():
            *parents, leaf = path.split("/")
            node = tree
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = jnp.asarray(rng.normal(size=shape), cfg.param_dtype)
        return tree

    small = dict(vocab_size=64, d_model=32, num_heads=4, mlp_dim=48, num_layers=2, max_len=24)
    bert = models.get_config("bert-tiny", **small)
    roberta = models.get_config("roberta-base", **small)
    for cfg, model_type in ((bert, "bert"), (bert.replace(num_labels=4), "bert"),
                            (roberta, "roberta"), (roberta.replace(num_labels=2), "roberta"),
                            (bert.replace(norm_position="pre"), "jax_transformer_zoo")):
        path = str(tmp_path / f"{model_type}-{cfg.num_labels}-{cfg.norm_position}")
        params = random_params(cfg)
        assert models.save(path, cfg, params) == model_type
        again = models.load(path)
        assert again.config == cfg
        assert_same_params(again.params, params)
    unexpressed = {
        "bert": [roberta, bert.replace(activation="silu"), bert.replace(num_token_types=0),
                 bert.replace(tie_embeddings=False), bert.replace(embedding_norm=False)],
        "roberta": [bert, roberta.replace(activation="relu"), roberta.replace(pad_id=0)],
    }
    for model_type, configs in unexpressed.items():
        for cfg in configs:
            with pytest.raises(Inexpressible):
                FAMILIES[model_type].config_to_hf(cfg)


# ---------------------------------------------------------------------------------------------
# 3. A base model saved alone; old names; tied copies.

def test_a_base_model_file_loads_as_a_masked_lm_model_with_a_new_head_and_a_warning(
        encoder_ckpt, tmp_path, highest_precision):
    c = encoder_ckpt("bert-mlm")
    base = transformers.BertModel(c.model.config)          # with a pooler
    base.load_state_dict(c.model.bert.state_dict(), strict=False)
    with torch.no_grad():
        base.pooler.dense.weight.normal_()
    path = str(tmp_path / "base")
    base.eval().save_pretrained(path, safe_serialization=True)
    with pytest.warns(UserWarning, match=r"cls\.predictions\.\* tensors: the masked-LM head "
                      r"is newly initialised") as record:
        pre = models.load(path)
    assert "pooler.dense.weight" in str(record[0].message)
    full = models.load(c.path)
    assert pre.config == full.config and pre.config.num_labels == 0
    head = {p: v for p, v in initial_params(pre.config, [
        p for p in parameter_shapes(pre.config) if p.startswith("mlm_head/")]).items()}
    for path_, value in head.items():
        *parents, leaf = path_.split("/")
        got = pre.params
        for key in (*parents, leaf):
            got = got[key]
        np.testing.assert_array_equal(np.asarray(got), value, err_msg=path_)
    assert_same_params({k: v for k, v in pre.params.items() if k != "mlm_head"},
                       {k: v for k, v in full.params.items() if k != "mlm_head"})
    # The encoder is the checkpoint's: transformers' hidden states at the real positions.
    hidden = np.asarray(jax.jit(lambda p, t, n, tt: pre.model.apply(
        {"params": p}, t, lengths=n, token_types=tt, method="encode"))(
        pre.params, jnp.asarray(c.tokens), jnp.asarray(c.lengths), jnp.asarray(c.token_types)))
    mask = np.arange(c.tokens.shape[1])[None, :] < c.lengths[:, None]
    with torch.no_grad():
        theirs = base(input_ids=torch.as_tensor(c.tokens, dtype=torch.long),
                      attention_mask=torch.as_tensor(mask, dtype=torch.long),
                      token_type_ids=torch.as_tensor(c.token_types, dtype=torch.long),
                      ).last_hidden_state.numpy()
    _assert_close_at_real_positions(hidden, theirs, c.lengths)


@pytest.mark.parametrize("name", ["bert-mlm", "roberta-mlm"])
def test_old_gamma_beta_names_and_tied_copies_load_to_the_same_params(name, encoder_ckpt,
                                                                      tmp_path):
    c = encoder_ckpt(name)
    want = models.load(c.path).params
    base, head = ("bert", "cls.predictions") if name == "bert-mlm" else ("roberta", "lm_head")

    def old(t):
        for key in [k for k in t if k.endswith("LayerNorm.weight")]:
            t[key[:-len("weight")] + "gamma"] = t.pop(key)
        for key in [k for k in t if k.endswith("LayerNorm.bias")]:
            t[key[:-len("bias")] + "beta"] = t.pop(key)
        t[f"{head}.decoder.weight"] = t[f"{base}.embeddings.word_embeddings.weight"].clone()
        t[f"{head}.decoder.bias"] = t[f"{head}.bias"].clone()
        t[f"{base}.embeddings.position_ids"] = torch.arange(40)[None]

    path = _rewrite_weights(copy_dir(c.path, tmp_path / "old"), old)
    assert any(k.endswith("LayerNorm.gamma") for k in safetensors_torch.load_file(
        os.path.join(path, "model.safetensors")))
    assert_same_params(models.load(path).params, want)

    def a_different_bias_copy(t):
        t[f"{head}.decoder.bias"] = t[f"{head}.bias"] + 1.0

    path = _rewrite_weights(copy_dir(c.path, tmp_path / "bad"), a_different_bias_copy)
    with pytest.raises(ValueError, match=rf"{head}\.decoder\.bias and {head}\.bias differ"):
        models.load(path)


# ---------------------------------------------------------------------------------------------
# 4. What cannot be loaded exactly is refused by name.

_set = ph.set_fields


REFUSED = {
    "bert-gelu-fast": ("bert-mlm", _set(hidden_act="gelu_fast"), ["hidden_act", "gelu_fast"]),
    "bert-relative-key": ("bert-mlm", _set(position_embedding_type="relative_key"),
                          ["position_embedding_type", "relative_key"]),
    "bert-decoder": ("bert-mlm", _set(is_decoder=True), ["is_decoder", "True"]),
    "bert-cross-attention": ("bert-classifier-gelu-new", _set(add_cross_attention=True),
                             ["add_cross_attention"]),
    "bert-token-classification": ("bert-mlm", _set(architectures=["BertForTokenClassification"]),
                                  ["architectures", "BertForTokenClassification"]),
    "bert-untied": ("bert-mlm", _set(tie_word_embeddings=False), ["tie_word_embeddings"]),
    "bert-unknown-field": ("bert-mlm", _set(foo_bar=3), ["foo_bar", "3"]),
    "bert-labels": ("bert-classifier-gelu-new", _set(id2label={"0": "a", "1": "b"}),
                    ["classifier.weight has 3 rows", "2 labels"]),
    "roberta-relu-mlm": ("roberta-mlm", _set(hidden_act="relu"), ["hidden_act", "relu",
                                                                 "exact GELU"]),
    "roberta-no-pad": ("roberta-mlm", _set(pad_token_id=None), ["pad_token_id"]),
    "roberta-relative-key-query": ("roberta-classifier-3-layers-relu",
                                   _set(position_embedding_type="relative_key_query"),
                                   ["position_embedding_type", "relative_key_query"]),
}


@pytest.mark.parametrize("case", REFUSED)
def test_config_values_the_families_cannot_compute_are_refused_by_name(case, encoder_ckpt,
                                                                      tmp_path):
    name, edit, words = REFUSED[case]
    ph.assert_refused_by_name(edit_config(copy_dir(encoder_ckpt(name).path, tmp_path / "m"),
                                          edit), words)


def test_old_config_fields_that_change_nothing_load(encoder_ckpt, tmp_path):
    c = encoder_ckpt("bert-mlm")
    path = edit_config(copy_dir(c.path, tmp_path / "old"), _set(
        position_embedding_type="absolute", gradient_checkpointing=False, directionality="bidi",
        pooler_type="first_token_transform", pooler_fc_size=32, classifier_dropout=None,
        architectures=["BertForPreTraining"]))
    assert read_config(path)[1] == models.load(c.path).config
