"""Data: built-in TFDS builders, tokenizers, and the checkpointable input pipeline.

    ds = load_dataset("toy_translation", data_dir)               # array_record, no TensorFlow
    ds.data_kind                  # a DataKind (train.data.kinds): sides, roles, labels, ...
    tok = train_sentencepiece(texts, 1024)                        # or ByteTokenizer()
    cfg = PipelineConfig(per_device_batch_size=32)
    source, stats = train_source(ds, tok, cfg)                    # batches [R, B, W]
    it = train_iterator(source, cfg)                              # it.get_state()/set_state()
    record = data_record(ds, tok)          # kept in checkpoints; data_changes(old, new) on resume

Modules: `datasets` (datasets by name), `kinds` (what differs per dataset kind), `builders`
and `local_files` (the built-in TFDS builders and the files they read), `grammar` (the
generated tasks), `pipeline` (examples to batches), `cache` (the token cache), `tokenizer`
(sentencepiece training).
"""

from models.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    ByteTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    load_tokenizer,
)
from train.data.builders import GENERATED, LOCAL
from train.data.datasets import (
    STANDARD,
    Dataset,
    available,
    data_changes,
    data_digest,
    data_record,
    dataset_kind,
    load_dataset,
)
from train.data.kinds import DataKind
from train.data.local_files import BadLines
from train.data.pipeline import (
    BatchSource,
    DataStats,
    PipelineConfig,
    eval_batches,
    shard_indices,
    tokenize_split,
    train_iterator,
    train_source,
)
from train.data.tokenizer import train_sentencepiece

__all__ = [
    "BOS_ID", "EOS_ID", "GENERATED", "LOCAL", "PAD_ID", "STANDARD", "UNK_ID", "BadLines",
    "BatchSource", "ByteTokenizer", "DataKind", "DataStats", "Dataset", "PipelineConfig",
    "SentencePieceTokenizer", "Tokenizer", "available", "data_changes", "data_digest",
    "data_record", "dataset_kind", "eval_batches", "load_dataset",
    "load_tokenizer", "shard_indices", "tokenize_split", "train_iterator", "train_sentencepiece",
    "train_source",
]
