"""ModernBERT beyond the shared encoder suite (tests/test_pretrained_encoders.py runs its
logits and round trips on the "modernbert-*" cases of ENCODER_CASES): the unpadded path
(ragged rows packed without padding give the padded rows' logits and classes),
`decode.fill_mask` and `decode.classify` against transformers, the refused config values,
and the published base and large configs at transformers' counts."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import decode
import models
from models.pretrained import FAMILIES
from tests import pretrained_helpers as ph
from tests.helpers import fns
from tests.pretrained_helpers import copy_dir, edit_config, set_fields, torch, transformers

encoder_ckpt, highest_precision = ph.encoder_ckpt, ph.highest_precision


def _packed(c):
    """The checkpoint's ragged rows packed into one row without padding: tokens, segment
    ids, per-segment positions, and where each row starts."""
    rows = [c.tokens[b, :n] for b, n in enumerate(c.lengths)]
    starts = np.cumsum([0, *map(len, rows[:-1])])
    tokens = np.concatenate(rows)[None]
    segments = np.concatenate([np.full(len(r), b + 1) for b, r in enumerate(rows)])[None]
    positions = np.concatenate([np.arange(len(r)) for r in rows])[None]
    return (jnp.asarray(tokens, jnp.int32), jnp.asarray(segments, jnp.int32),
            jnp.asarray(positions, jnp.int32), starts)


def test_packed_rows_without_padding_give_the_padded_rows_logits(encoder_ckpt,
                                                                  highest_precision):
    """The local layers' windows and RoPE follow each packed sequence; the masked-LM logits
    are transformers' (padded) ones at every real token."""
    c = encoder_ckpt("modernbert-mlm")
    pre = models.load(c.path)
    tokens, segments, positions, starts = _packed(c)
    logits = fns(pre.config).forward(pre.params, tokens, segment_ids=segments,
                                     positions=positions)
    for b, n in enumerate(c.lengths):
        np.testing.assert_allclose(logits[0, starts[b]:starts[b] + n], c.logits[b, :n],
                                   atol=ph.ATOL, rtol=0, err_msg=f"row {b}")


def test_packed_rows_classify_as_the_padded_rows_with_mean_pooling(encoder_ckpt,
                                                                   highest_precision):
    """Mean pooling reads each packed example's own tokens: the logits read at each
    example's first position equal transformers' for the padded rows."""
    c = encoder_ckpt("modernbert-classifier-mean-biases")
    pre = models.load(c.path)
    tokens, segments, positions, starts = _packed(c)
    logits = pre.model.apply({"params": pre.params}, tokens, segment_ids=segments,
                             positions=positions, method="classify_positions")
    np.testing.assert_allclose(logits[0, starts], c.logits, atol=ph.ATOL, rtol=0)


def test_fill_mask_and_classify_give_transformers_choices(encoder_ckpt, highest_precision):
    mlm = encoder_ckpt("modernbert-mlm")
    pre = models.load(mlm.path)
    out = decode.fill_mask(pre.model, pre.params, jnp.asarray(mlm.tokens),
                           jnp.asarray(mlm.lengths), top_k=3)
    for b, n in enumerate(mlm.lengths):
        want = np.argsort(-mlm.logits[b, :n], axis=-1)[:, :3]
        np.testing.assert_array_equal(np.asarray(out.ids)[b, :n], want)
    cls = encoder_ckpt("modernbert-classifier-mean-biases")
    pre = models.load(cls.path)
    probs = decode.classify(pre.model, pre.params, jnp.asarray(cls.tokens),
                            jnp.asarray(cls.lengths))
    np.testing.assert_allclose(probs, jax.nn.softmax(cls.logits, -1), atol=1e-5)


REFUSED = [
    (dict(mlp_bias=True), ["mlp_bias", "attention_bias=False"]),
    (dict(classifier_activation="silu"), ["classifier_activation", "silu", "'gelu'"]),
    (dict(hidden_activation="relu"), ["hidden_activation", "relu"]),
    (dict(decoder_bias=False), ["decoder_bias", "False"]),
    (dict(classifier_pooling="max"), ["classifier_pooling", "max"]),
    (dict(layer_types=["full_attention"]), ["layer_types", "3 layers"]),
    (dict(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                              "rope_theta": 10.0}}),
     ["rope_parameters", "default RoPE"]),
    (dict(architectures=["ModernBertForTokenClassification"]), ["architectures"]),
]


@pytest.mark.parametrize("fields,words", REFUSED, ids=[next(iter(f)) for f, _ in REFUSED])
def test_a_config_value_that_cannot_be_computed_is_refused_by_name(fields, words,
                                                                   encoder_ckpt, tmp_path):
    path = edit_config(copy_dir(encoder_ckpt("modernbert-mlm").path, tmp_path / "m"),
                       set_fields(**fields))
    ph.assert_refused_by_name(path, words)


def test_the_first_layers_missing_norm_refuses_a_scanned_stack():
    with pytest.raises(ValueError, match="first_attention_norm=False.*scan_layers=False"):
        models.get_config("modernbert-base", scan_layers=True)


PUBLISHED = {"modernbert-base": (dict(), 149_655_232),
             "modernbert-large": (dict(hidden_size=1024, intermediate_size=2624,
                                       num_hidden_layers=28, num_attention_heads=16),
                                  395_881_664)}


@pytest.mark.parametrize("preset", PUBLISHED)
def test_a_modernbert_preset_at_the_published_size_has_transformers_parameter_count(preset):
    """answerdotai/ModernBERT-base's and -large's config.json (ModernBertConfig's defaults
    are the base model's)."""
    fields, count = PUBLISHED[preset]
    published = transformers.ModernBertConfig(**fields)
    with torch.device("meta"):
        model = transformers.ModernBertForMaskedLM(published)
    theirs = sum(p.numel() for p in model.parameters())
    hf = {**json.loads(published.to_json_string()), "architectures": ["ModernBertForMaskedLM"]}
    cfg = models.get_config(preset)
    assert FAMILIES["modernbert"].config_from_hf(hf) == cfg
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    shapes = jax.eval_shape(models.build(cfg).init, jax.random.key(0), tokens)["params"]
    assert sum(x.size for x in jax.tree.leaves(shapes)) == theirs == count


@pytest.mark.slow
def test_a_modernbert_directory_fine_tunes_into_a_classifier_transformers_reads(
        encoder_ckpt, data_dir, tmp_path, highest_precision):
    """`finetune_classify` from a ModernBERT masked-LM directory (with a tokenizer of its
    special tokens): the classifier starts new for the data's labels, and the export is a
    ModernBertForSequenceClassification that transformers reads to our class logits (mean
    pooling kept). With LoRA the run is refused by name: a PEFT adapter would lose the new
    head."""
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers, processors

    from train import configs
    from train.trainer import train_and_evaluate
    c = encoder_ckpt("modernbert-mlm")
    path = copy_dir(c.path, tmp_path / "modernbert")
    edit_config(path, set_fields(classifier_pooling="mean"))
    specials = ["[UNK]", "[CLS]", "[SEP]", "[MASK]", "[PAD]"]
    vocab = {t: i for i, t in enumerate(specials + list("abcdefghijklmnopqrstuvwxyz .0123"))}
    backend = Tokenizer(tok_models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]", pad_token="[PAD]").save_pretrained(path)
    rows = [(f"a {word} line {i}", ("neg", "pos")[i % 2])
            for i, word in enumerate(("cat", "dog", "sea", "red") * 6)]
    files = []
    for name in ("train", "dev", "test"):
        (tmp_path / f"{name}.tsv").write_text("".join(f"{t}\t{y}\n" for t, y in rows))
        files.append(str(tmp_path / f"{name}.tsv"))
    cfg = configs.get("finetune_classify")
    cfg.update(init_from=path, data_files=",".join(files), data_dir=data_dir,
               num_train_steps=2, per_device_batch_size=2, eval_per_device_batch_size=8,
               warmup_steps=1, max_source_length=32, max_target_length=32,
               max_decode_length=31)
    cfg.lora.rank = 4
    with pytest.raises(ValueError, match=r"lora.rank=4 .* hold no classifier for 2 labels"):
        train_and_evaluate(cfg, str(tmp_path / "lora"))
    cfg.lora.rank = 0
    out = train_and_evaluate(cfg, str(tmp_path / "ft"))
    pre = models.load(out["model"])
    assert pre.model_type == "modernbert" and pre.config.label_names == ("neg", "pos")
    assert pre.config.classifier_pooling == "mean"
    theirs = ph.hf_encoder_load(out["model"], "ModernBertForSequenceClassification")
    ours = pre.model.apply({"params": pre.params}, jnp.asarray(c.tokens),
                           lengths=jnp.asarray(c.lengths), method="classify")
    np.testing.assert_allclose(ph.hf_encoder_logits(theirs, c.tokens, c.lengths), ours,
                               atol=ph.ATOL, rtol=0)


def test_adapters_on_the_fused_projections_load_in_peft_with_our_logits(
        encoder_ckpt, tmp_path, highest_precision):
    """LoRA on ModernBERT's query and value (one fused `attn.Wqkv`, its key block zero), its
    attention output and MLP output (`attn.Wo`, `mlp.Wo`): PEFT reads the adapter we write
    to our masked-LM logits."""
    import peft

    from models import lora
    from models.lora import LoraConfig
    from models.pretrained import peft as peft_files
    from tests.helpers import random_adapters
    c = encoder_ckpt("modernbert-mlm")
    pre = models.load(c.path)
    cfg = pre.config.replace(lora=LoraConfig(targets=("query", "value", "out", "down")))
    adapters = random_adapters(cfg, seed=3)
    out = str(tmp_path / "adapter")
    models.save_adapter(out, cfg, adapters)
    with open(f"{out}/{peft_files.CONFIG}") as f:
        assert sorted(json.load(f)["target_modules"]) == ["Wo", "Wqkv"]
    model = peft.PeftModel.from_pretrained(ph.hf_encoder_load(c.path, c.class_name), out)
    theirs = ph.hf_encoder_logits(model.eval(), c.tokens, c.lengths)
    ours = np.asarray(models.build(cfg).apply({"params": lora.join(pre.params, adapters)},
                                              jnp.asarray(c.tokens),
                                              lengths=jnp.asarray(c.lengths)))
    assert np.abs(ours - c.logits).max() > 1e-2
    for b, n in enumerate(c.lengths):
        np.testing.assert_allclose(ours[b, :n], theirs[b, :n], atol=ph.ATOL, rtol=0)


@pytest.mark.parametrize("name", ["modernbert-mlm", "modernbert-classifier-mean-biases"])
def test_a_bfloat16_checkpoint_loads_exactly(name, encoder_ckpt, tmp_path):
    c = encoder_ckpt(name)
    ph.assert_bfloat16_loads_exactly(c, tmp_path, reload=getattr(transformers, c.class_name))
