"""The input pipeline: tokenise, filter, pack or bucket, shuffle, shard, batch; checkpointable.

A split is tokenised once per process (and cached by its contents); after that every batch
is a pure function of `(seed, step)`:

    step -> epoch, batch in epoch -> rows of items -> numpy arrays

so the iterator's state is just the next step, and a resumed run sees exactly the batches an
uninterrupted one would have seen. grain runs that function on prefetch threads (or worker
processes) and checkpoints the position (`iterator.get_state()` / `set_state()`).

Batches are dicts of int32 arrays shaped `[R, B, W]` for `R` local devices and `B` rows per
device. What differs between translation, text and classification data (their sides, the
roles that tokenise them, their row widths, labels, chunking) is asked of the dataset's kind
(`train.data.kinds`), never compared by name here. One module per stage:

    config      PipelineConfig (how examples become batches), Shard (this process's part)
    tokens      tokenise a split's shard into flat arrays, cached by contents
                (tokenize_split, encode_side, label_ids)
    lengths     the length rules: drop empty examples, chunk, drop or truncate long ones
                (select_items, DataStats)
    epochs      which items go in which row of which batch of an epoch: shuffle, pack or
                bucket (plan_epoch, pack_rows)
    arrays      rows of items as arrays: tokens, segmentation, positions, labels (assemble)
    source      the endless training batches that grain iterates (train_source,
                BatchSource, train_iterator)
    evaluation  one in-order pass over a split's shard, the same number of batches on every
                process (eval_batches)
"""

from train.data.pipeline.arrays import assemble
from train.data.pipeline.config import PipelineConfig, Shard
from train.data.pipeline.epochs import pack_rows, plan_epoch
from train.data.pipeline.evaluation import eval_batches
from train.data.pipeline.lengths import DataStats, Items, select_items
from train.data.pipeline.source import BatchSource, train_iterator, train_source
from train.data.pipeline.tokens import (
    TokenizedSplit,
    encode_side,
    label_ids,
    shard_indices,
    tokenize_split,
)

__all__ = [
    "BatchSource", "DataStats", "Items", "PipelineConfig", "Shard", "TokenizedSplit",
    "assemble", "encode_side", "eval_batches", "label_ids", "pack_rows", "plan_epoch",
    "select_items", "shard_indices", "tokenize_split", "train_iterator", "train_source",
]
