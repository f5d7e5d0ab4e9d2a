"""Datasets by name: the built-in builders and standard TFDS datasets, read as random access.

    ds = load_dataset("toy_translation", data_dir)          # prepares once, then reuses
    ds.kind                      # "translation" or "text"
    len(ds.splits["train"])      # examples
    ds.example("train", 7)       # ("the dog sees a cat .", "mivgu ku gasgu nu mivpit .")

Every source is a `tfds.data_source` over `array_record` files: TensorFlow is not needed to
read. Two standard datasets (`lm1b`, `tiny_shakespeare`) call `tf.io.gfile` while TFDS
prepares them; preparing those needs the `tfds-prepare` extra, and its absence is an error
that says so.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
import os
from typing import Any

import tensorflow_datasets as tfds

from train.data import builders

log = logging.getLogger(__name__)
FILE_FORMAT = "array_record"
TF_EXTRA = "pip install 'jax-transformer-zoo[tfds-prepare]'"


@dataclasses.dataclass(frozen=True)
class StandardSpec:
    """How a TFDS catalogue dataset maps onto (source, target) or text examples."""
    module: str                           # the TFDS module that registers the builder
    kind: str                             # "translation" | "text"
    keys: tuple[str, ...]                 # feature names: (source, target) or (text,)
    splits: tuple[tuple[str, str], ...]   # our split name -> the dataset's split name
    needs_tensorflow_to_prepare: bool = False


_THREE = (("train", "train"), ("validation", "validation"), ("test", "test"))
STANDARD = {
    "wmt14_translate/de-en": StandardSpec("tensorflow_datasets.translate.wmt14", "translation",
                                          ("de", "en"), _THREE),
    "ted_hrlr_translate/pt_to_en": StandardSpec("tensorflow_datasets.translate.ted_hrlr",
                                                "translation", ("pt", "en"), _THREE),
    "lm1b": StandardSpec("tensorflow_datasets.text.lm1b", "text", ("text",),
                         (("train", "train"), ("validation", "test"), ("test", "test")), True),
    "tiny_shakespeare": StandardSpec("tensorflow_datasets.text.tiny_shakespeare", "text",
                                     ("text",), _THREE, True),
}
LOCAL_KINDS = {"local_translation": "translation", "local_text": "text"}


def available() -> list[str]:
    return sorted([*builders.GENERATED, *builders.LOCAL, *STANDARD])


@dataclasses.dataclass
class Dataset:
    """Random-access splits of one dataset and how to read text out of their examples.

    Attributes:
        name: as asked for.
        kind: "translation" (examples are (source, target)) or "text" (one string).
        splits: split name -> a random-access source (`len`, `[i]`) of feature dicts.
        keys: the feature names read, in (source, target) or (text,) order.
        bad_lines: malformed lines skipped while preparing local files.
    """
    name: str
    kind: str
    splits: dict[str, Any]
    keys: tuple[str, ...]
    bad_lines: builders.BadLines = dataclasses.field(default_factory=builders.BadLines)

    def example(self, split: str, index: int) -> tuple[str, ...]:
        record = self.splits[split][index]
        return tuple(_text(record[k]) for k in self.keys)

    def examples(self, split: str, indices) -> list[tuple[str, ...]]:
        """Many examples in one read (much faster than one at a time)."""
        source = self.split(split)
        indices = [int(i) for i in indices]
        try:
            records = source.__getitems__(indices)
        except TypeError:   # tfds.testing.mock_data's sources only read one at a time
            records = [source[i] for i in indices]
        return [tuple(_text(r[k]) for k in self.keys) for r in records]

    def split(self, name: str):
        if name not in self.splits:
            raise KeyError(f"dataset {self.name!r} has no split {name!r}; it has "
                           f"{sorted(self.splits)}")
        return self.splits[name]


def _text(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def load_dataset(name: str, data_dir: str | None = None, *, data_files: tuple[str, ...] = (),
                 reverse_translation: bool = False) -> Dataset:
    """Prepares (once) and opens a dataset by name.

    Args:
        name: a generated task (`toy_translation`, `copy`, `reverse`, `sort`, `addition`),
            `local_translation` or `local_text` (with `data_files`), or a standard TFDS name
            from `STANDARD`.
        data_dir: the TFDS data directory (default: TFDS's, `~/tensorflow_datasets`).
        data_files: paths for the local builders.
        reverse_translation: swap source and target (e.g. wmt14 de-en read as en->de).

    Raises:
        ValueError: for an unknown name, listing what is available.
        FileNotFoundError: for a missing local file, naming it.
        ImportError: when a dataset needs TensorFlow to prepare and it is not installed.
    """
    data_dir = os.path.expanduser(data_dir) if data_dir else None
    if name in builders.GENERATED:
        _, splits = _open(name, data_dir)
        return _oriented(Dataset(name, "translation", splits, ("inputs", "targets")),
                         reverse_translation)
    if name in builders.LOCAL:
        config = builders.local_config(tuple(data_files))
        builder, splits = _open(name, data_dir, config=config)
        ds = Dataset(name, LOCAL_KINDS[name], splits, builder.keys, builders.bad_lines(builder))
        if ds.bad_lines.total:
            log.warning("%s: %s", name, ds.bad_lines.summary())
        return _oriented(ds, reverse_translation)
    if name in STANDARD:
        spec = STANDARD[name]
        importlib.import_module(spec.module)
        _, sources = _open(name, data_dir, spec)
        splits = {ours: sources[theirs] for ours, theirs in spec.splits}
        return _oriented(Dataset(name, spec.kind, splits, spec.keys), reverse_translation)
    raise ValueError(f"unknown dataset {name!r}; available: {', '.join(available())}")


def _oriented(ds: Dataset, reverse: bool) -> Dataset:
    if not reverse:
        return ds
    if ds.kind != "translation":
        raise ValueError(f"reverse_translation needs a translation dataset; {ds.name!r} is "
                         f"{ds.kind}")
    return dataclasses.replace(ds, keys=ds.keys[::-1])


def _tensorflow_available() -> bool:
    return importlib.util.find_spec("tensorflow") is not None


def _open(name: str, data_dir: str | None, spec: StandardSpec | None = None,
          **builder_kwargs) -> tuple[tfds.core.DatasetBuilder, dict]:
    """Prepares `name` once (where possible), then `tfds.data_source` over all its splits."""
    builder_kwargs["file_format"] = FILE_FORMAT
    builder = tfds.builder(name, data_dir=data_dir, **builder_kwargs)
    if not builder.is_prepared():
        if spec is not None and spec.needs_tensorflow_to_prepare and not _tensorflow_available():
            raise ImportError(
                f"dataset {name!r} is not prepared in {builder.data_dir} and TFDS needs "
                f"TensorFlow (tf.io.gfile) to prepare it; install the extra with: {TF_EXTRA} "
                "(reading it afterwards needs no TensorFlow)")
        log.info("preparing %s into %s", name, builder.data_dir)
        builder.download_and_prepare()
    names = ([theirs for _, theirs in spec.splits] if spec is not None
             else list(builder.info.splits))
    return builder, {split: tfds.data_source(name, split=split, data_dir=data_dir,
                                             download=False, builder_kwargs=builder_kwargs)
                     for split in dict.fromkeys(names)}
