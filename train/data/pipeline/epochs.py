"""Epoch plans: which row items go in which row of which batch, a pure function of
`(seed, epoch)`.

An epoch shuffles the items with `(seed, epoch)`, then groups them into rows: packed
(first-fit into rows of the row widths), bucketed (sorted by length within windows, one item
a row, batches shuffled), or one item a row in shuffled order. Rows are cut into batches of
`rows_per_batch`; the last incomplete batch is left out (its items come back shuffled into
the next epoch).

First-fit packing with widths (8,) and 2 open rows, items of lengths 5, 3, 4, 2, 6 in
that order:

    0 (5)  opens row A          A [0]      used 5
    1 (3)  fits A               A [0 1]    used 8
    2 (4)  fits nowhere         B [2]      used 4
    3 (2)  fits B               B [2 3]    used 6
    4 (6)  fits nowhere, both rows open: the fullest (A) is closed, C [4] opens
    rows   [[0, 1], [2, 3], [4]]           (closed rows first, then the open ones)
"""

from __future__ import annotations

import numpy as np

from train.data.pipeline.config import PipelineConfig
from train.data.pipeline.lengths import Items


def epoch_rng(seed: int, epoch: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch])


def pack_rows(order: np.ndarray, lengths: tuple[np.ndarray, ...], max_lengths: tuple[int, ...],
              bins: int) -> list[list[int]]:
    """First-fit packing of items (in `order`) into rows, trying at most `bins` open rows.

    When no open row has room, the fullest open row is closed. Rows come out in the order
    they close, then the open ones (see the module docstring).
    """
    rows: list[list[int]] = []
    open_rows: list[list[int]] = []
    used: list[list[int]] = []
    sides = range(len(max_lengths))
    for item in order:
        need = [int(lengths[s][item]) for s in sides]
        for r, u in enumerate(used):
            if all(u[s] + need[s] <= max_lengths[s] for s in sides):
                open_rows[r].append(int(item))
                for s in sides:
                    u[s] += need[s]
                break
        else:
            if len(open_rows) == bins:
                fullest = max(range(bins), key=lambda r: sum(used[r]))
                rows.append(open_rows.pop(fullest))
                used.pop(fullest)
            open_rows.append([int(item)])
            used.append(need)
    return rows + open_rows


def plan_epoch(items: Items, cfg: PipelineConfig, max_lengths: tuple[int, ...],
               rows_per_batch: int, epoch: int) -> list[list[list[int]]]:
    """The batches of one epoch: each a list of `rows_per_batch` rows of item indices.

    The last incomplete batch is left out of this epoch (its items are reshuffled into the
    next). Packing and bucketing only reorder and group; each item appears once per epoch.
    """
    rng = epoch_rng(cfg.seed, epoch)
    order = rng.permutation(len(items))
    if cfg.packing:
        rows = pack_rows(order, items.lengths, max_lengths, cfg.pack_bins)
    elif cfg.bucket_boundaries:
        window = rows_per_batch * 64
        longest = np.max(np.stack(items.lengths), axis=0)
        rows = []
        for w in range(0, len(order), window):
            chunk = order[w:w + window]
            rows += [[int(i)] for i in chunk[np.argsort(longest[chunk], kind="stable")]]
    else:
        rows = [[int(i)] for i in order]
    batches = [rows[b:b + rows_per_batch]
               for b in range(0, len(rows) - rows_per_batch + 1, rows_per_batch)]
    if cfg.bucket_boundaries and not cfg.packing:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


def bucket_width(length: int, boundaries: tuple[int, ...], max_len: int) -> int:
    """The smallest boundary (at most `max_len`) that holds `length`; else `max_len`.

        bucket_width(9, (8, 16), 24) == 16;  bucket_width(20, (8, 16), 24) == 24
    """
    for b in boundaries:
        if length <= b <= max_len:
            return b
    return max_len
