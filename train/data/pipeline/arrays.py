"""Rows of items as numpy arrays: tokens, segmentation and positions of each side, and
labels, with the Flax WMT example's names:

    inputs, inputs_segmentation, inputs_position      (translation, classification)
    targets, targets_segmentation, targets_position   (translation, text)
    labels                                            (classification)
    targets_weights                                   (chat: 1 on the assistant's tokens)

(which side is which: `train.data.kinds`). A row holds one item or several packed ones,
numbered 1, 2, ... in its segmentation (0 is padding; masks come from it, never from a
pad id), with positions restarting at 0 for each:

    targets               [a1 a2 EOS b1 EOS  0]
    targets_segmentation  [ 1  1   1  2   2  0]
    targets_position      [ 0  1   2  0   1  0]

A classification example's label (its class index in the run's label order) is written at
the first position of its segment, 0 elsewhere, so packed rows carry one label per example:

    inputs                [CLS a1 a2 SEP CLS b1 SEP  0]
    inputs_segmentation   [ 1   1  1   1   2  2   2  0]
    labels                [ 3   0  0   0   1  0   0  0]    (a is class 3, b class 1)
"""

from __future__ import annotations

import numpy as np

from models.errors import UserError
from train.data.kinds import DataKind
from train.data.pipeline.lengths import Items
from train.data.pipeline.tokens import TokenizedSplit


def assemble(data: TokenizedSplit, items: Items, rows: list[list[int]], *,
             widths: tuple[int, ...], kind: DataKind, audio=None) -> dict:
    """Numpy arrays `[rows, width]` for each side of `kind`: tokens, segmentation and
    positions (an empty row is all zeros). Unless `kind` is chunked, every item's last
    token is set to the split's end id (a truncated example still ends in it). A labelled
    kind's `labels` `[rows, widths[0]]` hold each item's label at its first position. An
    audio kind's `inputs` `[rows, mel, frames]` are each row's clip's features in the
    window of a model with `audio` (`train.data.speech.batch_features`; zeros for an empty
    row); its rows hold one item each.

    Raises:
        UserError: an audio kind without `audio` (the model reads no audio).
    """
    tokens, end_id = data.tokens, None if kind.chunked else data.eos_id
    out = {}
    if kind.audio:
        if audio is None:
            raise UserError(f"{kind.name} data need a model with an audio encoder (a Whisper "
                             "directory as init_from); this model reads tokens")
        from train.data.speech import batch_features
        out["inputs"] = batch_features(
            [data.clips[items.example[row[0]]][0] if row else None for row in rows], audio)
    if kind.labelled:
        lab = np.zeros((len(rows), widths[0]), np.int32)
        for r, row in enumerate(rows):
            col = 0
            for item in row:
                lab[r, col] = data.labels[items.example[item]]
                col += int(items.lengths[0][item])
        out["labels"] = lab
    for s, (name, width) in enumerate(zip(kind.batch_names, widths, strict=True)):
        tok = np.zeros((len(rows), width), np.int32)
        seg = np.zeros((len(rows), width), np.int32)
        pos = np.zeros((len(rows), width), np.int32)
        for r, row in enumerate(rows):
            col = 0
            for k, item in enumerate(row, start=1):
                start, n = int(items.starts[s][item]), int(items.lengths[s][item])
                tok[r, col:col + n] = tokens[s][start:start + n]
                if end_id is not None:
                    tok[r, col + n - 1] = end_id
                seg[r, col:col + n] = k
                pos[r, col:col + n] = np.arange(n)
                col += n
        out[name] = tok
        out[f"{name}_segmentation"] = seg
        out[f"{name}_position"] = pos
        if data.weights is not None and data.weights[s] is not None:
            out[f"{name}_weights"] = _weights(data, items, rows, s, width)
    return out


def _weights(data: TokenizedSplit, items: Items, rows: list[list[int]], s: int,
             width: int) -> np.ndarray:
    """A chat side's scored flags as float32 `[rows, width]`, 0 on padding and on the end
    token a truncated item is given (its text went on)."""
    out = np.zeros((len(rows), width), np.float32)
    full = data.lengths(s)
    for r, row in enumerate(rows):
        col = 0
        for item in row:
            start, n = int(items.starts[s][item]), int(items.lengths[s][item])
            out[r, col:col + n] = data.weights[s][start:start + n]
            if n < full[items.example[item]]:
                out[r, col + n - 1] = 0.0
            col += n
    return out
