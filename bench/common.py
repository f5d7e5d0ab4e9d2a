"""What the training benchmarks share (`bench.train`, `bench.largest`): the train step
built as the trainer builds it, compiled from abstract shapes, and its memory.

    settings = bench_settings()                       # the default run config's parts
    wrapper, tx = make_wrapper(model, settings, mesh_shape=None, rows=16)   # pmap
    compiled, seconds, batch_bytes = compile_step(wrapper, model, tx, {"targets": (16, 64)})
    step_memory(compiled, batch_bytes)                # per-device bytes of the compiled step

`StepSettings()` stands in for `bench_settings()` where the run config cannot be read: its
checks open the dataset's builder, which needs TFDS. Nothing a data-parallel step needs
imports TFDS, grain, orbax or ml_collections (`python -m bench.accelerator` runs on a GPU
image that has none of them); the sharded wrappers and the run config import them when
used.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp

import models
from train import state as state_lib
from train.objectives import NextToken
from train.parallel import DataParallel
from train.settings import LoopSettings, ObjectiveSettings, OptimizerSettings, ParallelSettings
from train.step import Steps


def bench_settings():
    """The default run's config (a `train.run_config.RunConfig`) with a 1000-step schedule
    warming up over 100 steps (the optimiser, loss and objective settings every benchmarked
    step uses)."""
    from train import configs
    from train.run_config import RunConfig
    config = configs.get("default")
    config.update(num_train_steps=1000, warmup_steps=100)
    return RunConfig.from_config(config)


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """The three parts of a run config that `make_wrapper` reads, made directly: the
    trainer's defaults (adamw behind clipping at 1.0, label smoothing 0.1) unless given.
    What the step computes and costs is the same as under `bench_settings()` but for the
    learning rate's values."""

    optimizer: OptimizerSettings = dataclasses.field(default_factory=OptimizerSettings)
    objective: ObjectiveSettings = dataclasses.field(default_factory=ObjectiveSettings)
    loop: LoopSettings = dataclasses.field(default_factory=LoopSettings)


def make_state_fn(model, tx, base_dtype=None):
    """`make_state()`: the fresh train state (params from key 0), to run under jit, into
    shards (`Wrapper.init_state`), or abstractly (`jax.eval_shape`); an adapted model's
    frozen base in `base_dtype` (`TrainState.create`)."""
    args, method = models.axes.init_args(model.config)

    def make_state():
        tokens = [jnp.zeros(a.shape, a.dtype) for a in args]
        params = model.init(jax.random.key(0), *tokens, method=method)["params"]
        return state_lib.TrainState.create(params, tx, 0, base_dtype=base_dtype)
    return make_state


def param_count(model) -> int:
    """The model's parameter count, from an abstract initialisation."""
    args, method = models.axes.init_args(model.config)
    params = jax.eval_shape(lambda *a: model.init(jax.random.key(0), *a, method=method),
                            *args)["params"]
    return sum(math.prod(x.shape) for x in jax.tree.leaves(params))


def make_wrapper(model, settings, *, mesh_shape=None, rows: int, parallel: str = "pmap"):
    """The trainer's wrapper of `model`'s next-token steps (`train.setup.make_wrapper`):
    `parallel` ("pmap" or "shard_map") when `mesh_shape` is None, else sharded over that
    (data, fsdp, tensor) mesh of all devices with the default rules.

    Args:
        settings: the run config (`bench_settings()`) or a `StepSettings`, whose
            optimiser, objective and loop length the steps use.
        rows: the global batch, which must divide over data x fsdp.

    Returns:
        (the wrapper, its optimiser).

    Raises:
        UserError: a mesh that does not fit the devices, the heads or the batch.
    """
    tx, schedule = state_lib.make_optimizer(settings.optimizer, settings.loop.num_train_steps)
    objective = NextToken.build(model.config, None, settings.objective, model_name="bench")
    steps = Steps(model, objective, schedule, settings.optimizer.grad_accum_steps)
    if mesh_shape is None:                      # what train.setup.make_wrapper makes of it
        return DataParallel(parallel, *steps.functions()), tx
    from train import setup
    where = ParallelSettings(parallel="sharded", mesh_shape=tuple(mesh_shape))
    wrapper = setup.make_wrapper(where, steps, tx, seed=0)
    wrapper.check_rows(rows)
    return wrapper, tx


def compile_step(wrapper, model, tx, batch_shapes: dict, base_dtype=None):
    """`wrapper`'s train step compiled from abstract shapes: nothing is allocated.

    Args:
        tx: the optimiser the wrapper's steps were made with; states given to the
            executable must hold this same `tx`.
        batch_shapes: {key: (rows, width)} of the global batch, int32.
        base_dtype: an adapted model's frozen base dtype (`make_state_fn`).

    Returns:
        (compiled executable, seconds to lower and compile, this device's batch bytes).
    """
    abstract = jax.eval_shape(make_state_fn(model, tx, base_dtype))
    state, batch = wrapper.abstract_inputs(abstract, batch_shapes)
    batch_bytes = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                      for x in batch.values())
    t0 = time.perf_counter()
    compiled = wrapper.lower(state, batch).compile()
    return compiled, time.perf_counter() - t0, batch_bytes


def step_memory(compiled, batch_bytes: int) -> dict:
    """Per-device bytes of a compiled step, from XLA's `memory_analysis()` (see
    `bench.train`'s docstring; empty where the backend gives none)."""
    m = compiled.memory_analysis()
    if m is None:
        return {}
    args, temp = m.argument_size_in_bytes, m.temp_size_in_bytes
    unaliased = m.output_size_in_bytes - m.alias_size_in_bytes
    return {"state_bytes": args - batch_bytes, "batch_bytes": batch_bytes, "temp_bytes": temp,
            "output_not_aliased_bytes": unaliased, "per_device_bytes": args + temp + unaliased}
