"""One interface for the wrappers that run the steps over devices: `train.parallel.
DataParallel` (pmap or shard_map, the state replicated) and `train.sharding.Sharded` (jit
over a (data, fsdp, tensor) mesh, the state in shards). Setup, the loop, evaluation and the
benchmarks use only what `Wrapper` declares, so none of them asks which one it holds:

    wrapper.init_state(make_state, params)     # a fresh state, placed (into its shards)
    wrapper.restore_template(abstract)          # what a checkpoint is restored into
    wrapper.load_params(path, dtype=...)        # init_from's params, placed as they are read
    wrapper.put_state(restored)                 # a host or restored state, placed
    state, metrics = wrapper.train_step(state, batch)     # batch: [R, B, W] per process
    sums = wrapper.eval_step(state.eval_params, batch)
    wrapper.metrics(sums)                       # host numbers
    wrapper.host_state(state), wrapper.saved_state(state)  # for export, for checkpoints
    wrapper.lower(state, batch)                 # the train step lowered (to compile, to
                                                # read its memory)
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import jax
from jax.sharding import Mesh

from models.errors import UserError


class Wrapper(abc.ABC):
    """The steps placed on devices (see the module docstring).

    Attributes:
        mesh: the devices as a mesh (one axis "batch" for shard_map, (data, fsdp, tensor)
            when sharded; None under pmap).
        devices: this process's devices that run the steps.
    """

    mesh: Mesh | None = None

    @property
    def devices(self) -> list:
        return jax.local_devices()

    @abc.abstractmethod
    def init_state(self, make_state: Callable, *args):
        """`make_state(*args)` computed and placed as the steps take it (straight into its
        shards when sharded: no device ever holds more than its part)."""

    def restore_template(self, abstract):
        """The abstract state (`jax.eval_shape` of its constructor) a checkpoint is
        restored into: with the shardings the steps take where the state is sharded."""
        return abstract

    @abc.abstractmethod
    def load_params(self, path: str, **runtime):
        """A model directory's parameters (`models.load(path, **runtime)`), put where the
        steps take them as they are read (onto the mesh when sharded)."""

    @abc.abstractmethod
    def put_state(self, state):
        """A host (or otherwise placed) state, placed as the steps take it."""

    @abc.abstractmethod
    def host_state(self, state):
        """The state as numpy arrays, whole, on this process (a collective when the state
        is split over processes: every process must call it)."""

    @abc.abstractmethod
    def saved_state(self, state):
        """What a checkpoint holds of `state` (plain host arrays, or the shards)."""

    @abc.abstractmethod
    def put_batch(self, batch: dict) -> dict:
        """This process's rows `[R, B, ...]` (as the pipeline makes them), placed as the
        steps take them."""

    def check_rows(self, rows: int) -> None:
        """Refuses a global batch of `rows` that does not divide over the devices that
        split it.

        Raises:
            UserError: naming the rows and the devices.
        """
        n = jax.device_count()
        if rows % n:
            raise UserError(f"a batch of {rows} rows does not divide over the {n} devices")

    @abc.abstractmethod
    def train_step(self, state, batch: dict):
        """(new state, summed metrics on devices) after one update on `batch`."""

    @abc.abstractmethod
    def eval_step(self, params, batch: dict):
        """Summed evaluation metrics on devices."""

    @abc.abstractmethod
    def metrics(self, metrics) -> dict:
        """Host values of summed metrics (identical on every device)."""

    @abc.abstractmethod
    def abstract_inputs(self, abstract, batch_shapes: dict[str, tuple[int, int]]):
        """(state, batch) as `jax.ShapeDtypeStruct`s placed as the train step takes them,
        from the state's abstract shapes and the global batch's {key: (rows, width)}
        (int32): what `lower` needs to compile without allocating."""

    @abc.abstractmethod
    def lower(self, state, batch):
        """The train step lowered for a placed state and batch (or `abstract_inputs`), to
        `.compile()` and read `.memory_analysis()`."""

    def notes(self) -> list[str]:
        """Lines worth printing when the run starts (none by default)."""
        return []
