"""TFDS builders that need no network: the generated tasks and local text files.

Each prepares into `array_record` files under a TFDS data directory, once; later runs reuse
them through `tfds.data_source`. TensorFlow is not needed to prepare or to read them.

Local files are read line by line. Malformed lines (no tab, more than one tab, an empty side,
invalid UTF-8) are skipped and counted, and the count with the first file:line locations is
kept in the prepared dataset's metadata (`bad_lines(builder)`), so it is reported every time
the data is used, not only on the run that prepared it.

Classification datasets (`toy_classification`, `local_classification`) hold (`text`,
`label`) strings; their label names, in class order, are fixed when they are prepared and
kept in the same metadata (`label_names(builder)`).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import os
import re

import tensorflow_datasets as tfds
from etils import epath

from models.errors import UserError
from train.data import grammar

MAX_REPORTED_LINES = 20
MAX_INTEGER_LABEL = 100_000     # integer labels name classes 0..max: at most this many + 1
LOCAL_SPLIT_PERCENT = {"train": 90, "validation": 5, "test": 5}


class _Builder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Our builders' common base: their code path is this file.

    TFDS finds a builder's checksums next to its code through `importlib.resources`, which
    fails (NotADirectoryError) for a package installed in editable mode and imported from
    outside the repository, as a notebook does. These builders download nothing.
    """

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls):
        return epath.Path(__file__)


@dataclasses.dataclass
class BadLines:
    """Skipped lines: a count per reason and the first few `file:line: reason` locations."""
    counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    examples: list[str] = dataclasses.field(default_factory=list)

    def add(self, path: str, line_number: int, reason: str) -> None:
        self.counts[reason] += 1
        if len(self.examples) < MAX_REPORTED_LINES:
            self.examples.append(f"{path}:{line_number}: {reason}")

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def as_dict(self) -> dict:
        return {"counts": dict(self.counts), "examples": list(self.examples)}

    def summary(self) -> str:
        if not self.total:
            return "no malformed lines"
        counts = ", ".join(f"{n} {reason}" for reason, n in sorted(self.counts.items()))
        return (f"skipped {self.total} malformed lines ({counts}); first: "
                + "; ".join(self.examples[:5]))


def _text_features(*keys: str) -> tfds.features.FeaturesDict:
    return tfds.features.FeaturesDict({k: tfds.features.Text() for k in keys})


# ---------------------------------------------------------------------------------------------
# Generated tasks.

@dataclasses.dataclass
class GeneratedConfig(tfds.core.BuilderConfig):
    """Split sizes and seed of a generated task; `default` is what training uses."""
    sizes: tuple[tuple[str, int], ...] = (("train", 50_000), ("validation", 1_000),
                                          ("test", 1_000))
    seed: int = 0


class _GeneratedTask(_Builder):
    """A `grammar` task as (`inputs`, `targets`) text pairs in disjoint splits."""

    VERSION = tfds.core.Version("1.0.0")
    BUILDER_CONFIGS = [GeneratedConfig(name="default")]
    task: str
    kind = "translation"        # what `datasets.Dataset.kind` says

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(builder=self, description=self.__doc__,
                                     features=_text_features("inputs", "targets"),
                                     supervised_keys=("inputs", "targets"))

    def _split_generators(self, dl_manager):
        del dl_manager
        splits = grammar.generate_splits(self.task, dict(self.builder_config.sizes),
                                         self.builder_config.seed)
        return {name: self._generate_examples(pairs) for name, pairs in splits.items()}

    def _generate_examples(self, pairs):
        for i, (src, tgt) in enumerate(pairs):
            yield i, {"inputs": src, "targets": tgt}


class _GeneratedClassification(_GeneratedTask):
    """A `grammar` classification task as (`text`, `label`) strings in disjoint splits; its
    label names (`grammar.CLASSIFICATION_LABELS`) are kept in the metadata."""

    kind = "classification"

    def _info(self) -> tfds.core.DatasetInfo:
        metadata = tfds.core.MetadataDict(
            label_names=list(grammar.CLASSIFICATION_LABELS[self.task]))
        return tfds.core.DatasetInfo(builder=self, description=self.__doc__,
                                     features=_text_features("text", "label"),
                                     supervised_keys=("text", "label"), metadata=metadata)

    def _generate_examples(self, pairs):
        for i, (text, label) in enumerate(pairs):
            yield i, {"text": text, "label": label}


class _GeneratedText(_GeneratedTask):
    """The source side of a `grammar` task as plain text (`text`), for language models
    that need no pairs (masked LM); `task` names the pairs it reads."""

    kind = "text"

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(builder=self, description=self.__doc__,
                                     features=_text_features("text"))

    def _generate_examples(self, pairs):
        for i, (text, _) in enumerate(pairs):
            yield i, {"text": text}


def _generated_builder(task: str, doc: str, train_size: int,
                       base: type = _GeneratedTask, name: str | None = None) -> type:
    sizes = (("train", train_size), ("validation", 1_000), ("test", 1_000))
    name = name or task
    return type(f"Generated_{name}", (base,),
                {"name": name, "task": task, "__doc__": doc, "__module__": __name__,
                 "BUILDER_CONFIGS": [GeneratedConfig(name="default", sizes=sizes)]})


GENERATED = {
    "toy_translation": _generated_builder(
        "toy_translation", "English-like sentences into an invented verb-final language.",
        50_000),
    "copy": _generated_builder("copy", "Copy a string of 1-20 letters.", 20_000),
    "reverse": _generated_builder("reverse", "Reverse a string of 1-20 letters.", 20_000),
    "sort": _generated_builder("sort", "Sort the letters of a 1-20 letter string.", 20_000),
    "addition": _generated_builder("addition", "Add two numbers of up to 6 digits.", 20_000),
    "toy_classification": _generated_builder(
        "toy_classification", "English-like sentences labelled grammatical or ungrammatical "
        "(subject-verb number agreement).", 20_000, _GeneratedClassification),
    "toy_text": _generated_builder(
        "toy_translation", "The English-like sentences of toy_translation as plain text.",
        50_000, _GeneratedText, name="toy_text"),
}


# ---------------------------------------------------------------------------------------------
# Local files.

@dataclasses.dataclass
class LocalFilesConfig(tfds.core.BuilderConfig):
    """Paths of local files; the config name is a hash of their contents (see `local_config`).

    Attributes:
        files: the absolute paths, in the order given.
        digest: the SHA-256 of their contents (what the name abbreviates).
        file_digests: the SHA-256 of each file's contents, in the order of `files`.
    """
    files: tuple[str, ...] = ()
    digest: str = dataclasses.field(default="", repr=False)
    file_digests: tuple[str, ...] = dataclasses.field(default=(), repr=False)


def check_data_file(path: str) -> None:
    """Raises unless `path` is a regular file: `FileNotFoundError` or `IsADirectoryError`,
    naming it."""
    if os.path.isdir(path):
        raise IsADirectoryError(f"data file {path!r} is a directory, not a file; give the files "
                                "in it, comma-separated")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file {path!r} does not exist")


def local_config(files: tuple[str, ...] | list[str]) -> LocalFilesConfig:
    """A config named by the SHA-256 of the files' contents, so edits re-prepare.

    Raises:
        FileNotFoundError / IsADirectoryError: naming the first path that is not a file.
    """
    if not files:
        raise UserError("local datasets need data_files: one or more comma-separated paths")
    for path in files:
        check_data_file(path)
    digest, each = hashlib.sha256(), []
    for path in files:
        one = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
                one.update(block)
        digest.update(b"\0")
        each.append(one.hexdigest())
    return LocalFilesConfig(name=f"files_{digest.hexdigest()[:16]}",
                            files=tuple(os.path.abspath(p) for p in files),
                            digest=digest.hexdigest(), file_digests=tuple(each))


def _lines(path: str, bad: BadLines):
    """(line number, text) of each line that is valid UTF-8; the others are counted."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                yield number, raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError:
                bad.add(path, number, "invalid UTF-8")


def _split_of(text: str) -> str:
    """A stable split for a line of a single file, by its hash: 90% / 5% / 5%."""
    bucket = int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big") % 100
    return ("train" if bucket < LOCAL_SPLIT_PERCENT["train"] else
            "validation" if bucket < 100 - LOCAL_SPLIT_PERCENT["test"] else "test")


def _assign_splits(sources: list[list], key) -> dict[str, list]:
    """One source: hash split. Two: train, test (validation = test).
    Three: train/validation/test."""
    if len(sources) == 1:
        out: dict[str, list] = {"train": [], "validation": [], "test": []}
        for item in sources[0]:
            out[_split_of(key(item))].append(item)
        return out
    check_source_count(len(sources))
    if len(sources) == 2:
        return {"train": sources[0], "validation": sources[1], "test": sources[1]}
    return dict(zip(("train", "validation", "test"), sources, strict=True))


def check_source_count(n: int) -> None:
    """Raises unless `n` (files, or file pairs) is 1, 2 or 3 sources."""
    if not 1 <= n <= 3:
        raise UserError(f"got {n} data sources; give 1 (split 90/5/5 by hash), "
                         "2 (train, test) or 3 (train, validation, test)")


def translation_sources(files: tuple[str, ...] | list[str]) -> list[tuple[str, ...]]:
    """How `local_translation` groups its files into sources, from their names alone: each
    `.tsv` path is one source, other paths go two at a time (source file, target file).

        ("a.tsv", "b.en", "b.de") -> [("a.tsv",), ("b.en", "b.de")]

    Raises:
        UserError: a non-`.tsv` path without a partner, or not 1 to 3 sources.
    """
    sources, i = [], 0
    while i < len(files):
        if files[i].endswith(".tsv"):
            sources.append((files[i],))
            i += 1
        else:
            if i + 1 >= len(files) or files[i + 1].endswith(".tsv"):
                raise UserError(f"{files[i]!r} is not a .tsv file, so it needs a line-aligned "
                                 "target file after it (source,target)")
            sources.append((files[i], files[i + 1]))
            i += 2
    check_source_count(len(sources))
    return sources


def split_origins(name: str, files: tuple[str, ...] | list[str]) -> dict[str, str]:
    """Where each split of local dataset `name` comes from, in words (for messages).

        ("a.txt",)                -> every split: "'a.txt' (split 90/5/5 by a hash of each line)"
        ("tr.txt", "te.txt")      -> train: "'tr.txt'", validation and test: "'te.txt'"
    """
    sources = (translation_sources(files) if name == "local_translation"
               else [(f,) for f in files])
    labels = [",".join(s) for s in sources]
    if len(labels) == 1:
        return dict.fromkeys(LOCAL_SPLIT_PERCENT,
                             f"{labels[0]!r} (split 90/5/5 by a hash of each line)")
    if len(labels) == 2:
        return {"train": repr(labels[0]), "validation": repr(labels[1]),
                "test": repr(labels[1])}
    return dict(zip(("train", "validation", "test"), map(repr, labels), strict=True))


def read_translation_files(files: tuple[str, ...], bad: BadLines) -> dict[str, list]:
    """Parallel text from `.tsv` files (source TAB target) or pairs of line-aligned files.

    Each `.tsv` path is one source; other paths are taken two at a time as (source file,
    target file). See `_assign_splits` for how sources become splits.
    """
    sources = [list(_tsv_pairs(s[0], bad)) if len(s) == 1 else list(_aligned_pairs(*s, bad))
               for s in translation_sources(files)]
    return _assign_splits(sources, key=lambda pair: pair[0])


def _tsv_pairs(path: str, bad: BadLines):
    for number, line in _lines(path, bad):
        fields = line.split("\t")
        if len(fields) != 2:
            bad.add(path, number, "no tab" if len(fields) == 1 else "more than one tab")
        elif not fields[0].strip() or not fields[1].strip():
            bad.add(path, number, "empty side")
        else:
            yield fields[0].strip(), fields[1].strip()


def _aligned_pairs(src_path: str, tgt_path: str, bad: BadLines):
    src = dict(_lines(src_path, bad))
    tgt = dict(_lines(tgt_path, bad))
    n_src, n_tgt = _count_lines(src_path), _count_lines(tgt_path)
    if n_src != n_tgt:
        raise UserError(f"line-aligned files differ in length: {src_path!r} has {n_src} "
                         f"lines, {tgt_path!r} has {n_tgt}")
    for number in range(1, n_src + 1):
        if number not in src or number not in tgt:
            continue                                  # counted as invalid UTF-8 already
        s, t = src[number].strip(), tgt[number].strip()
        if not s or not t:
            bad.add(src_path if not s else tgt_path, number, "empty side")
        else:
            yield s, t


def _count_lines(path: str) -> int:
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def read_text_files(files: tuple[str, ...], bad: BadLines) -> dict[str, list]:
    """Non-empty lines of plain-text files, one file a source (blank lines are counted)."""
    sources = []
    for path in files:
        lines = []
        for number, line in _lines(path, bad):
            if line.strip():
                lines.append(line)
            else:
                bad.add(path, number, "blank line")
        sources.append(lines)
    return _assign_splits(sources, key=lambda line: line)


def read_classification_files(files: tuple[str, ...], bad: BadLines) -> dict[str, list]:
    """(text, label) pairs from `.tsv`-style files, one `text TAB label` a line, one file a
    source (see `_assign_splits`; one file is split by a hash of the text). Both sides are
    stripped of surrounding white space."""
    sources = [list(_classification_pairs(path, bad)) for path in files]
    return _assign_splits(sources, key=lambda pair: pair[0])


_DECIMAL = re.compile(r"0|[1-9][0-9]*")     # a non-negative integer, as str(int) writes it


def _classification_pairs(path: str, bad: BadLines):
    for number, line in _lines(path, bad):
        if not line.strip():
            bad.add(path, number, "blank line")
            continue
        fields = line.split("\t")
        if len(fields) != 2:
            bad.add(path, number, "no tab" if len(fields) == 1 else "more than one tab")
            continue
        text, label = fields[0].strip(), fields[1].strip()
        if not text:
            bad.add(path, number, "empty text")
        elif not label:
            bad.add(path, number, "empty label")
        else:
            yield text, label


def classification_label_names(labels) -> tuple[str, ...]:
    """The class names, in class order, of a dataset with these labels (all splits):
    ("0", "1", ..., str(max)) when every label is a non-negative integer in plain decimal
    (class i is the integer i, present or not), else the sorted distinct labels.

        ["2", "0", "2"] -> ("0", "1", "2");  ["neg", "pos", "0"] -> ("0", "neg", "pos");
        ["01", "02"] -> ("01", "02") (not plain decimal: names)

    Raises:
        UserError: integer labels above `MAX_INTEGER_LABEL`.
    """
    distinct = set(labels)
    if distinct and all(_DECIMAL.fullmatch(label) for label in distinct):
        top = max(int(label) for label in distinct)
        if top > MAX_INTEGER_LABEL:
            raise UserError(f"integer label {top} is above {MAX_INTEGER_LABEL}: integer labels "
                             f"name the classes 0..{top}, so this would be {top + 1} classes; "
                             "number the classes from 0, or give them names that are not "
                             "integers")
        return tuple(str(i) for i in range(top + 1))
    return tuple(sorted(distinct))


class _LocalBuilder(_Builder):
    VERSION = tfds.core.Version("1.0.0")
    keys: tuple[str, ...]

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(builder=self, description=self.__doc__,
                                     features=_text_features(*self.keys),
                                     metadata=tfds.core.MetadataDict())

    def _read(self, files, bad):
        raise NotImplementedError

    def _split_generators(self, dl_manager):
        del dl_manager
        bad = BadLines()
        splits = self._read(self.builder_config.files, bad)
        self.info.metadata["bad_lines"] = bad.as_dict()
        if not any(splits.values()):
            raise UserError(f"no valid lines in {list(self.builder_config.files)}: "
                             + bad.summary())
        self._describe(splits)
        # A split with no lines (a tiny file split by hash) is left out, not written empty;
        # `datasets.load_dataset` says so, naming the files, when the split is asked for.
        return {name: self._generate_examples(items) for name, items in splits.items() if items}

    def _describe(self, splits: dict[str, list]) -> None:
        """Adds what the builder kind keeps about its examples to the metadata."""

    def _generate_examples(self, items):
        for i, item in enumerate(items):
            values = item if isinstance(item, tuple) else (item,)
            yield i, dict(zip(self.keys, values, strict=True))


class LocalTranslation(_LocalBuilder):
    """Parallel text from local files (`.tsv`, or source/target line-aligned pairs)."""
    name = "local_translation"
    keys = ("inputs", "targets")
    _read = staticmethod(read_translation_files)


class LocalText(_LocalBuilder):
    """Plain-text lines from local files, for language modelling."""
    name = "local_text"
    keys = ("text",)
    _read = staticmethod(read_text_files)


class LocalClassification(_LocalBuilder):
    """Labelled text from local files, one `text TAB label` a line, for classification."""
    name = "local_classification"
    keys = ("text", "label")
    _read = staticmethod(read_classification_files)

    def _describe(self, splits):
        try:
            names = classification_label_names(label for items in splits.values()
                                               for _, label in items)
        except ValueError as e:
            raise UserError(f"{self.name} {list(self.builder_config.files)}: {e}") from None
        self.info.metadata["label_names"] = list(names)


LOCAL = {"local_translation": LocalTranslation, "local_text": LocalText,
         "local_classification": LocalClassification}


def label_names(builder: tfds.core.DatasetBuilder) -> tuple[str, ...]:
    """The class names saved when a classification dataset was prepared (() otherwise)."""
    return tuple((builder.info.metadata or {}).get("label_names", ()))


def bad_lines(builder: tfds.core.DatasetBuilder) -> BadLines:
    """The malformed-line report saved when a local dataset was prepared (empty otherwise)."""
    saved = (builder.info.metadata or {}).get("bad_lines", {})
    return BadLines(collections.Counter(saved.get("counts", {})), list(saved.get("examples", [])))
