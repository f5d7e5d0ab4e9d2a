"""TFDS builders that need no network: the generated tasks and local text files.

Each prepares into `array_record` files under a TFDS data directory, once; later runs reuse
them through `tfds.data_source`. TensorFlow is not needed to prepare or to read them.

Every builder names its dataset kind (`kind`, a `train.data.kinds` name), and its features
are that kind's `keys`:

    GENERATED["toy_translation"].kind    # "translation": features ("inputs", "targets")
    LOCAL["local_classification"].kind   # "classification": features ("text", "label")

Local files are read by `train.data.local_files`. Its count of malformed lines, with the
first file:line locations, is kept in the prepared dataset's metadata (`bad_lines(builder)`),
so it is reported every time the data is used, not only on the run that prepared it.
Classification datasets (`toy_classification`, `local_classification`) hold (`text`,
`label`) strings; their label names, in class order, are fixed when they are prepared and
kept in the same metadata (`label_names(builder)`).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import os

import tensorflow_datasets as tfds
from etils import epath

from models.errors import UserError
from train.data import grammar, kinds
from train.data.local_files import (
    BadLines,
    check_data_file,
    check_source_count,
    classification_label_names,
    file_sources,
    read_chat_files,
    read_classification_files,
    read_preference_files,
    read_prompt_files,
    read_text_files,
    read_translation_files,
    translation_sources,
)

__all__ = ["GENERATED", "LOCAL", "BadLines", "GeneratedConfig", "LocalFilesConfig",
           "bad_lines", "check_source_count", "classification_label_names", "label_names",
           "local_config", "translation_sources"]


class _Builder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Our builders' common base: their code path is this file, their features their kind's.

    TFDS finds a builder's checksums next to its code through `importlib.resources`, which
    fails (NotADirectoryError) for a package installed in editable mode and imported from
    outside the repository, as a notebook does. These builders download nothing.
    """

    kind: str                   # a `kinds.KINDS` name: what `datasets.Dataset.kind` says

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls):
        return epath.Path(__file__)

    @property
    def keys(self) -> tuple[str, ...]:
        """The feature names of an example: its kind's `keys`."""
        return kinds.get(self.kind).keys


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
    kind = "translation"

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(builder=self, description=self.__doc__,
                                     features=_text_features(*self.keys),
                                     supervised_keys=self.keys)

    def _split_generators(self, dl_manager):
        del dl_manager
        splits = grammar.generate_splits(self.task, dict(self.builder_config.sizes),
                                         self.builder_config.seed)
        return {name: self._generate_examples(pairs) for name, pairs in splits.items()}

    def _generate_examples(self, pairs):
        """Each pair's first `len(keys)` strings under the kind's feature names."""
        for i, pair in enumerate(pairs):
            yield i, dict(zip(self.keys, pair[:len(self.keys)], strict=True))


class _GeneratedClassification(_GeneratedTask):
    """A `grammar` classification task as (`text`, `label`) strings in disjoint splits; its
    label names (`grammar.CLASSIFICATION_LABELS`) are kept in the metadata."""

    kind = "classification"

    def _info(self) -> tfds.core.DatasetInfo:
        metadata = tfds.core.MetadataDict(
            label_names=list(grammar.CLASSIFICATION_LABELS[self.task]))
        return tfds.core.DatasetInfo(builder=self, description=self.__doc__,
                                     features=_text_features(*self.keys),
                                     supervised_keys=self.keys, metadata=metadata)


class _GeneratedText(_GeneratedTask):
    """The source side of a `grammar` task as plain text (`text`), for language models
    that need no pairs (masked LM); `task` names the pairs it reads."""

    kind = "text"

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(builder=self, description=self.__doc__,
                                     features=_text_features(*self.keys))


class _GeneratedPreference(_GeneratedTask):
    """A `grammar` preference task as (`prompt`, `chosen`, `rejected`) strings in disjoint
    splits."""

    kind = "preference"

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(builder=self, description=self.__doc__,
                                     features=_text_features(*self.keys))


class _GeneratedPrompts(_GeneratedTask):
    """A `grammar` prompt task as (`prompt`, `answer`) strings in disjoint splits."""

    kind = "prompts"

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(builder=self, description=self.__doc__,
                                     features=_text_features(*self.keys))


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
    "addition_preference": _generated_builder(
        "addition_preference", "'a+b=' with its sum preferred to the sum with one digit "
        "changed (numbers of up to 6 digits).", 20_000, _GeneratedPreference),
    "addition_prompts": _generated_builder(
        "addition_prompts", "'a+b=' and its sum, the answer a GRPO reward checks (numbers of "
        "up to 6 digits).", 20_000, _GeneratedPrompts),
}



# ---------------------------------------------------------------------------------------------
# Local files.

@dataclasses.dataclass
class LocalFilesConfig(tfds.core.BuilderConfig):
    """Paths of local files; the config name hashes their places and contents (`local_config`).

    Attributes:
        files: the absolute paths, in the order given.
        digest: the SHA-256 of their contents (what the name abbreviates).
        file_digests: the SHA-256 of each file's contents, in the order of `files`.
    """
    files: tuple[str, ...] = ()
    digest: str = dataclasses.field(default="", repr=False)
    file_digests: tuple[str, ...] = dataclasses.field(default=(), repr=False)


def local_config(files: tuple[str, ...] | list[str]) -> LocalFilesConfig:
    """A config named by the SHA-256 of the files' absolute paths and contents, so an edit
    re-prepares, and so does the same file elsewhere: a speech example holds the absolute
    path of its clip and its `file:line`, which a copy in another folder
    must not inherit from the first one prepared. `digest` hashes the contents alone (a moved
    file keeps the dataset's digest).

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
    where = tuple(os.path.abspath(p) for p in files)
    name = hashlib.sha256(repr((where, digest.hexdigest())).encode()).hexdigest()[:16]
    return LocalFilesConfig(name=f"files_{name}", files=where,
                            digest=digest.hexdigest(), file_digests=tuple(each))


class _LocalBuilder(_Builder):
    """A dataset read from local files (`data_files`) by `_read`, split as the files say
    (`train.data.local_files`)."""

    VERSION = tfds.core.Version("1.0.0")

    @staticmethod
    def sources(files: tuple[str, ...] | list[str]) -> list[tuple[str, ...]]:
        """How the files group into sources (one per split, or one split 90/5/5 by hash).

        Raises:
            UserError: not 1 to 3 sources (or, for translation, an unpaired file).
        """
        return file_sources(files)

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
    kind = "translation"
    sources = staticmethod(translation_sources)
    _read = staticmethod(read_translation_files)


class LocalText(_LocalBuilder):
    """Plain-text lines from local files, for language modelling."""
    name = "local_text"
    kind = "text"
    _read = staticmethod(read_text_files)


class LocalClassification(_LocalBuilder):
    """Labelled text from local files, one `text TAB label` a line, for classification."""
    name = "local_classification"
    kind = "classification"
    _read = staticmethod(read_classification_files)

    def _describe(self, splits):
        try:
            names = classification_label_names(label for items in splits.values()
                                               for _, label in items)
        except ValueError as e:
            raise UserError(f"{self.name} {list(self.builder_config.files)}: {e}") from None
        self.info.metadata["label_names"] = list(names)


class LocalSpeech(_LocalBuilder):
    """Transcribed audio from local `.tsv` files, one `audio_path TAB transcript` a line
    (`train.data.speech`: a bad line or clip is an error naming its file and line)."""
    name = "local_speech"
    kind = "speech"

    @staticmethod
    def _read(files, bad):
        from train.data.speech import read_speech_files
        return read_speech_files(files, bad)


class LocalPreference(_LocalBuilder):
    """Preference pairs from local JSON Lines files, one `{"prompt", "chosen", "rejected"}`
    object a line, for preference training (`train.objectives.preference`)."""
    name = "local_preference"
    kind = "preference"
    _read = staticmethod(read_preference_files)


class LocalChat(_LocalBuilder):
    """Conversations from local JSON Lines files, one `{"messages": [...]}` object a line,
    for chat fine-tuning in the model's own template (`finetune_chat`)."""
    name = "local_chat"
    kind = "chat"
    _read = staticmethod(read_chat_files)


class LocalPrompts(_LocalBuilder):
    """Prompts and their answers from local JSON Lines files, one `{"prompt", "answer"}`
    object a line, for GRPO (`train.objectives.grpo`)."""
    name = "local_prompts"
    kind = "prompts"
    _read = staticmethod(read_prompt_files)


LOCAL = {"local_translation": LocalTranslation, "local_text": LocalText,
         "local_classification": LocalClassification, "local_speech": LocalSpeech,
         "local_preference": LocalPreference, "local_chat": LocalChat,
         "local_prompts": LocalPrompts}


def label_names(builder: tfds.core.DatasetBuilder) -> tuple[str, ...]:
    """The class names saved when a classification dataset was prepared (() otherwise)."""
    return tuple((builder.info.metadata or {}).get("label_names", ()))


def bad_lines(builder: tfds.core.DatasetBuilder) -> BadLines:
    """The malformed-line report saved when a local dataset was prepared (empty otherwise)."""
    saved = (builder.info.metadata or {}).get("bad_lines", {})
    return BadLines(collections.Counter(saved.get("counts", {})), list(saved.get("examples", [])))
