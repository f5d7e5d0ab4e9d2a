"""Classification data: the toy agreement task, local TSV files, label names and ids."""

import collections
import hashlib

import numpy as np
import pytest

from train import data
from train.data import builders, datasets, grammar as g, local_files

TOY_SIZES = {"train": 20_000, "validation": 1_000, "test": 1_000}
_NOUN_PLURALS = {pl for sg, pl in g.NOUNS if sg != pl}
_SAME_BOTH = {sg for sg, pl in g.NOUNS if sg == pl}          # "fish", "sheep"
_NOUN_FORMS = {form for pair in g.NOUNS for form in pair}
_THIRD = {third for _, third, _ in g.TRANSITIVE_VERBS + g.INTRANSITIVE_VERBS}
_BASE = {base for base, _, _ in g.TRANSITIVE_VERBS + g.INTRANSITIVE_VERBS}


def _numbers(text: str) -> tuple[bool, bool]:
    """(subject plural, main verb plural) read off a toy sentence: `det adjectives noun`,
    then the verb (or does/do not)."""
    words = text.split()
    i = 1 + next(i for i, w in enumerate(words[1:]) if w in _NOUN_FORMS)
    det, noun, verb = words[0], words[i], words[i + 1]
    assert all(w in g.ADJECTIVES for w in words[1:i]), text
    if noun in _SAME_BOTH:
        assert det in ("a", "some", "this", "these"), f"number not visible: {text}"
        subject_plural = det in ("some", "these")
    else:
        subject_plural = noun in _NOUN_PLURALS
    assert verb in _THIRD | _BASE | {"does", "do"}, text
    return subject_plural, verb == "do" or (verb in _BASE and verb not in _THIRD)


@pytest.fixture(scope="module")
def toy(data_dir):
    return data.load_dataset("toy_classification", data_dir)


def _tsv(path, lines: list[str]) -> str:
    path.write_text("".join(f"{line}\n" for line in lines))
    return str(path)


# ---------------------------------------------------------------------------------------------
# The generator.

def test_toy_generator_is_deterministic_disjoint_and_balanced():
    sizes = {"train": 2_000, "validation": 200, "test": 200}
    a = g.generate_splits("toy_classification", sizes)
    assert a == g.generate_splits("toy_classification", sizes)
    assert a != g.generate_splits("toy_classification", sizes, seed=1)
    texts = [text for split in a.values() for text, _ in split]
    assert len(texts) == len(set(texts)) == 2_400
    assert g.generate_splits("toy_classification", {**sizes, "train": 10})["test"] == a["test"]
    for split, examples in a.items():
        counts = collections.Counter(label for _, label in examples)
        assert set(counts) == set(g.CLASSIFICATION_LABELS["toy_classification"])
        assert abs(counts["grammatical"] / len(examples) - 0.5) < 0.05, (split, counts)
    # A fingerprint of the generated data: a change here changes the built-in dataset.
    first = hashlib.sha256(repr(a["train"][:20]).encode()).hexdigest()[:12]
    assert first == GOLDEN_FIRST, f"toy_classification drifted: {first}"


def test_an_ungrammatical_sentence_differs_only_in_the_main_verb():
    draw = g._Draw(0)
    for _ in range(500):
        s = g.sample_agreement_sentence(draw)
        main = s.clauses[0]
        assert main.tense == "present" and main.subject.prep is None
        good, bad = g.english(s).split(), g.english_disagreeing(s).split()
        assert len(good) == len(bad)
        (i,) = [i for i, (x, y) in enumerate(zip(good, bad, strict=True)) if x != y]
        assert i == len(g._english_np(main.subject))              # right after the subject
        base, third, _ = g._VERB_FORMS[main.verb]
        assert {good[i], bad[i]} == ({"does", "do"} if main.negated else {base, third})
        assert _numbers(" ".join(good)) == (main.subject.plural, main.subject.plural)
        assert _numbers(" ".join(bad)) == (main.subject.plural, not main.subject.plural)


def test_only_subject_and_verb_together_tell_the_label(toy):
    """Over every example: the label is exactly agreement; the subject's number alone and
    the verb's number alone are coins in both classes (no one-token shortcut)."""
    seen = collections.Counter()
    for split in TOY_SIZES:
        for text, label in toy.examples(split, range(len(toy.splits[split]))):
            subject, verb = _numbers(text)
            assert (label == "grammatical") == (subject == verb), text
            seen[label, "subject", subject] += 1
            seen[label, "verb", verb] += 1
    for label in ("grammatical", "ungrammatical"):
        for part in ("subject", "verb"):
            n_plural, n_singular = seen[label, part, True], seen[label, part, False]
            assert abs(n_plural / (n_plural + n_singular) - 0.5) < 0.02, (label, part)


# ---------------------------------------------------------------------------------------------
# toy_classification as a dataset.

def test_toy_classification_dataset(toy, data_dir):
    assert {k: len(v) for k, v in toy.splits.items()} == TOY_SIZES
    assert (toy.kind, toy.keys) == ("classification", ("text", "label"))
    assert toy.label_names == ("grammatical", "ungrammatical")
    text, label = toy.example("train", 3)
    assert isinstance(text, str) and text.endswith(" .") and label in toy.label_names
    want = [toy.label_names.index(lab) for _, lab in toy.examples("test", range(1_000))]
    ids = toy.label_ids("test", np.arange(1_000))
    assert ids.dtype == np.int32 and ids.tolist() == want
    assert abs(ids.mean() - 0.5) < 0.05
    assert toy.label_ids("train", []).shape == (0,)
    again = data.load_dataset("toy_classification", data_dir)
    assert (again.label_names, again.digest) == (toy.label_names, toy.digest)
    assert again.example("validation", 9) == toy.example("validation", 9)
    assert "toy_classification" in data.available()
    assert datasets.GENERATED_KINDS["toy_classification"] == "classification"
    assert datasets.GENERATED_KINDS["toy_translation"] == "translation"
    with pytest.raises(ValueError, match="reverse_translation needs a translation dataset; "
                                         "'toy_classification' is classification"):
        data.load_dataset("toy_classification", data_dir, reverse_translation=True)


# ---------------------------------------------------------------------------------------------
# local_classification.

def test_label_names_of_integer_and_named_labels():
    names = builders.classification_label_names
    assert names(["2", "0", "2"]) == ("0", "1", "2")            # 1 is a class, unseen
    assert names(["5"]) == ("0", "1", "2", "3", "4", "5")
    assert names(["pos", "neg", "pos"]) == ("neg", "pos")
    assert names(["neg", "1", "0"]) == ("0", "1", "neg")
    assert names(["01", "2"]) == ("01", "2")                    # "01" is not plain decimal
    assert names(["-1", "0"]) == ("-1", "0")
    assert names(["1.0", "2"]) == ("1.0", "2")


def test_integer_labels_from_three_files(data_dir, tmp_path):
    files = (_tsv(tmp_path / "train.tsv", ["good film\t1", "awful film\t0", "fine\t1"]),
             _tsv(tmp_path / "dev.tsv", ["superb\t4"]),
             _tsv(tmp_path / "test.tsv", ["meh\t0", "bad\t0"]))
    ds = data.load_dataset("local_classification", data_dir, data_files=files)
    assert (ds.kind, ds.keys) == ("classification", ("text", "label"))
    assert ds.label_names == ("0", "1", "2", "3", "4")     # from every split, 2 and 3 unseen
    assert {k: len(v) for k, v in ds.splits.items()} == {"train": 3, "validation": 1, "test": 2}
    assert sorted(ds.examples("train", range(3))) == [
        ("awful film", "0"), ("fine", "1"), ("good film", "1")]
    assert ds.example("validation", 0) == ("superb", "4")
    assert ds.label_ids("validation", [0]).tolist() == [4]
    ids = ds.label_ids("train", [0, 1, 2])
    assert ids.dtype == np.int32
    assert ids.tolist() == [int(label) for _, label in ds.examples("train", [0, 1, 2])]
    assert "local_classification" in data.available()
    assert datasets.LOCAL_KINDS["local_classification"] == "classification"


def test_one_file_is_split_by_a_hash_of_the_text_and_names_are_sorted(data_dir, tmp_path):
    lines = [f"sentence number {i}\t{('neutral', 'positive', 'negative')[i % 3]}"
             for i in range(200)]
    path = _tsv(tmp_path / "all.tsv", lines)
    ds = data.load_dataset("local_classification", data_dir, data_files=(path,))
    assert ds.label_names == ("negative", "neutral", "positive")
    want = collections.Counter(local_files._split_of(line.split("\t")[0]) for line in lines)
    assert {k: len(v) for k, v in ds.splits.items()} == dict(want)
    assert min(want.values()) > 0 and want["train"] > 150
    for split in ds.splits:
        for text, label in ds.examples(split, range(len(ds.splits[split]))):
            assert local_files._split_of(text) == split and f"{text}\t{label}" in lines
    ids = ds.label_ids("test", range(len(ds.splits["test"])))
    assert [ds.label_names[i] for i in ids] == [lab for _, lab in
                                                ds.examples("test", range(len(ids)))]


def test_bad_lines_are_skipped_and_counted_with_their_place(data_dir, tmp_path):
    train = tmp_path / "train.tsv"
    train.write_bytes(b"a fine line\tpos\n"                # 1 ok
                      b"no tab here\n"                      # 2 no tab
                      b"\tneg\n"                            # 3 empty text
                      b"text only\t  \n"                    # 4 empty label
                      b"\n"                                 # 5 blank line
                      b"a\tb\tc\n"                          # 6 more than one tab
                      b"bad \xff bytes\tneg\n"              # 7 invalid UTF-8
                      b"   \n"                              # 8 blank line
                      b"  spaced out  \t neg \r\n")         # 9 ok, stripped
    test = _tsv(tmp_path / "test.tsv", ["one\tpos", "two"])
    files = (str(train), test)                              # two files: train, test = validation
    ds = data.load_dataset("local_classification", data_dir, data_files=files)
    assert sorted(ds.examples("train", range(len(ds.splits["train"])))) == [
        ("a fine line", "pos"), ("spaced out", "neg")]
    assert ds.example("test", 0) == ("one", "pos") and len(ds.splits["test"]) == 1
    assert ds.label_names == ("neg", "pos")
    assert ds.example("validation", 0) == ("one", "pos")
    assert ds.bad_lines.counts == {"no tab": 2, "empty text": 1, "empty label": 1,
                                   "blank line": 2, "more than one tab": 1,
                                   "invalid UTF-8": 1}
    assert ds.bad_lines.examples == [
        f"{train}:2: no tab", f"{train}:3: empty text", f"{train}:4: empty label",
        f"{train}:5: blank line", f"{train}:6: more than one tab", f"{train}:7: invalid UTF-8",
        f"{train}:8: blank line", f"{test}:2: no tab"]


def test_a_reopened_dataset_reads_its_names_and_examples_from_the_prepared_files(
        data_dir, tmp_path, monkeypatch):
    path = _tsv(tmp_path / "a.tsv", [f"text {i}\t{i % 4 * 2}" for i in range(60)])
    ds = data.load_dataset("local_classification", data_dir, data_files=(path,))
    assert ds.label_names == ("0", "1", "2", "3", "4", "5", "6")
    # Reopening prepares nothing and computes no names: they come from the saved metadata.
    monkeypatch.setattr(builders, "classification_label_names", None)
    monkeypatch.setattr(builders.LocalClassification, "_read", None)
    again = data.load_dataset("local_classification", data_dir, data_files=(path,))
    assert (again.label_names, again.digest, again.bad_lines) == (
        ds.label_names, ds.digest, ds.bad_lines)
    n = len(ds.splits["train"])
    assert again.examples("train", range(n)) == ds.examples("train", range(n))
    assert again.label_ids("train", range(n)).tolist() == ds.label_ids("train", range(n)).tolist()
    monkeypatch.undo()
    # The digest follows the contents (and so the names): one label changed, a new digest.
    edited = _tsv(tmp_path / "b.tsv", [f"text {i}\t{i % 4 * 2 if i else 9}" for i in range(60)])
    other = data.load_dataset("local_classification", data_dir, data_files=(edited,))
    assert other.label_names == tuple(map(str, range(10))) and other.digest != ds.digest


def test_other_kinds_have_no_label_names_and_no_label_ids(data_dir, tmp_path):
    book = _tsv(tmp_path / "book.txt", [f"line {i}" for i in range(40)])
    text = data.load_dataset("local_text", data_dir, data_files=(book,))
    assert text.label_names == ()
    with pytest.raises(ValueError, match="label_ids needs a classification dataset; "
                                         "'local_text' is text"):
        text.label_ids("train", [0])
    path = _tsv(tmp_path / "a.tsv", ["x\ty"] * 30)
    with pytest.raises(ValueError, match="reverse_translation needs a translation dataset"):
        data.load_dataset("local_classification", data_dir, data_files=(path,),
                          reverse_translation=True)


def test_errors_name_the_files(data_dir, tmp_path):
    big = _tsv(tmp_path / "years.tsv", ["a\t1999", "b\t2024", "c\t20240101"])
    with pytest.raises(ValueError) as e:
        data.load_dataset("local_classification", data_dir, data_files=(big,))
    assert str(e.value) == (
        f"local_classification [{big!r}]: integer label 20240101 is above 100000: integer "
        "labels name the classes 0..20240101, so this would be 20240102 classes; number the "
        "classes from 0, or give them names that are not integers")
    junk = _tsv(tmp_path / "junk.tsv", ["no tab", ""])
    with pytest.raises(ValueError, match=r"no valid lines in \[.*junk.tsv'\]: skipped 2 "
                                         r"malformed lines \(1 blank line, 1 no tab\)"):
        data.load_dataset("local_classification", data_dir, data_files=(junk,))
    files = [_tsv(tmp_path / n, lines) for n, lines in
             (("tr.tsv", ["a\t0", "b\t1"]), ("va.tsv", ["\t0"]), ("te.tsv", ["c\t1"]))]
    ds = data.load_dataset("local_classification", data_dir, data_files=tuple(files))
    with pytest.raises(ValueError, match=f"local_classification: split 'validation' has no "
                                         f"examples: it comes from '{files[1]}'"):
        ds.label_ids("validation", [0])


GOLDEN_FIRST = "f800f098ed85"
