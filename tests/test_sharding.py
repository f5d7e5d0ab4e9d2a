"""Sharded training (`train.sharding`): logical axes on every parameter, meshes equal to one
device, per-device memory that shrinks with fsdp × tensor, errors that name the numbers,
loading onto shards."""

import math

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import models
from models import axes
from models.config_checks import LINEAR_SHAPE
from tests.helpers import tiny
from tests.test_train_step import W, _batch
from tests.train_helpers import next_token_steps, tiny_train_config
from train import parallel, sharding, state as state_lib


def _variant(arch: str, gqa: bool, scan: bool) -> models.TransformerConfig:
    # Every width divides 4, so each sharded dimension splits evenly and the memory check is
    # exact up to the few replicated scalars; the MLP dominates the parameter bytes.
    return tiny(arch, vocab_size=64, d_model=32, num_heads=8, num_kv_heads=4 if gqa else 8,
                mlp_dim=256, max_len=W, use_bias=False, scan_layers=scan, num_layers=2,
                num_encoder_layers=1, num_decoder_layers=1)


def _init_args(cfg):
    tokens = jnp.zeros((1, W), jnp.int32)
    return (tokens, tokens) if cfg.is_encoder_decoder else (tokens,)


def _problem(cfg):
    model = models.build(cfg)
    steps, tx = next_token_steps(model, tiny_train_config("", adam_eps=1e-6))
    args = _init_args(cfg)

    def make_state(params=None):
        params = model.init(jax.random.key(0), *args)["params"] if params is None else params
        return state_lib.TrainState.create(params, tx, 0)
    return steps, tx, make_state


def _batches(cfg):
    out = [_batch(i, 8) for i in range(3)]
    if not cfg.is_encoder_decoder:
        out = [{k: v for k, v in b.items() if k.startswith("targets")} for b in out]
    return out


def _one_device(cfg):
    """Three steps with pmap over one device: the reference."""
    steps, _, make_state = _problem(cfg)
    train_fn, _ = steps.functions()
    one = jax.pmap(train_fn, axis_name="batch", devices=jax.devices()[:1])
    s = parallel.replicate(make_state(), jax.devices()[:1])
    for b in _batches(cfg):
        s, _ = one(s, jax.tree.map(lambda x: x.reshape(1, -1, W), b))
    return jax.tree.map(lambda x: np.asarray(x)[0], s.params)


def _sharded(cfg, mesh_shape):
    steps, tx, make_state = _problem(cfg)
    sh = sharding.for_model(steps, tx, mesh=sharding.make_mesh(mesh_shape),
                            rules=sharding.check_rules(sharding.DEFAULT_RULES))
    return sh, make_state


# Each mesh trains both families; across the meshes every family meets MHA and GQA,
# scanned and looped layers.
MESHES = {
    "data4": ((4, 1, 1), [("decoder_only", True, True), ("encoder_decoder", False, False)]),
    "fsdp4": ((1, 4, 1), [("decoder_only", False, False), ("encoder_decoder", True, True)]),
    "tensor4": ((1, 1, 4), [("decoder_only", True, False), ("encoder_decoder", False, True)]),
    "fsdp2_tensor2": ((1, 2, 2), [("decoder_only", False, True),
                                  ("encoder_decoder", True, False)]),
    "data2_tensor2": ((2, 1, 2), [("decoder_only", True, True),
                                  ("encoder_decoder", False, False)]),
}
_reference = {}


def _reference_params(cfg):
    if cfg not in _reference:
        _reference[cfg] = _one_device(cfg)
    return _reference[cfg]


@pytest.mark.parametrize("name", list(MESHES))
def test_three_sharded_steps_equal_one_device_and_each_device_holds_its_share(name):
    mesh_shape, variants = MESHES[name]
    data, fsdp, tensor = mesh_shape
    for arch, gqa, scan in variants:
        cfg = _variant(arch, gqa, scan)
        sh, make_state = _sharded(cfg, mesh_shape)
        state = sh.init_state(make_state)
        batches = [sh.put_batch(jax.tree.map(lambda x: x.reshape(4, -1, W), b))
                   for b in _batches(cfg)]
        step = sh.lower(state, batches[0]).compile()
        # The compiled program's arguments are this device's state and batch shards.
        batch_bytes = sum(x.nbytes for x in jax.tree.leaves(batches[0])) // (data * fsdp)
        state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
        per_device = step.memory_analysis().argument_size_in_bytes - batch_bytes
        share = state_bytes / (fsdp * tensor)
        assert abs(per_device - share) <= 0.1 * share, (arch, per_device, share)
        for b in batches:
            state, metrics = step(state, b)
        # Tolerance: the pmap test's (float32 sums in another order; 3 adam steps).
        chex.assert_trees_all_close(sh.host_state(state).params, _reference_params(cfg),
                                    atol=2e-5)
        assert float(metrics["weight"]) == sum(float((b["targets_segmentation"] > 0).sum())
                                               for b in _batches(cfg)[-1:])


def test_parameters_and_adam_moments_split_as_the_rules_say():
    cfg = _variant("decoder_only", gqa=True, scan=True)
    sh, make_state = _sharded(cfg, (1, 2, 2))
    state = sh.init_state(make_state)
    up = state.params["decoder"]["layers"]["mlp"]["up"]["kernel"]          # [L, D, F]
    assert up.sharding.spec == P(None, "fsdp", "tensor")
    assert up.addressable_data(0).shape == (2, 16, 128)        # a quarter on each device
    key = state.params["decoder"]["layers"]["self_attention"]["key"]["kernel"]   # [L, D, K, H]
    assert key.sharding.spec == P(None, "fsdp", "tensor", None)
    mu = state.opt_state[1][0].mu["decoder"]["layers"]["mlp"]["up"]["kernel"]
    assert mu.sharding.spec == up.sharding.spec
    assert state.step.sharding.is_fully_replicated


def test_every_parameter_of_every_preset_names_each_of_its_axes():
    for name in models.list_configs():
        base = models.get_config(name)
        for scan in (False, True):
            linear = scan and base.has_linear_layers      # linear layers run looped only
            cfg = base.replace(scan_layers=scan, d_model=64, mlp_dim=64, vocab_size=64,
                               num_heads=4, num_kv_heads=min(base.num_kv_heads, 4),
                               head_dim=16, num_layers=2, num_encoder_layers=2,
                               num_decoder_layers=2,
                               layer_types=(("full", "full") if linear   # a full layer last
                                            else base.layer_types[-2:]),
                               **dict.fromkeys(LINEAR_SHAPE if linear else ()),
                               nope_layers=(1,) if base.nope_layers else (),
                               moe_layers=(1,) if base.moe_layers and not scan else (),
                               first_attention_norm=base.first_attention_norm or scan,
                               qk_rope_head_dim=8 if base.latent else None,
                               **{k: None if v is None else v % 64 for k, v in (
                                   ("pad_id", base.pad_id), ("eos_id", base.eos_id),
                                   ("bos_id", base.bos_id))})
            model = models.build(cfg)
            args, method = axes.init_args(cfg)
            boxed = axes.boxed_params(model, *args, method=method)
            leaves = jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
            for leaf in leaves:
                assert isinstance(leaf, nn.LogicallyPartitioned), (name, leaf)
                assert len(leaf.names) == leaf.value.ndim and None not in leaf.names
                assert set(leaf.names) <= set(axes.NAMES)
            if scan:
                stacked = boxed["decoder" if "decoder" in boxed else "encoder"]["layers"]
                assert all(leaf.names[0] == "layers" for leaf in jax.tree.leaves(
                    stacked, is_leaf=lambda x: isinstance(x, nn.Partitioned)))


def test_a_model_used_without_a_mesh_gets_plain_arrays():
    cfg = _variant("decoder_only", gqa=False, scan=True)
    params = models.build(cfg).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(params))
    assert set(params) == {"params"}


def test_rules_and_meshes_that_do_not_fit_are_refused_naming_the_numbers():
    with pytest.raises(ValueError, match=r"mesh_shape=\(2, 1, 4\) has 8 devices, but there "
                                         r"are 4"):
        sharding.make_mesh((2, 1, 4))
    with pytest.raises(ValueError, match=r"4 devices do not divide over the fixed axes' 3"):
        sharding.make_mesh((1, -1, 3))
    with pytest.raises(ValueError, match="at most one -1"):
        sharding.make_mesh((-1, -1, 1))
    mesh = sharding.make_mesh((1, 1, 4))
    rules = sharding.check_rules(sharding.DEFAULT_RULES)
    gqa = _variant("decoder_only", gqa=True, scan=False).replace(num_kv_heads=2)
    with pytest.raises(ValueError, match=r"num_kv_heads=2 does not divide over the tensor "
                                         r"axis of 4 devices"):
        sharding.check_model(gqa, mesh, rules)
    with pytest.raises(ValueError, match=r"num_heads=6 does not divide"):
        sharding.check_model(gqa.replace(num_heads=6, num_kv_heads=6, head_dim=4), mesh, rules)
    with pytest.raises(ValueError, match="'heads' to \\['model'\\]"):
        sharding.check_rules((("heads", "model"),))
    with pytest.raises(ValueError, match="'width', which is not a logical axis"):
        sharding.check_rules((("width", "fsdp"),))


def test_a_batch_that_does_not_divide_over_data_times_fsdp_is_refused():
    cfg = _variant("decoder_only", gqa=False, scan=True)
    sh, _ = _sharded(cfg, (2, 2, 1))
    rows = {"targets": np.zeros((2, 3, W), np.int32)}             # 6 rows over 4 ways
    with pytest.raises(ValueError, match="a batch of 6 rows does not divide over data × fsdp "
                                         "= 4 devices"):
        sh.put_batch(rows)


def test_a_dimension_that_does_not_divide_stays_whole_and_is_listed():
    cfg = _variant("decoder_only", gqa=False, scan=False).replace(vocab_size=61)
    model = models.build(cfg)
    boxed = axes.boxed_params(model, *_init_args(cfg))
    mesh = sharding.make_mesh((1, 1, 4))
    rules = sharding.check_rules(sharding.DEFAULT_RULES)
    specs = nn.get_partition_spec(boxed)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), *_init_args(cfg))["params"])
    placed = sharding.shardings(specs, shapes, mesh, rules)
    assert placed["tokens"]["embedding"].spec == P(None, None)   # 61 rows over 4: whole
    assert placed["decoder"]["layer_0"]["mlp"]["up"]["kernel"].spec == P(None, "tensor")
    assert sharding.undivided(specs, shapes, mesh, rules) == [
        "['tokens']['embedding']: vocab 61 over 4"]


def test_load_puts_each_array_on_its_shards_with_the_saved_values(tmp_path):
    cfg = _variant("decoder_only", gqa=True, scan=True)
    model = models.build(cfg)
    params = model.init(jax.random.key(3), jnp.zeros((1, 4), jnp.int32))["params"]
    models.save(str(tmp_path / "m"), cfg, params)
    mesh = sharding.make_mesh((1, 2, 2))
    loaded = models.load(str(tmp_path / "m"), mesh=mesh, scan_layers=True).params
    kernel = loaded["decoder"]["layers"]["mlp"]["down"]["kernel"]     # [L, F, D]
    assert kernel.sharding.spec == P(None, "tensor", "fsdp")
    assert math.prod(kernel.addressable_data(0).shape) == kernel.size // 4
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, loaded), params)


def test_the_config_refuses_a_bad_mesh_shape_or_rules_by_name():
    from train.run_config import check_config
    with pytest.raises(ValueError, match=r"mesh_shape=\(1, -1, -1\) must be three sizes"):
        check_config(tiny_train_config("", mesh_shape=(1, -1, -1)))
    with pytest.raises(ValueError, match="logical_axis_rules=.* must be pairs"):
        check_config(tiny_train_config("", logical_axis_rules=(("heads", "model"),)))
    check_config(tiny_train_config("", parallel="sharded", mesh_shape=(2, -1, 1),
                                   logical_axis_rules=(("batch", "data"), ("mlp", "tensor"))))
