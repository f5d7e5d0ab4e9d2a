"""The encoder-only family (models/encoder_only.py): bidirectional, padding invisible to
the real tokens (exact zero gradients), packed rows equal their examples alone, both heads,
and the published parameter counts of its presets."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from tests.helpers import random_tokens, tiny

BERT = dict(positions="learned", embedding_norm=True, norm_position="post",
            activation="gelu_exact", num_token_types=2)
ROBERTA = dict(BERT, position_offset=2, num_token_types=1)


def _model(num_labels: int = 0, **overrides):
    cfg = tiny("encoder_only", num_labels=num_labels, **{**BERT, **overrides})
    model = models.build(cfg)
    method = "classify" if num_labels else None
    params = model.init(jax.random.key(0), jnp.ones((2, 8), jnp.int32), method=method)["params"]
    # Random norms and biases too, so a misplaced one shows.
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    params = jax.tree.unflatten(
        tree, [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)])
    return model, params


def test_every_position_sees_the_whole_row():
    """Bidirectional: the first position's output depends on the last token."""
    model, params = _model()
    tokens = random_tokens(0, (1, 8), 61)
    a = model.apply({"params": params}, tokens)
    b = model.apply({"params": params}, tokens.at[0, -1].set((tokens[0, -1] + 1) % 61))
    assert not np.allclose(a[0, 0], b[0, 0], atol=1e-4)


@pytest.mark.parametrize("overrides", [BERT, ROBERTA], ids=["bert", "roberta"])
def test_padding_changes_no_real_position_exact_zero_gradients(overrides):
    """In a row of 5 real tokens and 3 padding, the real positions' logits have exactly zero
    gradient with respect to the position embeddings only the padding reads, and junk
    padding tokens change no real logit."""
    model, params = _model(**overrides)
    tokens, lengths = random_tokens(2, (1, 8), 61), jnp.array([5])
    off = overrides.get("position_offset", 0)

    def real_logits(table):
        p = {**params, "embed": {**params["embed"], "positions": {"embedding": table}}}
        return jnp.sum(model.apply({"params": p}, tokens, lengths=lengths)[:, :5] ** 2)

    grad = np.asarray(jax.grad(real_logits)(params["embed"]["positions"]["embedding"]))
    assert np.all(grad[off + 5:off + 8] == 0.0)
    assert np.all(np.abs(grad[off:off + 5]).sum(-1) > 0)        # the real rows do matter
    a = model.apply({"params": params}, tokens, lengths=lengths)
    b = model.apply({"params": params}, tokens.at[0, 5:].set(7), lengths=lengths)
    np.testing.assert_array_equal(a[0, :5], b[0, :5])


@pytest.mark.parametrize("num_labels", [0, 3], ids=["mlm", "classify"])
def test_a_packed_row_equals_its_examples_alone(num_labels):
    model, params = _model(**ROBERTA)
    a, b = random_tokens(3, (1, 5), 61), random_tokens(4, (1, 6), 61)
    packed = model.apply(
        {"params": params}, jnp.concatenate([a, b, jnp.zeros((1, 1), jnp.int32)], 1),
        segment_ids=jnp.array([[1] * 5 + [2] * 6 + [0]]),
        positions=jnp.array([list(range(5)) + list(range(6)) + [0]]),
        token_types=jnp.zeros((1, 12), jnp.int32))
    chex.assert_trees_all_close(packed[0, :5], model.apply({"params": params}, a)[0], atol=1e-5)
    chex.assert_trees_all_close(packed[0, 5:11], model.apply({"params": params}, b)[0],
                                atol=1e-5)


def test_token_types_change_the_output():
    model, params = _model()
    tokens = random_tokens(5, (1, 6), 61)
    a = model.apply({"params": params}, tokens)
    b = model.apply({"params": params}, tokens, token_types=jnp.array([[0, 0, 0, 1, 1, 1]]))
    assert not np.allclose(a, b, atol=1e-4)
    np.testing.assert_array_equal(
        a, model.apply({"params": params}, tokens, token_types=jnp.zeros((1, 6), jnp.int32)))


def test_the_classifier_reads_the_first_token_and_ignores_padding():
    model, params = _model(num_labels=3)
    tokens, lengths = random_tokens(6, (2, 8), 61), jnp.array([8, 4])
    logits = model.apply({"params": params}, tokens, lengths=lengths, method="classify")
    chex.assert_shape(logits, (2, 3))
    chex.assert_type(logits, jnp.float32)
    junk = model.apply({"params": params}, tokens.at[1, 4:].set(0), lengths=lengths,
                       method="classify")
    np.testing.assert_array_equal(logits[1], junk[1])


def test_scanned_layers_equal_looped_layers():
    cfg = tiny("encoder_only", **BERT)
    tokens = random_tokens(7, (2, 8), 61)
    looped = models.build(cfg)
    params = looped.init(jax.random.key(0), tokens)["params"]
    enc = params["encoder"]
    scanned_params = {**params, "encoder": {"layers": jax.tree.map(
        lambda *xs: jnp.stack(xs), enc["layer_0"], enc["layer_1"])}}
    scanned = models.build(cfg.replace(scan_layers=True))
    chex.assert_trees_all_close(scanned.apply({"params": scanned_params}, tokens),
                                looped.apply({"params": params}, tokens), atol=1e-5)


def test_wrong_head_and_bad_inputs_name_themselves():
    mlm, p = _model()
    with pytest.raises(ValueError, match=r"masked-LM head \(num_labels=0\)"):
        mlm.apply({"params": p}, jnp.ones((1, 4), jnp.int32), method="classify")
    clf, q = _model(num_labels=2)
    with pytest.raises(ValueError, match=r"classifies \(num_labels=2\).*method='classify'"):
        clf.apply({"params": q}, jnp.ones((1, 4), jnp.int32))
    plain, r = _model(num_token_types=0)
    with pytest.raises(ValueError, match=r"token_types given, but .* num_token_types=0"):
        plain.apply({"params": r}, jnp.ones((1, 4), jnp.int32),
                    token_types=jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(ValueError, match=r"lengths has shape \(3,\), but the tokens have"):
        mlm.apply({"params": p}, jnp.ones((2, 4), jnp.int32), lengths=jnp.array([1, 2, 3]))
    with pytest.raises(ValueError, match=r"num_labels=2 needs architecture='encoder_only'"):
        tiny("decoder_only", num_labels=2)


def _count(cfg) -> int:
    model = models.build(cfg)
    method = "classify" if cfg.num_labels else None
    tree = jax.eval_shape(lambda: model.init(
        jax.random.key(0), jnp.ones((1, 4), jnp.int32), method=method))["params"]
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("name,published", [
    ("bert-base", 109_482_240),     # BertModel of bert-base-uncased, pooler included
    ("roberta-base", 124_645_632),  # RobertaModel of roberta-base, pooler included
    ("bert-tiny", 4_385_920),       # google/bert_uncased_L-2_H-128_A-2
])
def test_presets_have_the_published_parameter_counts(name, published):
    """The base model plus pooler is the published count; a classifier of C labels adds its
    last layer (D*C + C), the masked-LM model instead adds its head (transform, norm,
    bias) and no pooler."""
    cfg = models.get_config(name, num_labels=2)
    assert _count(cfg) - (cfg.d_model * 2 + 2) == published
    mlm = models.get_config(name)
    D, V = mlm.d_model, mlm.vocab_size
    assert _count(mlm) == published - (D * D + D) + (D * D + D) + 2 * D + V


def test_decoding_an_encoder_only_model_says_why_not():
    import decode
    model, params = _model()
    with pytest.raises(ValueError, match=r"encoder-only model does not generate"):
        decode.generate(model, params, np.ones((1, 3), np.int32), np.array([3]),
                        max_new_tokens=2)
