"""Data parallelism at one call site: `jax.pmap`, or `jax.jit(jax.shard_map(...))`.

Both wrap the same per-device step (`train.step`) and take batches shaped `[R, B, W]` for the
`R` local devices. Under pmap the state is replicated with a leading device axis; under
shard_map it is one replicated global array over a one-axis mesh named "batch". Checkpoints
always hold plain, unreplicated arrays (`host_state`). The interface is `train.wrapper`'s.

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


class DataParallel(Wrapper):
    """Puts state and batches on devices and runs the wrapped steps.

    Args:
        kind: "pmap" (default) or "shard_map".
        train_step, eval_step: per-device functions from `train.step.Steps.functions()`.
    """

    def __init__(self, kind: str, train_step, eval_step):
        if kind not in ("pmap", "shard_map"):
            raise UserError(f"parallel={kind!r} must be 'pmap' or 'shard_map'")
        self.kind = kind
        if kind == "pmap":
            self._train = jax.pmap(train_step, axis_name=AXIS, donate_argnums=(0,))
            self._eval = jax.pmap(eval_step, axis_name=AXIS)
            return
        self.mesh = Mesh(np.asarray(jax.devices()), (AXIS,))
        self._replicated = NamedSharding(self.mesh, P())
        self._sharded = NamedSharding(self.mesh, P(AXIS))

        def squeeze(tree):
            return jax.tree.map(lambda x: x[0], tree)

        self._train = jax.jit(jax.shard_map(
            lambda s, b: train_step(s, squeeze(b)), mesh=self.mesh, in_specs=(P(), P(AXIS)),
            out_specs=(P(), P())), donate_argnums=(0,))
        self._eval = jax.jit(jax.shard_map(
            lambda p, b: eval_step(p, squeeze(b)), mesh=self.mesh, in_specs=(P(), P(AXIS)),
            out_specs=P()))

    def init_state(self, make_state, *args):
        return self.put_state(jax.jit(make_state)(*args))

    def load_params(self, path: str, **runtime):
        return models.load(path, **runtime).params

    def put_state(self, state):
        if self.kind == "pmap":
            return replicate(state, jax.local_devices())
        # From host copies: donation must never delete the caller's arrays.
        return jax.device_put(jax.tree.map(np.asarray, state), self._replicated)

    def host_state(self, state):
        """Plain numpy arrays, as saved in checkpoints: this process's first replica.

        A copy of one device's buffer, not `x[0]`: indexing would compile and run a gather
        per leaf, and with several processes a computation outside the lock-step order of
        collectives can deadlock.
        """
        return jax.tree.map(self._first_replica, state)

    def saved_state(self, state):
        """What a checkpoint holds: plain host arrays (`host_state`)."""
        return self.host_state(state)

    def put_batch(self, batch: dict):
        if self.kind == "pmap":
            return batch           # pmap shards the leading [R] axis itself
        return {k: jax.make_array_from_process_local_data(self._sharded, v)
                for k, v in batch.items()}

    def train_step(self, state, batch):
        return self._train(state, self.put_batch(batch))

    def eval_step(self, params, batch):
        return self._eval(params, self.put_batch(batch))

    def metrics(self, metrics) -> dict:
        """Host values of summed metrics (identical on every device after psum)."""
        return jax.tree.map(self._first_replica, metrics)

    def abstract_inputs(self, abstract, batch_shapes):
        r = jax.local_device_count()
        if self.kind == "pmap":       # a leading device axis, split as `replicate` splits it
            split = NamedSharding(Mesh(np.asarray(jax.local_devices()), (AXIS,)), P(AXIS))
            batch_sharding = split
            state = jax.tree.map(lambda a: jax.ShapeDtypeStruct((r, *a.shape), a.dtype,
                                                                sharding=split), abstract)
        else:
            batch_sharding = self._sharded
            state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                                sharding=self._replicated),
                                 abstract)
        batch = {k: jax.ShapeDtypeStruct((r, rows // r, w), jnp.int32, sharding=batch_sharding)
                 for k, (rows, w) in batch_shapes.items()}
        return state, batch

    def lower(self, state, batch):
        return self._train.lower(state, batch)

    def _first_replica(self, x) -> np.ndarray:
        """This process's first copy of a replicated array, without the pmap device axis."""
        if not isinstance(x, jax.Array):
            return np.asarray(x)
        data = np.asarray(x.addressable_data(0))
        if self.kind == "pmap" and data.ndim == x.ndim:    # a [1, ...] shard of [R, ...]
            data = data[0]
        return data
