"""LoRA adapters in the models (`models.lora`, `models.projection`): an adapted model starts
as its base, computes x W + scale * x A B with the scale PEFT uses, merges into the same
model, keeps its three call modes in agreement, and refuses what it cannot adapt by name."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models import lora
from models.errors import UserError
from tests.helpers import tiny

ALL = ("self_attention", "cross_attention", "mlp")


def _adapted(arch, targets, scan=False, **overrides):
    cfg = tiny(arch, scan_layers=scan, **overrides)
    targets = tuple(t for t in targets if arch == "encoder_decoder" or t != "cross_attention")
    return cfg, cfg.replace(lora=models.LoraConfig(rank=3, alpha=6.0, targets=targets))


def _init(cfg, seed=0):
    tokens = jnp.arange(10, dtype=jnp.int32).reshape(2, 5) + 3
    args = (tokens, tokens) if cfg.is_encoder_decoder else (tokens,)
    return models.build(cfg).init(jax.random.key(seed), *args)["params"], args


def _noisy(adapters, seed=1):
    """Adapters with every leaf random (B no longer zero)."""
    leaves, tree = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return tree.unflatten([0.3 * jax.random.normal(k, x.shape)
                           for k, x in zip(keys, leaves, strict=True)])


@pytest.mark.parametrize("arch", ["decoder_only", "encoder_decoder", "encoder_only"])
@pytest.mark.parametrize("scan", [False, True])
def test_adapted_model_starts_as_its_base_and_merges_into_the_same_model(arch, scan):
    # A gated MLP where the family allows one (the encoder-only head reads `activation`).
    act = "gelu" if arch == "encoder_only" else "swiglu"
    plain, cfg = _adapted(arch, ALL, scan, activation=act)
    params, args = _init(cfg)
    base, adapters = lora.split(params)
    model = models.build(cfg)
    chex.assert_trees_all_equal(model.apply({"params": params}, *args),
                                models.build(plain).apply({"params": base}, *args))
    for b in [x for p, x in jax.tree_util.tree_flatten_with_path(adapters)[0]
              if jax.tree_util.keystr(p).endswith("lora_b']")]:
        assert not np.any(b)                                     # B starts at zero
    tuned = lora.join(base, _noisy(adapters))
    out = model.apply({"params": tuned}, *args)
    merged_cfg, merged = lora.merge(cfg, tuned)
    assert merged_cfg == plain
    chex.assert_trees_all_equal_structs(merged, base)
    chex.assert_trees_all_close(models.build(plain).apply({"params": merged}, *args), out,
                                atol=2e-5)
    assert np.abs(out - model.apply({"params": params}, *args)).max() > 1e-2


def test_a_projection_adds_scale_times_x_a_b():
    cfg = tiny().replace(lora=models.LoraConfig(rank=2, alpha=5.0, targets=("decoder.mlp.up",)))
    params, (tokens,) = _init(cfg)
    base, adapters = lora.split(params)
    params = lora.join(base, _noisy(adapters))
    up = params["decoder"]["layer_0"]["mlp"]["up"]
    assert set(up) == {"kernel", "bias", "lora_a", "lora_b"}
    chex.assert_shape([up["lora_a"], up["lora_b"]], [(32, 2), (2, 48)])
    x = jax.random.normal(jax.random.key(2), (3, 32))
    module = models.projection.Projection.make(cfg, 48, "up", in_axes=("embed",),
                                               out_axes=("mlp",), bias=True)
    got = nn_apply(module, up, x, path=("decoder", "layer_0", "mlp"))
    expected = x @ up["kernel"] + up["bias"][None] + 2.5 * (x @ up["lora_a"]) @ up["lora_b"]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    rs = models.LoraConfig(rank=4, alpha=8.0, rslora=True)
    assert rs.shape_of(("decoder", "self_attention", "query")) == (4, 4.0)   # alpha/sqrt(r)


def nn_apply(module, params, x, path):
    """`module` applied at `path` in a model (its site decides the adapter)."""
    import flax.linen as nn

    class Nest(nn.Module):
        names: tuple

        @nn.compact
        def __call__(self, x):
            if len(self.names) == 1:
                return module.clone(name="up", parent=self)(x)
            return Nest(self.names[1:], name=self.names[0])(x)

    tree = params
    for name in reversed((*path, "up")):
        tree = {name: tree}
    return Nest((*path, "up")).apply({"params": {**tree}}, x)


def test_prefill_and_cached_steps_of_an_adapted_model_equal_its_forward_pass():
    _, cfg = _adapted("decoder_only", ALL, num_kv_heads=2)
    params, _ = _init(cfg)
    base, adapters = lora.split(params)
    params = lora.join(base, _noisy(adapters))
    model = models.build(cfg)
    tokens = jax.random.randint(jax.random.key(3), (2, 8), 3, 61)
    full = model.apply({"params": params}, tokens)
    cache = models.KVCache.create(cfg, 2, 12)
    lengths = jnp.array([5, 5])
    logits, cache = model.apply({"params": params}, tokens[:, :5], lengths, cache,
                                method="prefill")
    chex.assert_trees_all_close(logits, full[:, :5], atol=1e-5)
    for t in range(5, 8):
        step, cache = model.apply({"params": params}, tokens[:, t], cache, method="step")
        chex.assert_trees_all_close(step, full[:, t], atol=1e-5)


def test_adapter_dropout_acts_only_in_training():
    cfg = tiny().replace(lora=models.LoraConfig(rank=2, alpha=2.0, dropout=0.5,
                                                targets=("query",)))
    params, (tokens,) = _init(cfg)
    base, adapters = lora.split(params)
    params = lora.join(base, _noisy(adapters))
    model = models.build(cfg)
    eval_a = model.apply({"params": params}, tokens)
    chex.assert_trees_all_equal(eval_a, model.apply({"params": params}, tokens))
    train = [model.apply({"params": params}, tokens, deterministic=False,
                         rngs={"dropout": jax.random.key(k)}) for k in range(2)]
    assert np.abs(train[0] - train[1]).max() > 1e-4
    assert np.abs(train[0] - eval_a).max() > 1e-4


def test_targets_name_projections_by_their_place():
    site = ("decoder", "cross_attention", "value")
    assert all(lora.matches(t, site) for t in (
        "value", "cross_attention.value", "decoder.cross_attention.value", "cross_attention",
        "decoder.cross_attention"))
    assert not any(lora.matches(t, site) for t in (
        "key", "self_attention.value", "encoder.cross_attention", "mlp"))
    cfg = models.LoraConfig(rank=8, targets=("query", "decoder.self_attention.query"),
                            overrides=(("decoder.self_attention.query", 4, 2.0),))
    assert cfg.shape_of(("decoder", "self_attention", "query")) == (4, 0.5)   # most specific
    assert cfg.shape_of(("encoder", "self_attention", "query")) == (8, 2.0)
    assert cfg.shape_of(("encoder", "mlp", "up")) is None


@pytest.mark.parametrize("arch, bad, message", [
    ("decoder_only", dict(targets=("valeu",)), "did you mean 'value'"),
    ("decoder_only", dict(targets=("mlp.query",)), "is not a projection"),
    ("decoder_only", dict(targets=("gate",)), "names no projection of this decoder_only"),
    ("decoder_only", dict(targets=("cross_attention.query",)), "names no projection"),
    ("encoder_only", dict(targets=("decoder.mlp",)), "names no projection"),
    ("decoder_only", dict(rank=0), "lora.rank"),
    ("decoder_only", dict(rank=33, targets=("out",)), "above the projection's width"),
    ("decoder_only", dict(alpha=0.0), "lora.alpha"),
    ("decoder_only", dict(dropout=1.0), "lora.dropout"),
    ("decoder_only", dict(targets=()), "at least one projection"),
])
def test_refused_adapters_are_named(arch, bad, message):
    with pytest.raises(UserError, match=message):
        tiny(arch).replace(lora=models.LoraConfig(**{"targets": ("query",), **bad}))


def test_an_adapted_config_round_trips_through_its_dict():
    _, cfg = _adapted("encoder_decoder", ALL)
    cfg = cfg.replace(lora=models.LoraConfig(rank=2, targets=("query", "mlp"),
                                             overrides=(("mlp", 1, 3.0),)))
    assert models.TransformerConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(UserError, match="unknown lora field"):
        models.TransformerConfig.from_dict({**cfg.to_dict(), "lora": {"rnak": 2}})
