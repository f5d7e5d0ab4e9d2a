"""Configs, presets and parameter counts."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models


def _count(cfg: models.TransformerConfig) -> int:
    model = models.build(cfg)
    args, method = models.axes.init_args(cfg)      # tokens, or an audio encoder's features
    shapes = jax.eval_shape(lambda *a: model.init(jax.random.key(0), *a, method=method),
                            *args)["params"]
    return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))


def test_gpt2_small_has_the_published_parameter_count():
    assert _count(models.get_config("gpt2-small", vocab_size=50257, max_len=1024)) == 124_439_808


def test_transformer_base_is_near_the_papers_65m():
    # 37000 x 512 shared embeddings (tied output): 18,944,000
    # 6 encoder layers x 3,152,384 (attention 4 x 262,656, MLP 2,099,712, 2 LayerNorms)
    # 6 decoder layers x 4,204,032 (2 attentions, MLP, 3 LayerNorms); post-norm: no final norm
    expected = 37_000 * 512 + 6 * 3_152_384 + 6 * 4_204_032
    assert expected == 63_082_496
    assert _count(models.get_config("transformer-base", vocab_size=37_000)) == expected


@pytest.mark.parametrize("name", models.list_configs())
def test_every_preset_builds(name):
    cfg = models.get_config(name)
    assert _count(cfg) > 0
    family = {"encoder_decoder": models.EncoderDecoder, "decoder_only": models.DecoderOnly,
              "encoder_only": models.EncoderOnly}
    assert isinstance(models.build(cfg), family[cfg.architecture])


def test_presets_have_their_architectures():
    llama = models.get_config("llama-small")
    assert (llama.norm, llama.positions, llama.activation, llama.use_bias) == (
        "rmsnorm", "rope", "swiglu", False)
    assert llama.num_kv_heads < llama.num_heads
    gpt2 = models.get_config("gpt2-small")
    assert (gpt2.positions, gpt2.activation, gpt2.norm_position, gpt2.tie_embeddings) == (
        "learned", "gelu", "pre", True)
    base = models.get_config("transformer-base")
    assert (base.norm_position, base.positions, base.activation, base.share_embeddings) == (
        "post", "sinusoidal", "relu", True)


def test_overrides_and_replace():
    cfg = models.get_config("gpt-tiny", vocab_size=1000, num_kv_heads=1)
    assert (cfg.vocab_size, cfg.num_kv_heads, cfg.head_dim) == (1000, 1, 16)
    # replace keeps derived sizes like any field; None derives them again.
    assert cfg.replace(d_model=128).head_dim == 16
    assert cfg.replace(d_model=128, head_dim=None).head_dim == 32
    assert models.get_config("gpt-tiny").replace(num_heads=8).num_kv_heads == 4
    assert models.get_config("gpt-tiny").replace(num_heads=8, num_kv_heads=None).num_kv_heads == 8
    assert cfg.replace(num_heads=8).num_kv_heads == 1
    # numpy integers are ints (stored as Python ints, so the config hashes the same).
    assert models.get_config("gpt-tiny", d_model=np.int64(64)) == models.get_config("gpt-tiny")
    assert hash(cfg) == hash(models.get_config("gpt-tiny", vocab_size=1000, num_kv_heads=1))
    assert models.get_config("gpt-tiny", dtype=jnp.bfloat16).dtype == "bfloat16"


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown config 'gpt5'.*gpt2-small"):
        models.get_config("gpt5")


def test_unknown_override_names_itself():
    with pytest.raises(ValueError, match=r"\['num_layer'\]"):
        models.get_config("gpt-tiny", num_layer=3)
    with pytest.raises(ValueError, match=r"\['depth'\]"):
        models.get_config("gpt-tiny").replace(depth=3)


@pytest.mark.parametrize("overrides,message", [
    (dict(d_model=65), r"d_model=65 is not divisible by num_heads=4"),
    (dict(num_kv_heads=3), r"num_heads=4 is not divisible by num_kv_heads=3"),
    (dict(positions="alibi"), r"positions='alibi' is not one of"),
    (dict(norm="batchnorm"), r"norm='batchnorm' is not one of"),
    (dict(norm_position="sandwich"), r"norm_position='sandwich'"),
    (dict(activation="tanh"), r"activation='tanh'"),
    (dict(architecture="rnn"), r"architecture='rnn'"),
    (dict(vocab_size=0), r"vocab_size=0 must be a positive int"),
    (dict(num_layers=-1), r"num_layers=-1 must be a positive int"),
    (dict(mlp_dim=2.5), r"mlp_dim=2.5 must be a positive int"),
    (dict(max_len=0), r"max_len=0 must be a positive int"),
    (dict(dropout_rate=1.0), r"dropout_rate=1.0 must be in \[0, 1\)"),
    (dict(positions="rope", head_dim=15), r"head_dim=15 must be even"),
    (dict(dtype="int32"), r"dtype='int32' must be a floating dtype"),
    (dict(dtype="float33"), r"dtype='float33' is not a dtype"),
    (dict(eos_id=512), r"eos_id=512 must be an int in \[0, vocab_size=512\)"),
    (dict(pad_id=-1), r"pad_id=-1 must be an int in \[0, vocab_size=512\)"),
    (dict(d_model="64"), r"d_model='64' must be a positive int"),
    (dict(use_bias="no"), r"use_bias='no' must be bool, not str"),
    (dict(rope_theta="1e4"), r"rope_theta='1e4' must be float, not str"),
    (dict(sliding_window=0), r"sliding_window=0 must be a positive int"),
    (dict(rope_scaling=dict(factor=8.0)), r"rope_scaling=.* needs positions='rope'"),
    (dict(positions="rope", rope_scaling=dict(factr=8.0)), r"unknown keys \['factr'\]"),
    (dict(positions="rope", rope_scaling=dict(low_freq_factor=4.0, high_freq_factor=1.0)),
     r"high_freq_factor=1.0 must be at least low_freq_factor=4.0"),
    (dict(norm_eps=0.0), r"norm_eps=0.0 must be > 0"),
    (dict(positions="rope", position_offset=2),
     r"position_offset=2 needs positions='learned' or 'sinusoidal', not 'rope'"),
    (dict(positions="learned", position_offset=-1), r"position_offset=-1 must be >= 0"),
    (dict(architecture="encoder_only", num_labels=3, label_names=["a", "b"]),
     r"label_names has 2 names \['a', 'b'\], but num_labels=3"),
    (dict(architecture="encoder_only", num_labels=2, label_names=["a", "a"]),
     r"label_names names \['a'\] more than once"),
    (dict(architecture="encoder_only", num_labels=1, label_names="a"),
     r"label_names='a' must be a list of strings"),
    (dict(architecture="encoder_only", num_labels=1, label_names=[""]),
     r"label_names has ''; each name must be a non-empty string"),
    (dict(positions="relative", relative_buckets=1), r"relative_buckets=1 is too few"),
    (dict(positions="relative", relative_buckets=32, relative_max_distance=16),
     r"relative_max_distance=16 must exceed relative_buckets // 2 = 16"),
    (dict(mlp_dropout_rate=-0.1), r"mlp_dropout_rate=-0.1 must be in \[0, 1\)"),
    (dict(scale_attention=1), r"scale_attention=1 must be bool, not int"),
])
def test_bad_configs_name_field_value_and_rule(overrides, message):
    with pytest.raises(ValueError, match=message):
        models.get_config("gpt-tiny", **overrides)


def test_special_ids_may_coincide_and_pad_may_be_absent():
    """GPT-2 starts and ends with 50256 and has no pad token; Marian starts with its pad."""
    gpt2 = models.get_config("gpt2-small", bos_id=50256, eos_id=50256, pad_id=None)
    assert (gpt2.bos_id, gpt2.eos_id, gpt2.pad_id) == (50256, 50256, None)
    assert models.get_config("transformer-tiny", bos_id=0, pad_id=0).bos_id == 0


def test_build_rejects_non_configs():
    with pytest.raises(TypeError, match="TransformerConfig"):
        models.build({"d_model": 64})
