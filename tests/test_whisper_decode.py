"""Whisper beam search (decode.whisper.transcribe with num_beams) against transformers'
WhisperForConditionalGeneration.generate(num_beams=...), on the tiny random models of
tests/test_pretrained_whisper.py: the same decoder prompts and best-beam tokens, with
languages given and detected, both tasks, the suppressed tokens, each early_stopping rule
and a length penalty, rows that end at different steps.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

import models
from tests import pretrained_helpers as ph
from tests.test_pretrained_whisper import (  # the tiny models and transformers' output
    _ENGLISH,
    _GENERATION,
    CASES,
    _their_output,
    assert_transcribe_refuses,
    random_features,
    random_whisper,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
highest_precision = ph.highest_precision


@pytest.fixture(scope="module")
def speaking(tmp_path_factory):
    """name -> (transformers model, its directory loaded), as in test_pretrained_whisper;
    name_path -> its directory."""
    made = {}
    for name, gen in (("multilingual", _GENERATION), ("english", _ENGLISH)):
        model = random_whisper(CASES["tiny"], seed=0, scale=0.5)
        model.generation_config = transformers.GenerationConfig(**gen)
        path = str(tmp_path_factory.mktemp(name))
        model.save_pretrained(path)
        made[name] = (model, models.load(path))
        made[f"{name}_path"] = path
    return made


def _ours(pre, features, **options) -> tuple[list, list]:
    from decode.whisper import transcribe
    out = transcribe(pre, features, **options)
    return np.asarray(out.prompts).tolist(), [
        row[:n].tolist() for row, n in zip(np.asarray(out.tokens), np.asarray(out.lengths),
                                           strict=True)]


@pytest.mark.parametrize("name, options", [
    ("multilingual", dict(num_beams=3)),                       # languages detected per row
    ("multilingual", dict(num_beams=3, language="fr")),
    ("multilingual", dict(num_beams=3, task="translate", length_penalty=0.3)),
    ("multilingual", dict(num_beams=3, early_stopping=True)),
    ("multilingual", dict(num_beams=3, early_stopping="never", length_penalty=0.5)),
    pytest.param("english", dict(num_beams=4), marks=pytest.mark.slow),   # its own compile
])
def test_beam_transcription_equals_transformers_generate(name, options, speaking,
                                                         highest_precision):
    from decode.whisper import WhisperSettings
    model, pre = speaking[name]
    features = random_features(CASES["tiny"], batch=5, seed=7)
    theirs = _their_output(model, features, **options)
    settings = WhisperSettings.from_generation(pre.generation, pre.config)
    if "early_stopping" in options:
        settings = dataclasses.replace(settings, early_stopping=options.pop("early_stopping"))
    prompts, tokens = _ours(pre, features, settings=settings, **options)
    assert prompts == theirs[0]
    assert tokens == theirs[1]
    assert len({len(row) for row in tokens}) > 1              # rows end at different steps


def test_beam_search_is_not_greedy_and_its_stopping_rule_matters(speaking, highest_precision):
    """The comparisons above are not vacuous: on these rows beam search picks other tokens
    than greedy decoding, and transformers' default stop other tokens than the exact one."""
    from decode.whisper import WhisperSettings
    model, pre = speaking["multilingual"]
    features = random_features(CASES["tiny"], batch=5, seed=7)
    settings = WhisperSettings.from_generation(pre.generation, pre.config)
    greedy = _ours(pre, features, num_beams=1)[1]
    heuristic = _ours(pre, features, num_beams=3, settings=settings)[1]
    exact = _ours(pre, features, num_beams=3,
                  settings=dataclasses.replace(settings, early_stopping="never"))[1]
    assert greedy != heuristic != exact


def test_the_files_num_beams_and_length_penalty_are_its_defaults(speaking, tmp_path,
                                                                 highest_precision):
    model, _ = speaking["multilingual"]
    path = ph.copy_dir(speaking["multilingual_path"], tmp_path / "beams")
    with open(os.path.join(path, "generation_config.json")) as f:
        gen = json.load(f)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({**gen, "num_beams": 3, "length_penalty": 0.5}, f)
    features = random_features(CASES["tiny"], batch=5, seed=7)
    assert _ours(models.load(path), features) == _their_output(
        model, features, num_beams=3, length_penalty=0.5)


@pytest.mark.parametrize("options, words", [
    (dict(num_beams=0), ["num_beams=0", "vocab_size=96"]),
    (dict(num_beams=97), ["num_beams=97"]),
    (dict(num_beams=2, length_penalty=float("nan")), ["length_penalty=nan"]),
])
def test_bad_beam_settings_are_refused_by_name(options, words, speaking):
    assert_transcribe_refuses(speaking["multilingual"][1], options, words)
