"""The one wrapper interface (`train.wrapper.Wrapper`): pmap, shard_map and sharded meshes
answer the same questions alike, so setup, the loop and the benchmarks never ask which one
they hold. (That each trains as one device does is test_train_step's and test_sharding's.)"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from tests.helpers import tiny
from tests.test_train_step import W, _batch
from tests.train_helpers import next_token_steps, tiny_train_config
from train import parallel, setup, sharding
from train.settings import ParallelSettings
from train.state import TrainState

WHERE = {
    "pmap": ParallelSettings(parallel="pmap"),
    "shard_map": ParallelSettings(parallel="shard_map"),
    "fsdp4": ParallelSettings(parallel="sharded", mesh_shape=(1, 4, 1)),
    "fsdp2_tensor2": ParallelSettings(parallel="sharded", mesh_shape=(1, 2, 2)),
}


def _made(name: str, **overrides):
    cfg = tiny("encoder_decoder", **{
        "vocab_size": 64, "d_model": 32, "num_heads": 4, "mlp_dim": 64, "max_len": W,
        "use_bias": False, "num_encoder_layers": 1, "num_decoder_layers": 1, **overrides})
    model = models.build(cfg)
    steps, tx = next_token_steps(model, tiny_train_config(""))
    wrapper = setup.make_wrapper(WHERE[name], steps, tx, seed=0)
    tokens = jnp.zeros((1, W), jnp.int32)

    def make_state(params=None):
        params = model.init(jax.random.key(0), tokens, tokens)["params"] if params is None \
            else params
        return TrainState.create(params, tx, 0)
    return cfg, model, wrapper, make_state


def test_the_settings_pick_the_wrapper_and_every_one_is_a_wrapper():
    kinds = {name: type(_made(name)[2]) for name in WHERE}
    assert kinds == {"pmap": parallel.DataParallel, "shard_map": parallel.DataParallel,
                     "fsdp4": sharding.Sharded, "fsdp2_tensor2": sharding.Sharded}


@pytest.mark.parametrize("name", list(WHERE))
def test_a_fresh_state_a_restore_template_and_loaded_params_are_placed_alike(name, tmp_path):
    cfg, model, wrapper, make_state = _made(name)
    expected = jax.jit(make_state)()
    state = wrapper.init_state(make_state)
    chex.assert_trees_all_equal(wrapper.host_state(state), jax.tree.map(np.asarray, expected))
    # The template a checkpoint is restored into: placed as the steps take the state.
    template = wrapper.restore_template(jax.eval_shape(make_state))
    chex.assert_trees_all_equal_shapes_and_dtypes(template, expected)
    if isinstance(wrapper, sharding.Sharded):
        assert all(jax.tree.leaves(jax.tree.map(lambda t, s: t.sharding == s, template,
                                                wrapper.state_shardings)))
    # init_from's params, placed as they are read; the state made from them equals theirs.
    models.save(str(tmp_path / "m"), cfg, expected.params)
    loaded = wrapper.load_params(str(tmp_path / "m"))
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, loaded), expected.params)
    if isinstance(wrapper, sharding.Sharded):        # each array straight onto its shards
        placed = jax.tree.map(lambda x, s: x.sharding.is_equivalent_to(s, x.ndim), loaded,
                              wrapper.state_shardings.params)
        assert all(jax.tree.leaves(placed))
    again = wrapper.init_state(make_state, loaded)
    chex.assert_trees_all_equal(wrapper.host_state(again).params, expected.params)
    # A host state put back is the same state.
    chex.assert_trees_all_equal(wrapper.host_state(wrapper.put_state(
        wrapper.host_state(state))), wrapper.host_state(state))


@pytest.mark.parametrize("name", list(WHERE))
def test_the_step_compiled_from_abstract_inputs_is_the_step_the_loop_runs(name):
    """What the benchmarks compile (nothing allocated) runs on what the loop places."""
    _, _, wrapper, make_state = _made(name)
    batch = jax.tree.map(lambda x: x.reshape(4, -1, W), _batch(0, 8))
    shapes = {k: (8, W) for k in batch}
    state_shapes, batch_shapes = wrapper.abstract_inputs(jax.eval_shape(make_state), shapes)
    compiled = wrapper.lower(state_shapes, batch_shapes).compile()
    placed = wrapper.put_batch(batch)
    by_compiled, metrics = compiled(wrapper.init_state(make_state), placed)
    by_step, step_metrics = wrapper.train_step(wrapper.init_state(make_state), batch)
    chex.assert_trees_all_equal(wrapper.host_state(by_compiled), wrapper.host_state(by_step))
    chex.assert_trees_all_equal(wrapper.metrics(metrics), wrapper.metrics(step_metrics))


def test_a_batch_that_does_not_divide_and_a_dimension_kept_whole_are_named():
    with pytest.raises(ValueError, match="a batch of 6 rows does not divide over the 4 "
                                         "devices"):
        _made("pmap")[2].check_rows(6)
    with pytest.raises(ValueError, match="a batch of 6 rows does not divide over data × "
                                         "fsdp = 4 devices"):
        _made("fsdp4")[2].check_rows(6)
    assert _made("pmap")[2].notes() == []
    assert _made("fsdp2_tensor2", vocab_size=61)[2].notes() == [
        "mesh {'data': 1, 'fsdp': 2, 'tensor': 2}: 1 parameter(s) kept whole along a "
        "dimension that does not divide its axes: ['src_tokens']['embedding']: vocab 61 "
        "over 2"]
