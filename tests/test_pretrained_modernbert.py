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
    (dict(mlp_bias=True), ["classifier_bias", "mlp_bias"]),
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
