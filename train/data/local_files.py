"""Local data files read line by line into splits, for the `local_*` builders.

Malformed lines (no tab, more than one tab, an empty side, invalid UTF-8, a blank line) are
skipped and counted in a `BadLines`, with the first file:line locations. Files become
sources, and sources become splits (`_assign_splits`):

    ("all.txt",)                  one source: each line's split by a hash of it, 90/5/5
    ("tr.txt", "te.txt")          train; validation and test both from te.txt
    ("tr.tsv", "va.tsv", "te.tsv")  train, validation, test

A translation source is one `.tsv` file (source TAB target) or two line-aligned files
(`translation_sources`); every other kind reads one file a source. A preference file is
JSON Lines, one `{"prompt": ..., "chosen": ..., "rejected": ...}` object a line
(`read_preference_files`); a chat file JSON Lines of `{"messages": [...]}`
(`read_chat_files`). Classification labels become class names in class order
(`classification_label_names`).

Nothing here needs TFDS: `train.data.builders` turns what these readers return into
prepared datasets.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import re

from models.errors import UserError

MAX_REPORTED_LINES = 20
MAX_INTEGER_LABEL = 100_000     # integer labels name classes 0..max: at most this many + 1
LOCAL_SPLIT_PERCENT = {"train": 90, "validation": 5, "test": 5}


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


def check_data_file(path: str) -> None:
    """Raises unless `path` is a regular file: `FileNotFoundError` or `IsADirectoryError`,
    naming it."""
    if os.path.isdir(path):
        raise IsADirectoryError(f"data file {path!r} is a directory, not a file; give the files "
                                "in it, comma-separated")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file {path!r} does not exist")


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


def file_sources(files: tuple[str, ...] | list[str]) -> list[tuple[str, ...]]:
    """One file a source (text and classification files).

        ("tr.txt", "te.txt") -> [("tr.txt",), ("te.txt",)]

    Raises:
        UserError: not 1 to 3 files.
    """
    check_source_count(len(files))
    return [(f,) for f in files]


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


def split_origins(sources: list[tuple[str, ...]]) -> dict[str, str]:
    """Where each split comes from, in words (for messages), given the sources a local
    builder makes of its files (`LOCAL[name].sources(files)`).

        [("a.txt",)]               -> every split: "'a.txt' (split 90/5/5 by a hash of each line)"
        [("tr.txt",), ("te.txt",)] -> train: "'tr.txt'", validation and test: "'te.txt'"
    """
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



PREFERENCE_FIELDS = ("prompt", "chosen", "rejected")
PROMPT_FIELDS = ("prompt", "answer")


def read_prompt_files(files: tuple[str, ...], bad: BadLines) -> dict[str, list]:
    """(prompt, answer) pairs from JSON Lines files, one object a line with those two
    string fields (any others are for the rewards: `read_prompt_records`), for GRPO; one
    file a source. A line that
    is not such an object, or has an empty prompt or answer, is skipped and counted."""
    sources = [[pair for _, pair in _fields(path, bad, PROMPT_FIELDS)] for path in files]
    return _assign_splits(sources, key=lambda pair: pair[0])


def read_prompt_records(files: tuple[str, ...]) -> dict[str, dict]:
    """Each prompt of JSON Lines prompt files -> its line's whole object (`answer` and any
    other fields a GRPO reward reads), for the lines `read_prompt_files` keeps.

    Raises:
        UserError: one prompt on two lines with different fields, naming both lines (a
            reward could not tell which it scores).
    """
    records, where = {}, {}
    for path in files:
        for number, (prompt, _), record in _fields(path, BadLines(), PROMPT_FIELDS,
                                                   records=True):
            if prompt in records and records[prompt] != record:
                raise UserError(f"{where[prompt]} and {path}:{number} hold the prompt "
                                f"{prompt!r} with different fields: a reward could not tell "
                                "which it scores; give each prompt one line")
            records[prompt], where[prompt] = record, f"{path}:{number}"
    return records


def _fields(path: str, bad: BadLines, fields: tuple[str, ...], *, records: bool = False):
    """(line number, the string values of `fields`) of each JSON object line with them all
    non-empty (and, with `records`, the whole object); the other lines counted in `bad`
    with their reason."""
    for number, line in _lines(path, bad):
        if not line.strip():
            bad.add(path, number, "blank line")
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            bad.add(path, number, "not JSON")
            continue
        if not isinstance(record, dict):
            bad.add(path, number, "not a JSON object")
            continue
        missing = [f for f in fields if f not in record]
        wrong = [f for f in fields if f in record and not isinstance(record[f], str)]
        empty = [f for f in fields if isinstance(record.get(f), str)
                 and not record[f].strip()]
        if missing:
            bad.add(path, number, f"no {missing[0]!r} field")
        elif wrong:
            bad.add(path, number, f"{wrong[0]!r} is not a string")
        elif empty:
            bad.add(path, number, f"empty {empty[0]!r}")
        else:
            values = tuple(record[f] for f in fields)
            yield (number, values, record) if records else (number, values)


def read_preference_files(files: tuple[str, ...], bad: BadLines) -> dict[str, list]:
    """(prompt, chosen, rejected) triples from JSON Lines files, one object a line with
    those three string fields (others are ignored), one file a source (one file is split by
    a hash of the prompt). The texts are kept as written: a response's leading space is
    part of it, as a BPE tokenizer reads it. A line that is not such an object, or has an
    empty prompt or response, or whose two responses are equal, is skipped and counted."""
    sources = [list(_preference_triples(path, bad)) for path in files]
    return _assign_splits(sources, key=lambda triple: triple[0])


def _preference_triples(path: str, bad: BadLines):
    for number, triple in _fields(path, bad, PREFERENCE_FIELDS):
        if triple[1] == triple[2]:
            bad.add(path, number, "chosen equals rejected")
        else:
            yield triple


CHAT_ROLES = ("system", "user", "assistant", "tool")


def read_chat_files(files: tuple[str, ...], bad: BadLines) -> dict[str, list]:
    """Conversations from JSON Lines files, one `{"messages": [{"role": ..., "content":
    ...}, ...]}` object a line (other fields are ignored), kept as the JSON of their
    messages; one file a source (one file is split by a hash of the conversation). A line
    that is not such an object, has a message without a known role (`CHAT_ROLES`) or
    string content, or has no assistant message, is skipped and counted."""
    sources = [list(_conversations(path, bad)) for path in files]
    return _assign_splits(sources, key=lambda conversation: conversation)


def _conversations(path: str, bad: BadLines):
    for number, line in _lines(path, bad):
        if not line.strip():
            bad.add(path, number, "blank line")
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            bad.add(path, number, "not JSON")
            continue
        messages = record.get("messages") if isinstance(record, dict) else None
        if not isinstance(messages, list) or not messages:
            bad.add(path, number, "no 'messages' list")
            continue
        problem = next((p for p in map(_message_problem, messages) if p), None)
        if problem:
            bad.add(path, number, problem)
        elif not any(m["role"] == "assistant" for m in messages):
            bad.add(path, number, "no assistant message")
        else:
            yield json.dumps([{"role": m["role"], "content": m["content"]} for m in messages],
                             ensure_ascii=False)


def _message_problem(message) -> str | None:
    if not isinstance(message, dict):
        return "a message that is not an object"
    if message.get("role") not in CHAT_ROLES:
        return f"a message whose role is not one of {list(CHAT_ROLES)}"
    if not isinstance(message.get("content"), str):
        return "a message whose content is not a string"
    return None
