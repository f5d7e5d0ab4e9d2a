"""The length rules: which tokenised examples become row items, and how long each is.

An item is a start offset and a length into each side's tokens, and the example it comes
from. An example of one token (its EOS alone) is empty and dropped. A chunked kind (text)
cuts every example into chunks of the row width:

    max 4, lengths [10, 1, 3]  ->  items (example, start, length)
                                   (0, 0, 4) (0, 4, 4) (0, 8, 2) (2, 11, 3)   (1 is empty)

Any other kind keeps one item per example; an example longer than its row width on any
side is dropped (`overlong="drop"`) or cut to the width (`"truncate"`; the batch sets its
last token to the end token again, see `arrays.assemble`):

    max (4, 4), side lengths ([3, 6], [2, 2])  ->  drop:     one item (example 0)
                                                   truncate: two, lengths ([3, 4], [2, 2])
"""

from __future__ import annotations

import dataclasses

import numpy as np

from train.data.kinds import DataKind
from train.data.pipeline.tokens import TokenizedSplit


@dataclasses.dataclass
class DataStats:
    """What the length rules did to one shard of a split (each rule counted on its own)."""
    examples: int = 0
    kept: int = 0
    dropped_empty: int = 0
    dropped_too_long: int = 0
    truncated: int = 0
    chunks: int = 0

    def summary(self) -> str:
        parts = [f"{self.kept}/{self.examples} examples kept"]
        for name in ("dropped_empty", "dropped_too_long", "truncated"):
            if getattr(self, name):
                parts.append(f"{getattr(self, name)} {name.replace('_', ' ')}")
        if self.chunks:
            parts.append(f"{self.chunks} chunks")
        return ", ".join(parts)


@dataclasses.dataclass
class Items:
    """Rows to draw from: per side, a start offset and length into the tokens; the example."""
    example: np.ndarray
    starts: tuple[np.ndarray, ...]
    lengths: tuple[np.ndarray, ...]

    def __len__(self) -> int:
        return len(self.example)


def select_items(data: TokenizedSplit, kind: DataKind, max_lengths: tuple[int, ...],
                 overlong: str) -> tuple[Items, DataStats]:
    """Applies the length rules of `kind`: drop empty examples, then chunk long ones (a
    chunked kind) or drop or truncate them (`overlong`)."""
    if kind.chunked:
        return _chunks(data, max_lengths)
    stats = DataStats(examples=len(data))
    lengths = [data.lengths(s) for s in range(len(max_lengths))]
    empty = np.zeros(len(data), bool)
    long = np.zeros(len(data), bool)
    for s, max_len in enumerate(max_lengths):
        empty |= lengths[s] <= 1
        long |= lengths[s] > max_len
    long &= ~empty
    stats.dropped_empty = int(empty.sum())
    if overlong == "drop":
        keep = ~empty & ~long
        stats.dropped_too_long = int(long.sum())
    else:
        keep = ~empty
        stats.truncated = int(long.sum())
    stats.kept = int(keep.sum())
    idx = np.flatnonzero(keep)
    return Items(idx, tuple(data.offsets[s][:-1][idx] for s in range(len(max_lengths))),
                 tuple(np.minimum(lengths[s][idx], m) for s, m in enumerate(max_lengths))), stats


def _chunks(data: TokenizedSplit, max_lengths: tuple[int, ...]) -> tuple[Items, DataStats]:
    """One item per chunk of `max_len` tokens of each non-empty example (one side)."""
    stats = DataStats(examples=len(data))
    starts, lens, example = [], [], []
    (max_len,) = max_lengths
    lengths = data.lengths(0)
    empty = lengths <= 1
    stats.dropped_empty = int(empty.sum())
    for i in np.flatnonzero(~empty):
        for off in range(0, int(lengths[i]), max_len):
            starts.append(data.offsets[0][i] + off)
            lens.append(min(max_len, int(lengths[i]) - off))
            example.append(i)
    stats.kept = len(data) - stats.dropped_empty
    stats.chunks = len(example)
    return Items(np.asarray(example, np.int64), (np.asarray(starts, np.int64),),
                 (np.asarray(lens, np.int64),)), stats
