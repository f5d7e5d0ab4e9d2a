"""The endless training batches: a random-access source that grain iterates.

`source[step]` is a pure function of the seed and the step, so the iterator's state is just
the next step and a resumed run sees exactly the batches an uninterrupted one would have:

    step -> (epoch, batch in epoch) -> rows of items -> this process's rows -> arrays

Epochs may hold different numbers of batches (packing), so a step is located by the
cumulative counts of the epochs planned so far:

    batches per epoch [40, 39, 41]  ->  epoch starts [0, 40, 79]
    step 85  ->  epoch 2, batch 6

Every process plans the same global batches; with `rows = devices x per_device_batch_size`,
process `i` takes rows `[i * rows, (i + 1) * rows)` of each:

    2 processes x 2 devices x 2 rows: global rows 0-7; process 0 rows 0-3, process 1 4-7
"""

from __future__ import annotations

import sys
import threading

import grain
import numpy as np

from models.errors import UserError
from models.tokenizer import Tokenizer
from train.data.datasets import Dataset
from train.data.kinds import DataKind
from train.data.pipeline.arrays import assemble
from train.data.pipeline.config import PipelineConfig, Shard
from train.data.pipeline.epochs import bucket_width, plan_epoch
from train.data.pipeline.lengths import DataStats, Items, select_items
from train.data.pipeline.tokens import TokenizedSplit, check_clips, tokenize_split


class BatchSource:
    """`source[step]` is this process's part of the batch of global step `step` (endless).

    Every process plans the same global batches over the whole split; shard `i` of `n`
    takes rows `[i * rows, (i + 1) * rows)` of each. The processes' rows are disjoint, together
    they are exactly the batch a single process would see, so a multi-host run trains on the
    same data as one host with as many devices.

    Epoch plans are computed on demand and cached; the number of batches per epoch may differ
    between epochs when packing, so step -> (epoch, batch) walks cumulative counts.
    """

    def __init__(self, data: TokenizedSplit, items: Items, kind: DataKind, cfg: PipelineConfig,
                 shard: Shard):
        if len(items) == 0:
            raise UserError("no examples left to batch after the length rules")
        self._data, self._items, self._cfg, self._kind = data, items, cfg, kind
        self._devices = shard.devices
        self._rows = shard.devices * cfg.per_device_batch_size      # this process's rows
        self._shard = shard.index
        self._global_rows = self._rows * shard.count
        self._max = kind.max_lengths(cfg)
        self._lock = threading.Lock()
        self._starts = [0]            # first step of each epoch computed so far
        self._plans: dict[int, list] = {}
        if not self._plan(0):
            raise UserError(f"an epoch has {len(items)} usable examples, fewer than one batch "
                             f"of {self._global_rows} rows ({shard.count} processes x "
                             f"{shard.devices} devices x {cfg.per_device_batch_size})")

    def __len__(self) -> int:
        return sys.maxsize

    def __getstate__(self) -> dict:     # pickled into grain's worker processes
        state = dict(self.__dict__)
        del state["_lock"]
        state["_plans"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _plan(self, epoch: int) -> list:
        with self._lock:
            if epoch not in self._plans:
                if len(self._plans) >= 2:
                    self._plans.pop(min(self._plans))
                self._plans[epoch] = plan_epoch(self._items, self._cfg, self._max,
                                                self._global_rows, epoch)
            return self._plans[epoch]

    def locate(self, step: int) -> tuple[int, int]:
        """(epoch, batch within epoch) of a global step."""
        while True:
            with self._lock:
                starts = list(self._starts)
            e = int(np.searchsorted(starts, step, side="right")) - 1
            if e < len(starts) - 1:
                return e, step - starts[e]
            last = len(starts) - 1
            count = len(self._plan(last))
            if step < starts[last] + count:
                return last, step - starts[last]
            with self._lock:
                if len(self._starts) == last + 1:
                    self._starts.append(starts[last] + count)

    def __getitem__(self, step: int) -> dict:
        epoch, b = self.locate(int(step))
        rows = self._plan(epoch)[b][self._shard * self._rows:(self._shard + 1) * self._rows]
        widths = self._max
        if self._cfg.bucket_boundaries and not self._cfg.packing:
            widths = tuple(bucket_width(max(int(self._items.lengths[s][r[0]]) for r in rows),
                                        self._cfg.bucket_boundaries, m)
                           for s, m in enumerate(self._max))
        batch = assemble(self._data, self._items, rows, widths=widths, kind=self._kind,
                         audio=self._cfg.audio)
        return {k: v.reshape(self._devices, -1, *v.shape[1:]) for k, v in batch.items()}


def _mark_absl_flags_parsed() -> None:
    """grain's worker processes read absl flags; under pytest or a script nobody parsed them."""
    from absl import flags
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def train_iterator(source: BatchSource, cfg: PipelineConfig) -> grain.DatasetIterator:
    """An endless, checkpointable iterator over `source` (`get_state()` / `set_state()`)."""
    ds = grain.MapDataset.source(source).to_iter_dataset(
        grain.ReadOptions(num_threads=cfg.num_threads, prefetch_buffer_size=cfg.prefetch))
    if cfg.worker_count:
        _mark_absl_flags_parsed()
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.worker_count))
    return iter(ds)


def train_source(dataset: Dataset, tokenizer: Tokenizer, cfg: PipelineConfig, *,
                 split: str = "train", num_devices: int | None = None,
                 shard_index: int | None = None, shard_count: int | None = None,
                 cache_dir: str | None = None) -> tuple[BatchSource, DataStats]:
    """The endless training batches of this process, and what the length rules did.

    Shards default to `jax.process_index()` of `jax.process_count()`; devices to
    `jax.local_device_count()`. See `BatchSource` for how processes split each batch.
    """
    shard = Shard.of(shard_index, shard_count, num_devices)
    kind = dataset.data_kind
    data = tokenize_split(dataset, split, tokenizer, cache_dir=cache_dir,
                          text_role=cfg.text_role, label_names=cfg.label_names,
                          target_prefix=cfg.target_prefix, chat_template=cfg.chat_template)
    check_clips(data, cfg)
    items, stats = select_items(data, kind, kind.max_lengths(cfg), cfg.overlong)
    return BatchSource(data, items, kind, cfg, shard), stats
