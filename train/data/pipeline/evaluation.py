"""Evaluation batches: one pass over this process's shard of a split, in order, and the
number of batches every process agrees on.

Every eval step is a collective over all devices of all processes, so every process must
run the same number of them. How many a shard needs depends on its kind: an unchunked
kind's examples are one row each, so the largest shard's example count (from the split's
size, the same in every process) fixes it; a chunked kind's examples (text) are cut into
chunks of the row width, and how many a shard gets depends on its texts:

    shard 0: one 300-token line -> 19 chunks of 16 -> 5 batches of 4 rows
    shard 1: one 11-token line  ->  1 chunk         -> 1 batch, then 4 all-padding ones

When the shards are the processes, they agree on the largest count through a collective
(`_agreed_batches`), and check that they all read the same data.
"""

from __future__ import annotations

import hashlib

import numpy as np

from models.errors import UserError
from models.tokenizer import Tokenizer
from train.data.datasets import Dataset
from train.data.pipeline.arrays import assemble
from train.data.pipeline.config import PipelineConfig, Shard
from train.data.pipeline.lengths import DataStats, select_items
from train.data.pipeline.tokens import check_clips, tokenize_split


def _agreed_batches(needed: int, shard: Shard, dataset: Dataset, tokenizer: Tokenizer,
                    split: str) -> int:
    """`needed`; when the shards are the processes (`shard.is_process`), the largest
    `needed` of all processes: a collective, so every process must call it.

    The processes also compare what they read (the split's size, the dataset's digest and
    the tokenizer's identity): processes with other data would plan other batches, so all of
    them stop with the same error instead.

    Raises:
        UserError: the processes read different data (on every process).
    """
    if not shard.is_process:
        return needed
    from jax.experimental import multihost_utils
    size = len(dataset.split(split))
    digest = hashlib.sha256(repr((dataset.digest, dataset.keys, tokenizer.identity, split,
                                  size)).encode()).digest()
    mine = np.array([needed, size, *np.frombuffer(digest[:8], np.int32)], np.int32)
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, len(mine))
    if np.any(every[:, 1:] != mine[1:]):
        seen = "; ".join(f"process {p}: {row[1]} examples, digest "
                         f"{row[2:].astype(np.int32).tobytes().hex()}"
                         for p, row in enumerate(every))
        raise UserError(f"the processes read different data for split {split!r} of "
                         f"{dataset.name!r} ({seen}); every process must read the same files "
                         "(data_files, data_dir) with the same tokenizer")
    return int(every[:, 0].max())


def eval_batches(dataset: Dataset, tokenizer: Tokenizer, cfg: PipelineConfig, split: str, *,
                 num_devices: int | None = None, shard_index: int | None = None,
                 shard_count: int | None = None, num_batches: int | None = None,
                 cache_dir: str | None = None) -> tuple[list[dict], DataStats]:
    """One pass over this process's shard of a split in order, one item per row, no shuffling.

    Every process gets the same number of batches, the last ones padded with empty rows
    (all zeros) whose `example_index` is -1. Batches carry `example_index` `[R, B]`: each
    row's index in the full split (the reference to score against; a text example cut into
    several chunks gives several rows with its index).

    Shards of an unchunked kind are sized from the split's length alone, so they agree
    unless the processes read different data or have different numbers of local devices.
    When the shards are the processes (`shard_count == jax.process_count() > 1`, the
    default there), they therefore agree on the largest count through a collective, for
    every kind, and check that they all read the same data (an error on every process if
    not; see `_agreed_batches`), so every process must call this; otherwise each shard gets
    the batches it needs unless given `num_batches`.

    Args:
        num_devices / shard_index / shard_count: default to `jax.local_device_count()`,
            `jax.process_index()` and `jax.process_count()`.
        num_batches: the number of batches instead, the same for every shard (at least what
            this shard needs); for several shards batched in one process.
    """
    shard = Shard.of(shard_index, shard_count, num_devices)
    kind = dataset.data_kind
    data = tokenize_split(dataset, split, tokenizer, shard_index=shard.index,
                          shard_count=shard.count, cache_dir=cache_dir,
                          text_role=cfg.text_role, label_names=cfg.label_names,
                          target_prefix=cfg.target_prefix, chat_template=cfg.chat_template)
    check_clips(data, cfg)
    max_lengths = kind.max_lengths(cfg)
    items, stats = select_items(data, kind, max_lengths, cfg.overlong)
    rows_per_batch = shard.devices * cfg.per_device_batch_size
    # Rows to hold: this shard's chunks (a chunked kind); else the largest shard's examples
    # (ceil(N / shard_count), the same in every process).
    rows_needed = (len(items) if kind.chunked
                   else -(-len(dataset.split(split)) // shard.count))
    needed = max(1, -(-rows_needed // rows_per_batch))
    if num_batches is None:
        num_batches = _agreed_batches(needed, shard, dataset, tokenizer, split)
    elif num_batches < needed:
        raise UserError(f"num_batches={num_batches} is fewer than the {needed} batches of "
                         f"{rows_per_batch} rows that shard {shard.index} of {shard.count} "
                         f"needs for its {len(items)} items of split {split!r}")
    batches = []
    for b in range(num_batches):
        rows = [[i] for i in range(b * rows_per_batch, min(len(items), (b + 1) * rows_per_batch))]
        index = np.full(rows_per_batch, -1, np.int32)
        index[:len(rows)] = data.example_ids[items.example[[r[0] for r in rows]]] if rows else []
        rows += [[]] * (rows_per_batch - len(rows))
        batch = assemble(data, items, rows, widths=max_lengths, kind=kind, audio=cfg.audio)
        batch["example_index"] = index
        batches.append({k: v.reshape(shard.devices, -1, *v.shape[1:]) for k, v in batch.items()})
    return batches, stats
