"""Data parallelism at one call site: `jax.pmap`, or `jax.jit(jax.shard_map(...))`.

Both wrap the same per-device step (`train.step`) and take batches shaped `[R, B, W]` for the
`R` local devices. Under pmap the state is replicated with a leading device axis; under
shard_map it is one replicated global array over a one-axis mesh named "batch". Checkpoints
always hold plain, unreplicated arrays (`host_state`). The interface is `train.wrapper`'s.
Each kind is one object (`Pmap`, `ShardMap`) that wraps the steps and places state and
batches its way, chosen once by name from `KINDS`; `DataParallel` asks it, never its name.

    wrapper = DataParallel("pmap", *Steps(model, objective, schedule).functions())
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import models
from models.errors import UserError
from train.step import AXIS
from train.wrapper import Wrapper


def replicate(tree, devices):
    """A leading device axis, one copy per device (how pmap takes unmapped state).

    The mesh axis is named like pmap's own (`AXIS`): pmap returns its outputs sharded over a
    mesh of that name, and a donated state that came in on a differently named mesh makes
    the second step compile the whole program again.
    """
    sharding = NamedSharding(Mesh(np.asarray(devices), (AXIS,)), P(AXIS))
    return jax.tree.map(
        lambda x: jax.device_put(np.broadcast_to(np.asarray(x), (len(devices), *np.shape(x))),
                                 sharding), tree)


def _first_shard(x) -> np.ndarray:
    """This process's first shard of `x` as numpy (or `x` itself when it is not on a device).

    A copy of one device's buffer, not `x[0]`: indexing would compile and run a gather
    per leaf, and with several processes a computation outside the lock-step order of
    collectives can deadlock.
    """
    if not isinstance(x, jax.Array):
        return np.asarray(x)
    return np.asarray(x.addressable_data(0))


class Pmap:
    """`jax.pmap` over this process's devices: the state replicated with a leading device
    axis `[R, ...]`, batches taken as they come (pmap splits their leading `[R]` axis).

    Attributes:
        mesh: None (pmap names no mesh).
        train, eval: the wrapped per-device steps.
    """

    mesh = None

    def __init__(self, train_step, eval_step):
        self.train = jax.pmap(train_step, axis_name=AXIS, donate_argnums=(0,))
        self.eval = jax.pmap(eval_step, axis_name=AXIS)

    def put_state(self, state):
        return replicate(state, jax.local_devices())

    def put_batch(self, batch: dict) -> dict:
        return batch

    def abstract_state(self, abstract):
        """A leading device axis, split as `replicate` splits it."""
        r = jax.local_device_count()
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct((r, *a.shape), a.dtype,
                                                           sharding=self.batch_sharding),
                            abstract)

    @property
    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(Mesh(np.asarray(jax.local_devices()), (AXIS,)), P(AXIS))

    def first_replica(self, x) -> np.ndarray:
        data = _first_shard(x)
        if isinstance(x, jax.Array) and data.ndim == x.ndim:   # a [1, ...] shard of [R, ...]
            data = data[0]
        return data


class ShardMap:
    """`jax.jit(jax.shard_map(...))` over a one-axis mesh of all devices named like pmap's
    axis: the state one replicated global array, batches one global array split over
    the mesh (each process contributing its rows).

    Attributes:
        mesh: the devices, one axis `AXIS`.
        train, eval: the wrapped per-device steps.
    """

    def __init__(self, train_step, eval_step):
        self.mesh = Mesh(np.asarray(jax.devices()), (AXIS,))
        self._replicated = NamedSharding(self.mesh, P())
        self.batch_sharding = NamedSharding(self.mesh, P(AXIS))

        def squeeze(tree):
            return jax.tree.map(lambda x: x[0], tree)

        self.train = jax.jit(jax.shard_map(
            lambda s, b: train_step(s, squeeze(b)), mesh=self.mesh, in_specs=(P(), P(AXIS)),
            out_specs=(P(), P())), donate_argnums=(0,))
        self.eval = jax.jit(jax.shard_map(
            lambda p, b: eval_step(p, squeeze(b)), mesh=self.mesh, in_specs=(P(), P(AXIS)),
            out_specs=P()))

    def put_state(self, state):
        # From host copies: donation must never delete the caller's arrays.
        return jax.device_put(jax.tree.map(np.asarray, state), self._replicated)

    def put_batch(self, batch: dict) -> dict:
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, v)
                for k, v in batch.items()}

    def abstract_state(self, abstract):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                           sharding=self._replicated),
                            abstract)

    def first_replica(self, x) -> np.ndarray:
        return _first_shard(x)


KINDS = {"pmap": Pmap, "shard_map": ShardMap}
"""The data-parallel kinds by the name `ParallelSettings.parallel` gives them."""


class DataParallel(Wrapper):
    """Puts state and batches on devices and runs the wrapped steps, as its kind does.

    Args:
        kind: a `KINDS` name, "pmap" (default) or "shard_map".
        train_step, eval_step: per-device functions from `train.step.Steps.functions()`.

    Attributes:
        kind: the kind's object (`Pmap` or `ShardMap`), which places and wraps.

    Raises:
        UserError: a kind not in `KINDS`, naming it and the kinds.
    """

    def __init__(self, kind: str, train_step, eval_step):
        if kind not in KINDS:
            raise UserError(f"parallel={kind!r} must be "
                            + " or ".join(repr(name) for name in KINDS))
        self.kind = KINDS[kind](train_step, eval_step)
        self.mesh = self.kind.mesh
        self._train, self._eval = self.kind.train, self.kind.eval

    def init_state(self, make_state, *args):
        return self.put_state(jax.jit(make_state)(*args))

    def load_params(self, path: str, **runtime):
        return models.load(path, **runtime).params

    def put_state(self, state):
        return self.kind.put_state(state)

    def host_state(self, state):
        """Plain numpy arrays, as saved in checkpoints: this process's first replica."""
        return jax.tree.map(self.kind.first_replica, state)

    def saved_state(self, state):
        """What a checkpoint holds: plain host arrays (`host_state`)."""
        return self.host_state(state)

    def put_batch(self, batch: dict):
        return self.kind.put_batch(batch)

    def train_step(self, state, batch):
        return self._train(state, self.put_batch(batch))

    def eval_step(self, params, batch):
        return self._eval(params, self.put_batch(batch))

    def metrics(self, metrics) -> dict:
        """Host values of summed metrics (identical on every device after psum)."""
        return jax.tree.map(self.kind.first_replica, metrics)

    def abstract_inputs(self, abstract, batch_shapes):
        r = jax.local_device_count()
        batch = {k: jax.ShapeDtypeStruct((r, rows // r, w), jnp.int32,
                                         sharding=self.kind.batch_sharding)
                 for k, (rows, w) in batch_shapes.items()}
        return self.kind.abstract_state(abstract), batch

    def lower(self, state, batch):
        return self._train.lower(state, batch)
