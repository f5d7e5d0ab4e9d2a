"""QLoRA (`lora.base_quant`): adapters train over a quantized frozen base, equal over 4
devices and one, the base never changes, and a real run's loss falls and its PEFT-layout
adapters apply to the float base."""

import os

import chex
import jax
import numpy as np
import pytest

import models
from models.errors import UserError
from models.quant import Quantized
from tests.test_finetune import gpt2_dir  # noqa: F401  (a fixture)
from tests.test_lora_finetune import _lora_config
from tests.test_lora_train import _setup
from tests.test_train_step import W, _batch
from tests.train_helpers import train_metric_rows
from train import parallel
from train.trainer import train_and_evaluate

pytest.importorskip("transformers")


def _quantized_state(scheme):
    steps, tx, float_state = _setup()
    base = float_state.frozen
    plain = steps.model.config.replace(lora=None)
    quantize = lambda tree: models.quantize(tree, plain, scheme, group=16)  # noqa: E731
    from train import state as state_lib
    state = state_lib.TrainState.create(float_state.model_params, tx, 0,
                                        quantize_base=quantize)
    return steps, state, base


def test_adapters_train_over_a_quantized_base_alike_on_4_devices_and_one():
    steps, state, float_base = _quantized_state("int4")
    kinds = {type(x) for x in jax.tree.leaves(
        state.frozen, is_leaf=lambda x: isinstance(x, Quantized))}
    assert Quantized in kinds
    chex.assert_trees_all_equal_structs(state.params, models.lora.split(
        state.model_params)[1])
    batches = [_batch(i, 8) for i in range(3)]
    results = []
    for devices in (1, 4):
        wrapper = parallel.DataParallel("pmap", *steps.functions())
        s = parallel.replicate(state, jax.devices()[:devices])
        for b in batches:
            shaped = {k: v.reshape(devices, -1, W) for k, v in b.items()}
            s, _ = wrapper.train_step(s, shaped)
        results.append(wrapper.host_state(s))
    one, many = results
    chex.assert_trees_all_close(many.params, one.params, atol=2e-5)
    chex.assert_trees_all_equal(many.frozen, jax.device_get(state.frozen))   # untouched
    moved = [np.abs(b - a).max() for a, b in zip(jax.tree.leaves(state.params),
                                                 jax.tree.leaves(one.params), strict=True)]
    assert max(moved) > 0
    # The quantized base computes close to the float one it came from.
    plain = models.build(steps.model.config.replace(lora=None))
    src = _batch(0, 2)["inputs"]
    tgt = _batch(0, 2)["targets"]
    expected = plain.apply({"params": float_base}, src, tgt)
    got = plain.apply({"params": state.frozen}, src, tgt)
    np.testing.assert_allclose(got, expected, atol=0.15 * float(np.abs(expected).max()))


def test_a_qlora_run_falls_and_exports_adapters_for_the_float_base(data_dir, gpt2_dir,  # noqa: F811
                                                                   tmp_path, capsys):
    workdir = str(tmp_path / "qlora")
    train_and_evaluate(_lora_config(data_dir, gpt2_dir, 12, base_quant="int4",
                                    base_quant_group=16), workdir)
    assert "the frozen base's projections are int4 (groups of 16)" in capsys.readouterr().out
    losses = [r["loss"] for r in train_metric_rows(workdir)]
    assert losses[-1] < losses[0] - 0.15, losses
    adapted = models.load(os.path.join(workdir, "adapter"))     # onto the float base
    assert adapted.config.lora.rank == 4
    assert not models.quant.is_quantized(adapted.params)
    base = models.load(gpt2_dir[0])
    ids = np.array([base.tokenizer.encode("the cat sat on a mat")])
    ours = adapted.model.apply({"params": adapted.params}, ids)
    assert np.abs(ours - base.model.apply({"params": base.params}, ids)).max() > 1e-2


def test_base_quant_is_refused_on_a_sharded_mesh_and_checked_by_name(data_dir, gpt2_dir):  # noqa: F811
    config = _lora_config(data_dir, gpt2_dir, 2, base_quant="int8")
    config.parallel = "sharded"
    config.mesh_shape = (1, 4, 1)
    with pytest.raises(UserError, match="lora.base_quant='int8' trains over data-parallel"):
        train_and_evaluate(config, str(data_dir) + "/never")
    bad = _lora_config(data_dir, gpt2_dir, 2, base_quant="nf4")
    with pytest.raises(UserError, match="lora.base_quant='nf4'"):
        train_and_evaluate(bad, str(data_dir) + "/never")
