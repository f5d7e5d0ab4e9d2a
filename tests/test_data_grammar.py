"""The generated tasks: hand-checked grammar, determinism, disjoint splits."""

import hashlib

import pytest

from train.data import grammar as g
from train.data.grammar import Clause, NounPhrase, Sentence


def test_toy_translation_follows_the_grammar_on_hand_written_cases():
    dog, cat = g.STEMS["dog"], g.STEMS["cat"]
    assert (g.noun_class("dog"), g.noun_class("cat")) == ("B", "B")
    see, big = g.STEMS["see"], g.STEMS["big"]
    # Subject-object-verb; noun-adjective-determiner; verb agrees in number and tense.
    simple = Sentence((Clause(NounPhrase("the", "dog"), "see", obj=NounPhrase("a", "cat")),))
    assert g.english(simple) == "the dog sees a cat ."
    assert g.target(simple) == f"{dog}u ku {cat}u nu {see}it ."
    negated = Sentence((Clause(NounPhrase("the", "dog", True, ("big",)), "see", "past",
                               NounPhrase("a", "cat"), "quickly", True),))
    assert g.english(negated) == "the big dogs did not see a cat quickly ."
    assert g.target(negated) == (f"{dog}ui {big}oi kui {cat}u nu {g.STEMS['quickly']}i "
                                 f"no{see}ont .")
    # Postpositional phrase in front of its noun; "a" has the plural "some".
    river = g.STEMS["river"]
    assert g.noun_class("river") == "B"
    pp = NounPhrase("a", "dog", True, (), "near", NounPhrase("the", "river"))
    s = Sentence((Clause(pp, "sleep", "present"),
                  Clause(NounPhrase("my", "child"), "sleep", "present", negated=True)), ("but",))
    assert g.english(s) == "some dogs near the river sleep but my child does not sleep ."
    child_cls = g.noun_class("child")
    child = g.STEMS["child"] + g.NOUN_SUFFIX[child_cls, "sg"]
    my = g.DETERMINERS["my"][child_cls][False]
    sleep = g.STEMS["sleep"]
    assert g.target(s) == (f"{river}u ku nera {dog}ui soi {sleep}ant ba {child} {my} "
                           f"no{sleep}it .")
    # Class A agreement: adjectives take -e / -ei, determiners the A forms.
    assert g.noun_class("bird") == "A"
    birds = Sentence((Clause(NounPhrase("this", "bird", True, ("old",)), "run", "past"),))
    assert g.english(birds) == "these old birds ran ."
    assert g.target(birds) == f"{g.STEMS['bird']}ai {g.STEMS['old']}ei tai {g.STEMS['run']}ont ."


def test_invented_words_are_unique_and_the_same_everywhere():
    assert len(set(g.STEMS.values())) == len(g.STEMS)
    digest = hashlib.sha256(repr(sorted(g.STEMS.items())).encode()).hexdigest()[:12]
    assert digest == GOLDEN_STEMS


@pytest.mark.parametrize("task", sorted(g.TASKS))
def test_splits_are_deterministic_disjoint_and_correct(task):
    sizes = {"train": 300, "validation": 50, "test": 50}
    a, b = g.generate_splits(task, sizes), g.generate_splits(task, sizes)
    assert a == b
    sources = [src for split in a.values() for src, _ in split]
    assert len(sources) == len(set(sources)) == 400
    assert g.generate_splits(task, {**sizes, "train": 10})["test"] == a["test"]
    for src, tgt in a["train"]:
        if task == "addition":
            x, y = src.split("+")
            assert int(tgt) == int(x) + int(y)
        elif task == "copy":
            assert tgt == src
        elif task == "reverse":
            assert tgt == src[::-1]
        elif task == "sort":
            assert tgt == "".join(sorted(src))
        else:
            assert src.endswith(" .") and tgt.endswith(" .")
    first = hashlib.sha256(repr(a["train"][:20]).encode()).hexdigest()[:12]
    assert first == GOLDEN_FIRST[task], f"{task} drifted: {first}"


def test_unknown_task_and_exhausted_task_are_errors(monkeypatch):
    with pytest.raises(ValueError, match="unknown generated task 'nope'; available"):
        g.generate_splits("nope", {"train": 1, "validation": 1, "test": 1})
    monkeypatch.setitem(g.TASKS, "coin", lambda draw: (str(draw.chance(0.5)), ""))
    with pytest.raises(ValueError, match="'coin' ran out of distinct examples at 2"):
        g.generate_splits("coin", {"train": 3, "validation": 0, "test": 0})


# Fingerprints of the generated data: a change here changes every built-in dataset.
GOLDEN_STEMS = "7e30c850708f"
GOLDEN_FIRST = {"addition": "b0e5a59dfb4f", "copy": "a48ca39bf330", "reverse": "c4819e4f5ab2",
                "sort": "1fdffe531d06", "toy_translation": "55d877ff8c6e"}
