"""Datasets by name: the built-in builders and standard TFDS datasets, read as random access.

    ds = load_dataset("toy_translation", data_dir)          # prepares once, then reuses
    ds.kind                      # "translation", "text" or "classification"
    len(ds.splits["train"])      # examples
    ds.example("train", 7)       # ("the dog sees a cat .", "mivgu ku gasgu nu mivpit .")

    ds.data_kind                 # its `train.data.kinds.DataKind`: sides, roles, labels, ...

    cls = load_dataset("toy_classification", data_dir)
    cls.example("train", 7)      # ("some quiet houses plays late .", "ungrammatical")
    cls.label_names              # ("grammatical", "ungrammatical"): class i is label_names[i]
    cls.label_ids("train", [7])  # array([1], dtype=int32)

Every source is a `tfds.data_source` over `array_record` files: TensorFlow is not needed to
read. Two standard datasets (`lm1b`, `tiny_shakespeare`) call `tf.io.gfile` while TFDS
prepares them; preparing those needs the `tfds-prepare` extra, and its absence is an error
that says so.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import logging
import os
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from models.errors import UserError
from train.data import builders, kinds, local_files

log = logging.getLogger(__name__)
FILE_FORMAT = "array_record"
TF_EXTRA = "pip install 'jax-transformer-zoo[tfds-prepare]'"


@dataclasses.dataclass(frozen=True)
class StandardSpec:
    """How a TFDS catalogue dataset maps onto (source, target) or text examples."""
    module: str                           # the TFDS module that registers the builder
    kind: str                             # a `kinds.KINDS` name: "translation" | "text"
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
LOCAL_KINDS = {name: b.kind for name, b in builders.LOCAL.items()}
GENERATED_KINDS = {name: b.kind for name, b in builders.GENERATED.items()}


def available() -> list[str]:
    return sorted([*builders.GENERATED, *builders.LOCAL, *STANDARD])


def dataset_kind(name: str) -> str:
    """The kind (a `kinds.KINDS` name) of dataset `name`, without preparing it.

    Raises:
        UserError: for an unknown name, listing what is available.
    """
    every = {**GENERATED_KINDS, **LOCAL_KINDS, **{n: s.kind for n, s in STANDARD.items()}}
    if name not in every:
        raise UserError(f"unknown dataset {name!r}; available: {', '.join(available())}")
    return every[name]


@dataclasses.dataclass
class Dataset:
    """Random-access splits of one dataset and how to read text out of their examples.

    Attributes:
        name: as asked for.
        kind: the name of its kind in `kinds.KINDS` (`data_kind` is the kind itself):
            "translation" (examples are (source, target)), "text" (one string) or
            "classification" (examples are (text, label name)).
        splits: split name -> a random-access source (`len`, `[i]`) of feature dicts.
        keys: the feature names read, in (source, target), (text,) or (text, label) order.
        bad_lines: malformed lines skipped while preparing local files.
        digest: a SHA-256 (hex) of what the splits hold, in the order `keys` reads them:
            equal for two datasets exactly when they give the same examples (from the files'
            contents for local data; the builder config and version for generated tasks;
            the version and split sizes for TFDS catalogue datasets). "" when unknown (a
            dataset made by hand): such a dataset's tokens are never cached.
        files: (path, SHA-256 of its contents) of each local data file, in order.
        empty_splits: split name -> why it has no examples (a local file too small for a
            90/5/5 split, or a file with no valid lines): asking for it raises that.
        label_names: a classification dataset's class names, in class order, the same for
            every split and fixed when it was prepared: ("0", "1", ..., str(max)) when every
            label is a non-negative integer, else the sorted distinct labels; () for the
            other kinds.
    """
    name: str
    kind: str
    splits: dict[str, Any]
    keys: tuple[str, ...]
    bad_lines: builders.BadLines = dataclasses.field(default_factory=builders.BadLines)
    digest: str = ""
    files: tuple[tuple[str, str], ...] = ()
    empty_splits: dict[str, str] = dataclasses.field(default_factory=dict)
    label_names: tuple[str, ...] = ()

    @property
    def data_kind(self) -> kinds.DataKind:
        """What its kind holds and how the pipeline batches it (`train.data.kinds`)."""
        return kinds.get(self.kind)

    def example(self, split: str, index: int) -> tuple[str, ...]:
        record = self.split(split)[index]
        return tuple(_text(record[k]) for k in self.keys)

    def examples(self, split: str, indices) -> list[tuple[str, ...]]:
        """Many examples in one read (much faster than one at a time)."""
        return [tuple(_text(r[k]) for k in self.keys) for r in self._records(split, indices)]

    def _records(self, split: str, indices) -> list:
        source = self.split(split)
        indices = [int(i) for i in indices]
        if not indices:
            return []
        names = _text_feature_names(source)
        try:    # a text-only source's stored bytes, parsed below; any other decoded by TFDS
            read = (source.data_source if names else source).__getitems__(indices)
        except TypeError:   # tfds.testing.mock_data's sources only read one at a time
            return [source[i] for i in indices]
        if len(read) != len(indices):
            raise IndexError(f"asked {source!r} for {len(indices)} records, got {len(read)}")
        return _text_records(read, names) if names else read

    def label_ids(self, split: str, indices) -> np.ndarray:
        """The class index (into `label_names`) of each example, int32 [len(indices)].

        Raises:
            UserError: the dataset is not a classification dataset.
        """
        if not self.data_kind.labelled:
            raise UserError(f"label_ids needs a classification dataset; {self.name!r} is "
                             f"{self.kind}")
        ids = {name: i for i, name in enumerate(self.label_names)}
        key = self.keys[len(self.data_kind.sides)]
        return np.asarray([ids[_text(r[key])] for r in self._records(split, indices)],
                          np.int32).reshape(-1)

    def split(self, name: str):
        """The random-access source of split `name`.

        Raises:
            UserError: the split is empty (the message names the files and every split's
                example count).
            KeyError: the dataset has no such split.
        """
        if name in self.empty_splits:
            raise UserError(self.empty_splits[name])
        if name not in self.splits:
            raise KeyError(f"dataset {self.name!r} has no split {name!r}; it has "
                           f"{sorted(self.splits)}")
        return self.splits[name]


def _digest(*parts) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def data_digest(dataset: Dataset, tokenizer) -> str:
    """A SHA-256 (hex) of a run's tokens: the dataset's `digest` and the tokenizer's
    `identity`. Equal for two runs exactly when they read the same examples and encode them
    alike; a checkpoint keeps it so that a resumed run can tell (see `data_record`).

    Raises:
        UserError: the dataset has no digest (it was not made by `load_dataset`).
    """
    if not dataset.digest:
        raise UserError(f"dataset {dataset.name!r} has no content digest (make it with "
                         "load_dataset)")
    return _digest(dataset.digest, tokenizer.identity)


def data_record(dataset: Dataset, tokenizer) -> dict:
    """What a checkpoint keeps about its data (JSON-ready), for `data_changes` on resume:

        {"digest": data_digest(...), "dataset": "local_text", "dataset_digest": "9f2c...",
         "tokenizer": "byte", "files": {"/data/book.txt": "41d0..."}}
    """
    return {"digest": data_digest(dataset, tokenizer), "dataset": dataset.name,
            "dataset_digest": dataset.digest, "tokenizer": tokenizer.identity,
            "files": dict(dataset.files)}


def data_changes(saved: dict, current: dict) -> list[str]:
    """How the data of `current` (a `data_record`) differ from `saved`'s, one line each,
    naming the files; [] when they are the same. A file moved or renamed with the same
    contents is the same data.

        ["data file '/data/book.txt' changed (sha256 41d0a9c3e1f2 -> 77be01c2d9a4)"]
    """
    if saved.get("digest") == current["digest"]:
        return []
    out = []
    if saved.get("dataset") != current["dataset"]:
        out.append(f"the dataset was {saved.get('dataset')!r}, now {current['dataset']!r}")
    old, new = saved.get("files") or {}, current["files"]
    for path, digest in new.items():
        if path not in old:
            if digest not in old.values():
                out.append(f"data file {path!r} was not read before")
        elif old[path] != digest:
            out.append(f"data file {path!r} changed (sha256 {old[path][:12]} -> "
                       f"{digest[:12]})")
    for path, digest in old.items():
        if path not in new and digest not in new.values():
            out.append(f"data file {path!r} is no longer read")
    if saved.get("tokenizer") != current["tokenizer"]:
        out.append(f"the tokenizer changed ({str(saved.get('tokenizer'))[:40]} -> "
                   f"{current['tokenizer'][:40]})")
    if not out:
        out.append(f"dataset {current['dataset']!r} changed (digest "
                   f"{str(saved.get('dataset_digest'))[:12]} -> "
                   f"{current['dataset_digest'][:12]})")
    return out


def _text_feature_names(source) -> tuple[str, ...] | None:
    """The names of an array_record source's features when each is a plain `Text` (every
    dataset this project prepares but speech, whose clips are paths too), else None."""
    from tensorflow_datasets.core.data_sources.array_record import ArrayRecordDataSource
    if type(source) is not ArrayRecordDataSource or source.decoders is not None:
        return None
    features = source.dataset_info.features
    if not isinstance(features, tfds.features.FeaturesDict) or not all(
            type(f) is tfds.features.Text for f in features.values()):
        return None
    return tuple(features.keys())


def _text_records(serialized, names: tuple[str, ...]) -> list[dict]:
    """Stored tf.train.Examples of a text-only source as TFDS's decoder returns them
    ({name: bytes}), parsed directly: a fourth of the time of TFDS's general decoder,
    which a run pays for each example it reads (its tokenizer, tokens, labels)."""
    from tensorflow_datasets.proto import tf_example_pb2
    parse = tf_example_pb2.Example.FromString
    records = []
    for record in serialized:
        feature = parse(record).features.feature
        records.append({name: feature[name].bytes_list.value[0] for name in names})
    return records


def _text(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def load_dataset(name: str, data_dir: str | None = None, *, data_files: tuple[str, ...] = (),
                 reverse_translation: bool = False) -> Dataset:
    """Prepares (once) and opens a dataset by name.

    Args:
        name: a generated task (`toy_translation`, `copy`, `reverse`, `sort`, `addition`;
            `toy_classification`, sentences labelled "grammatical" or "ungrammatical";
            `addition_preference`: preference pairs), `local_translation`, `local_text`,
            `local_preference` (JSON Lines pairs) or `local_classification` (TSV lines
            `text TAB label`; with `data_files`), or a standard TFDS name from `STANDARD`.
        data_dir: the TFDS data directory (default: TFDS's, `~/tensorflow_datasets`).
        data_files: paths for the local builders.
        reverse_translation: swap source and target (e.g. wmt14 de-en read as en->de); an
            error for the text and classification kinds.

    Raises:
        UserError: for an unknown name, listing what is available.
        FileNotFoundError: for a missing local file, naming it.
        ImportError: when a dataset needs TensorFlow to prepare and it is not installed.
    """
    data_dir = os.path.expanduser(data_dir) if data_dir else None
    if name in builders.GENERATED:
        builder, splits = _open(name, data_dir)
        config, kind = builder.builder_config, builder.kind
        names = builders.label_names(builder)
        ds = Dataset(name, kind, splits, builder.keys,
                     digest=_digest("generated", name, str(builder.version), config.sizes,
                                    config.seed, *_names_part(kind, names)),
                     label_names=names)
        return _oriented(ds, reverse_translation)
    if name in builders.LOCAL:
        config = builders.local_config(tuple(data_files))
        builder, splits = _open(name, data_dir, config=config)
        kind, names = builder.kind, builders.label_names(builder)
        ds = Dataset(name, kind, splits, builder.keys, builders.bad_lines(builder),
                     digest=_digest("local", name, str(builder.version), config.digest,
                                    *_names_part(kind, names)),
                     files=tuple(zip(config.files, config.file_digests, strict=True)),
                     empty_splits=_empty_splits(name, data_files, splits), label_names=names)
        if ds.bad_lines.total:
            log.warning("%s: %s", name, ds.bad_lines.summary())
        return _oriented(ds, reverse_translation)
    if name in STANDARD:
        spec = STANDARD[name]
        importlib.import_module(spec.module)
        builder, sources = _open(name, data_dir, spec)
        splits = {ours: sources[theirs] for ours, theirs in spec.splits}
        config_name = builder.builder_config.name if builder.builder_config else ""
        ds = Dataset(name, spec.kind, splits, spec.keys,
                     digest=_digest("tfds", name, config_name, str(builder.version),
                                    sorted((k, len(v)) for k, v in sources.items())))
        return _oriented(ds, reverse_translation)
    raise UserError(f"unknown dataset {name!r}; available: {', '.join(available())}")


def _names_part(kind: str, names: tuple[str, ...]) -> tuple:
    """What a labelled (classification) dataset adds to its digest: its label names (the
    other kinds' digests have no such part)."""
    return (("label_names", names),) if kinds.get(kind).labelled else ()


def _empty_splits(name: str, files, splits: dict) -> dict[str, str]:
    """Why each split a local dataset left out (it had no examples) is empty, in words."""
    counts = {s: len(splits[s]) if s in splits else 0 for s in local_files.LOCAL_SPLIT_PERCENT}
    origins = local_files.split_origins(builders.LOCAL[name].sources(tuple(files)))
    sizes = ", ".join(f"{s} {n}" for s, n in counts.items())
    return {s: (f"{name}: split {s!r} has no examples: it comes from {origins[s]}, and the "
                f"splits have {sizes} examples; each split needs at least one (give more "
                "valid lines, or three files: train, validation, test)")
            for s, n in counts.items() if not n}


def _oriented(ds: Dataset, reverse: bool) -> Dataset:
    if not reverse:
        return ds
    if not ds.data_kind.reversible:
        raise UserError(f"reverse_translation needs a translation dataset; {ds.name!r} is "
                         f"{ds.kind}")
    return dataclasses.replace(ds, keys=ds.keys[::-1], digest=_digest(ds.digest, "reversed"))


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
