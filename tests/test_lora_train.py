"""Training low-rank adapters: only they move (and only they have optimiser state), the
frozen base keeps its values and its storage dtype, and pmap, shard_map, the sharded mesh and
gradient accumulation agree with one device as for full training."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from tests.helpers import tiny
from tests.test_train_step import W, _batch
from tests.train_helpers import next_token_steps, tiny_train_config
from train import parallel, sharding, state as state_lib

LORA = models.LoraConfig(rank=2, alpha=4.0, targets=(
    "query", "value", "cross_attention.key", "decoder.mlp.down"))


def _setup(base_dtype=None, **overrides):
    config = tiny_train_config("", **{"adam_eps": 1e-6, **overrides})
    cfg = tiny("encoder_decoder", max_len=W, use_bias=False, num_encoder_layers=1,
               num_decoder_layers=1, lora=LORA)
    model = models.build(cfg)
    params = model.init(jax.random.key(0), jnp.zeros((1, W), jnp.int32),
                        jnp.zeros((1, W), jnp.int32))["params"]
    steps, tx = next_token_steps(model, config)
    return steps, tx, state_lib.TrainState.create(params, tx, 0, base_dtype=base_dtype)


def _train(kind, devices, batches, base_dtype=None, **overrides):
    steps, tx, state = _setup(base_dtype, **overrides)
    if kind == "sharded":
        wrapper = sharding.for_model(steps, tx, mesh=sharding.make_mesh((1, 2, 2)),
                                     rules=sharding.check_rules(sharding.DEFAULT_RULES),
                                     base_dtype=base_dtype)
        s = wrapper.put_state(state)
    else:
        wrapper = parallel.DataParallel(kind, *steps.functions())
        s = parallel.replicate(state, jax.devices()[:devices]) if devices == 1 else (
            wrapper.put_state(state))
    for b in batches:
        batch = jax.tree.map(lambda x: x.reshape(devices, -1, W), b)
        if devices == 1:
            one = jax.pmap(steps.functions()[0], axis_name="batch", devices=jax.devices()[:1])
            s, _ = one(s, batch)
        else:
            s, _ = wrapper.train_step(s, batch)
    return state, wrapper.host_state(s) if devices > 1 else parallel.DataParallel(
        "pmap", *steps.functions()).host_state(s)


def test_only_the_adapters_train_and_have_optimiser_state():
    start, end = _train("pmap", 4, [_batch(i, 8) for i in range(2)], base_dtype="bfloat16")
    adapters = models.lora.split(start.model_params)[1]
    chex.assert_trees_all_equal_structs(start.params, adapters)
    # adam's moments exist for the adapters alone
    moments = [x for x in jax.tree.leaves(start.opt_state) if x.ndim]
    assert sum(x.size for x in moments) == 2 * sum(x.size for x in jax.tree.leaves(adapters))
    # the base is stored in bfloat16 and never changes; every B moved off zero
    assert {x.dtype for x in jax.tree.leaves(start.frozen)} == {jnp.dtype("bfloat16")}
    chex.assert_trees_all_equal(end.frozen, jax.device_get(start.frozen))
    for path, b in jax.tree_util.tree_flatten_with_path(end.params)[0]:
        if jax.tree_util.keystr(path).endswith("lora_b']"):
            assert np.abs(b).max() > 0, path


def test_step_0_of_an_adapted_model_is_its_base():
    steps, _, state = _setup()
    batch = jax.tree.map(lambda x: x.reshape(1, -1, W), _batch(0, 4))
    plain = models.build(steps.model.config.replace(lora=None))
    base = state.frozen
    src, tgt = batch["inputs"][0], batch["targets"][0]
    chex.assert_trees_all_close(steps.model.apply({"params": state.model_params}, src, tgt),
                                plain.apply({"params": base}, src, tgt))


@pytest.mark.parametrize("kind", ["pmap", "shard_map", "sharded"])
def test_adapters_trained_over_4_devices_equal_one_device(kind):
    batches = [_batch(i, 8) for i in range(3)]
    _, one = _train("pmap", 1, batches)
    _, many = _train(kind, 4, batches)
    chex.assert_trees_all_close(many.params, one.params, atol=2e-5)
    chex.assert_trees_all_close(many.opt_state, one.opt_state, atol=2e-5)


def test_accumulated_adapter_updates_equal_one_larger_batch():
    big = _batch(7, 8, packed=False)
    halves = [jax.tree.map(lambda x: x[:4], big), jax.tree.map(lambda x: x[4:], big)]
    _, accumulated = _train("pmap", 4, halves, grad_accum_steps=2)
    _, once = _train("pmap", 4, [big])
    chex.assert_trees_all_close(accumulated.params, once.params, atol=1e-5)
