"""Training past one device's memory: the step under `jax.jit` with named shardings.

A mesh of devices has three axes, and rules map each parameter's logical axes
(`models.axes`) onto them; the compiler (GSPMD) partitions the step and inserts the
collectives.

    axis     splits                                      communicates, per step
    data     the batch; parameters whole on each device  gradients all-reduced
    fsdp     the batch, and every parameter and optimiser  parameters all-gathered before
             moment along "embed" (FSDP, ZeRO-3)           use (forward and backward),
                                                           gradients reduce-scattered
    tensor   attention heads, kv heads, MLP width and     one all-reduce of activations per
             the vocabulary (Megatron-style)              sublayer (attention, MLP), forward
                                                           and backward
    expert   the batch, and a mixture of experts'         the experts' weights gathered
             experts (`models.moe`; its parameters        where the compiler needs them
             with the logical axis "expert")              (none without experts)

`expert` (`make_mesh`'s `expert`, the run config's `mesh_expert`) is a size of its own,
1 by default, beside the three of `mesh_shape`.

`mesh_shape` is (data, fsdp, tensor), -1 meaning "the devices the others leave", so the
default (1, -1, 1) is FSDP over every device. The rules (`DEFAULT_RULES`, or the config's
`logical_axis_rules`) say which mesh axes split which logical axis:

    sharded = for_model(Steps(model, objective, schedule), tx, mesh=make_mesh((1, -1, 1)),
                        rules=check_rules(DEFAULT_RULES))       # a Sharded
    state = sharded.init_state(fresh_state)  # made straight into its shards

`Sharded` is a `train.wrapper.Wrapper`: setup and the loop use it as they use pmap's.

A dimension that does not divide over its mesh axes stays whole (a byte vocabulary of 261
over tensor 2, say; `undivided` lists them), except attention heads and kv heads, which
must divide the tensor axis (an error names both numbers).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.core import meta
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import models
from models.axes import (
    AXES,
    DEFAULT_RULES,
    EXPERT_AXIS,
    axis_size,
    boxed_params,
    check_rules,
    dim_names,
    init_args,
    mesh_spec,
    sharded_activations,
    shardings,
)
from models.errors import UserError
from train import state as state_lib
from train.step import Steps
from train.wrapper import Wrapper

__all__ = ["AXES", "DEFAULT_RULES", "Sharded", "check_model", "check_rules", "for_model",
           "make_mesh",
           "mesh_spec", "resolve_mesh_shape", "shardings", "state_specs", "undivided"]


def resolve_mesh_shape(mesh_shape: Sequence[int], num_devices: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) with the one -1 replaced by what the others leave.

    Raises:
        UserError: not three sizes, more than one -1, a size below 1, or a product that is
            not the device count (naming the shape and the count).
    """
    shape = tuple(int(s) for s in mesh_shape)
    if len(shape) != 3:
        raise UserError(f"mesh_shape={tuple(mesh_shape)} must be three sizes "
                         f"(data, fsdp, tensor)")
    if shape.count(-1) > 1 or any(s < 1 and s != -1 for s in shape):
        raise UserError(f"mesh_shape={shape} must hold sizes >= 1 and at most one -1")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if num_devices % known:
            raise UserError(f"mesh_shape={shape}: {num_devices} devices do not divide "
                             f"over the fixed axes' {known}")
        shape = tuple(num_devices // known if s == -1 else s for s in shape)
    if math.prod(shape) != num_devices:
        raise UserError(f"mesh_shape={shape} has {math.prod(shape)} devices, but there are "
                         f"{num_devices}")
    return shape


def make_mesh(mesh_shape: Sequence[int] = (1, -1, 1), devices=None, *, expert: int = 1
              ) -> Mesh:
    """A (data, fsdp, tensor, expert) mesh over `devices` (default: every device of every
    process): `mesh_shape` sizes the first three over the devices the `expert` axis leaves.

    Raises:
        UserError: an expert size that is not an int >= 1 dividing the device count, or a
            `mesh_shape` that `resolve_mesh_shape` refuses (naming the numbers).
    """
    from jax.experimental import mesh_utils
    devices = jax.devices() if devices is None else list(devices)
    if isinstance(expert, bool) or not isinstance(expert, int) or expert < 1 or (
            len(devices) % expert):
        raise UserError(f"mesh_expert={expert!r} must be an int >= 1 that divides the "
                        f"{len(devices)} devices")
    shape = (*resolve_mesh_shape(mesh_shape, len(devices) // expert), expert)
    return Mesh(mesh_utils.create_device_mesh(shape, devices), (*AXES, EXPERT_AXIS))


def check_model(config, mesh: Mesh, rules: dict) -> None:
    """Refuses attention heads that do not divide the mesh axes they are split over.

    Raises:
        UserError: naming the config field, its value and the axis size.
    """
    for name, field in (("heads", "num_heads"), ("kv_heads", "num_kv_heads")):
        size = math.prod(axis_size(mesh, a) for a in rules.get(name, ()))
        value = getattr(config, field)
        if value % size:
            raise UserError(f"{field}={value} does not divide over the "
                             f"{'×'.join(rules[name])} axis of {size} devices; choose a "
                             f"tensor size that divides {value}")


def undivided(specs, abstract, mesh: Mesh, rules: dict) -> list[str]:
    """Parameters with a dimension left whole because it does not divide its mesh axes,
    as 'path: name size over N' lines."""
    out = []
    flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]
    for (path, spec), a in zip(flat, jax.tree.leaves(abstract), strict=True):
        for name, size in zip(dim_names(spec, a.ndim), a.shape, strict=True):
            n = math.prod(axis_size(mesh, x) for x in rules.get(name, ()))
            if n > 1 and size % n:
                out.append(f"{jax.tree_util.keystr(path)}: {name} {size} over {n}")
    return out


def state_specs(boxed_params, make_state: Callable):
    """Logical specs of a whole train state: `make_state(params)` traced on the boxed
    abstract params (`models.axes.boxed_params`), so optimiser moments inherit their
    parameter's names and counters, steps and keys have none (replicated)."""
    return nn.get_partition_spec(jax.eval_shape(make_state, boxed_params))


class Sharded(Wrapper):
    """The train and eval steps under `jax.jit` over a (data, fsdp, tensor, expert) mesh
    (`parallel="sharded"`; see `train.wrapper` for the interface).

    Args:
        train_step, eval_step: from `train.step.Steps.functions(axis=None)` (global batch).
        mesh: from `make_mesh`.
        specs: the train state's logical specs (`state_specs`).
        abstract: the train state's shapes (`jax.eval_shape` of its constructor).
        rules: {logical axis: mesh axes} (`check_rules`).
    """

    def __init__(self, train_step, eval_step, *, mesh: Mesh, specs, abstract, rules: dict):
        self.mesh, self.rules, self.specs, self.abstract = mesh, rules, specs, abstract
        self.state_shardings = shardings(specs, abstract, mesh, rules)
        self.replicated = NamedSharding(mesh, P())
        batch_axes = tuple(a for a in rules.get("batch", ()) if axis_size(mesh, a) > 1)
        self.batch_sharding = NamedSharding(mesh, P(batch_axes or None))
        self.batch_ways = math.prod(mesh.shape[a] for a in batch_axes)
        self._train = jax.jit(train_step, in_shardings=(self.state_shardings, self.batch_sharding),
                              out_shardings=(self.state_shardings, self.replicated),
                              donate_argnums=(0,))
        self._eval = jax.jit(eval_step,
                             in_shardings=(self.state_shardings.eval_params,
                                           self.batch_sharding),
                             out_shardings=self.replicated)

    def init_state(self, make_state: Callable, *args):
        """`make_state(*args)` computed straight into the state's shards: no device ever
        holds more than its part."""
        with sharded_activations(self.mesh, self.rules):
            return jax.jit(make_state, out_shardings=self.state_shardings)(*args)

    def restore_template(self, abstract):
        """The abstract state with its shardings: orbax restores each shard in place."""
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract, self.state_shardings)

    def load_params(self, path: str, **runtime):
        """The directory's parameters, each array put onto its shards as it is read."""
        return models.load(path, mesh=self.mesh, rules=tuple(self.rules.items()),
                           **runtime).params

    def notes(self) -> list[str]:
        """The parameters a dimension of which stays whole (it does not divide its axes)."""
        whole = undivided(self.specs.params, self.abstract.params, self.mesh, self.rules)
        if not whole:
            return []
        shape = {a: n for a, n in self.mesh.shape.items() if a != EXPERT_AXIS or n > 1}
        return [f"mesh {shape}: {len(whole)} parameter(s) kept whole along a "
                f"dimension that does not divide its axes: " + "; ".join(whole[:4])
                + (" ..." if len(whole) > 4 else "")]

    def abstract_inputs(self, abstract, batch_shapes):
        state = self.restore_template(abstract)
        batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.batch_sharding)
                 for k, shape in batch_shapes.items()}
        return state, batch

    def lower(self, state, batch):
        """The train step lowered for `state` and a `put_batch` result (then `.compile()`,
        `.memory_analysis()`), traced as `train_step` traces it: activations split over
        the batch axes (`models.axes.constrain`)."""
        with sharded_activations(self.mesh, self.rules):
            return self._train.lower(state, batch)

    def put_state(self, state):
        """A host (or differently placed) state moved onto its shards."""
        return jax.device_put(state, self.state_shardings)

    def host_state(self, state):
        """The whole state as numpy arrays on every process (a collective with several
        processes: every process must call it)."""
        if jax.process_count() == 1:
            return jax.tree.map(np.asarray, state)
        from jax.experimental import multihost_utils
        return multihost_utils.process_allgather(state, tiled=True)

    def saved_state(self, state):
        """What a checkpoint holds: the sharded arrays themselves (orbax writes each
        process's shards)."""
        return state

    def put_batch(self, batch: dict) -> dict:
        """Per-device rows `[R, B, ...]` (as the pipeline makes them) as one global batch
        `[rows, ...]` split over the batch axes.

        Raises:
            UserError: the global rows do not divide over the batch axes, naming both.
        """
        out = {}
        for k, v in batch.items():
            if isinstance(v, jax.Array) and not v.is_fully_addressable:
                out[k] = v
                continue
            local = np.asarray(v)
            local = local.reshape(-1, *local.shape[2:])
            self.check_rows(local.shape[0] * jax.process_count())
            out[k] = jax.make_array_from_process_local_data(self.batch_sharding, local)
        return out

    def check_rows(self, rows: int) -> None:
        """Refuses a global batch of `rows` that does not divide over the batch axes (data
        × fsdp, × expert with experts)."""
        if rows % self.batch_ways:
            axes = "data × fsdp" + (" × expert" if axis_size(self.mesh, EXPERT_AXIS) > 1
                                    else "")
            raise UserError(f"a batch of {rows} rows does not divide over {axes} "
                             f"= {self.batch_ways} devices")

    def train_step(self, state, batch):
        with sharded_activations(self.mesh, self.rules):
            return self._train(state, self.put_batch(batch))

    def eval_step(self, params, batch):
        with sharded_activations(self.mesh, self.rules):
            return self._eval(params, self.put_batch(batch))

    def metrics(self, metrics) -> dict:
        """Host values of the (replicated) summed metrics."""
        return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), metrics)


def for_model(steps: Steps, tx, *, mesh: Mesh, rules: dict, seed: int = 0,
              base_dtype=None, reference: bool = False) -> Sharded:
    """`steps` (`Steps.functions(axis=None)`) under `Sharded` on `mesh`, the state's
    shardings derived from the params' logical axes.

    Args:
        tx: the optimiser the state is made with (`TrainState.create(params, tx, seed)`;
            an adapted model's frozen base in `base_dtype`; with `reference`, a frozen
            copy of the model beside it).
        rules: {logical axis: mesh axes} (`check_rules`).

    Raises:
        UserError: heads or kv heads that do not divide their mesh axes (naming both).
    """
    model = steps.model
    check_model(model.config, mesh, rules)
    args, method = init_args(model.config)
    boxed = boxed_params(model, *args, method=method)

    def make_state(params):
        return state_lib.TrainState.create(params, tx, seed, base_dtype=base_dtype,
                                           reference=reference)

    specs = state_specs(boxed, make_state)
    abstract = jax.eval_shape(make_state, meta.unbox(boxed))
    train_fn, eval_fn = steps.functions(axis=None)
    return Sharded(train_fn, eval_fn, mesh=mesh, specs=specs, abstract=abstract, rules=rules)
