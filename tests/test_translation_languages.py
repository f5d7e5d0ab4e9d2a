"""A translation model's languages by code (`python -m decode --source-lang --target-lang`):
a tiny random NLLB-200 (M2M100ForConditionalGeneration and NLLB's tokenizer with its 202
language codes) translates as transformers' tokenizer (`src_lang`) and `generate`
(`forced_bos_token_id`) translate, text for text; a code the tokenizer does not name, a
tokenizer without languages and two flags naming the first token are refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from decode.__main__ import main
from models.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

SOURCES = ["the cat sat.", "a dog ran to the sea."]
NEW = 6


@pytest.fixture(scope="module")
def nllb(tmp_path_factory):
    """(directory, transformers' model, transformers' tokenizer) of a tiny NLLB-200."""
    chars = list("▁abcdefghijklmnopqrstuvwxyz.")
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3,
             **{c: i + 4 for i, c in enumerate(chars)}}
    tok = transformers.NllbTokenizer(vocab=vocab, merges=[], src_lang="eng_Latn")
    cfg = transformers.M2M100Config(
        vocab_size=len(tok) + 5, d_model=32, encoder_layers=1, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48,
        decoder_ffn_dim=48, max_position_embeddings=64, scale_embedding=True,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
        dropout=0.0, attention_dropout=0.0)
    model = transformers.M2M100ForConditionalGeneration(cfg).eval()
    torch.manual_seed(3)
    with torch.no_grad():
        # Large enough random weights that the output depends on both languages' tokens;
        # the language codes' rows smaller, so that mostly text is generated.
        for name, p in model.named_parameters():
            is_scale = p.ndim == 1 and "norm" in name and "weight" in name
            p.copy_(torch.randn_like(p) * 0.5 + (1.0 if is_scale else 0.0))
        model.model.shared.weight[4 + len(chars):] *= 0.3
    path = str(tmp_path_factory.mktemp("nllb"))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path, model, tok


def _theirs(model, tok, source_lang: str, target_lang: str) -> list[str]:
    tok.src_lang = source_lang
    batch = tok(SOURCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**batch, do_sample=False, num_beams=1, max_new_tokens=NEW,
                             forced_bos_token_id=tok.convert_tokens_to_ids(target_lang))
    return [tok.decode(row, skip_special_tokens=True) for row in out]


@pytest.mark.parametrize("source_lang, target_lang", [("fra_Latn", "spa_Latn"),
                                                      (None, "deu_Latn")])
def test_the_command_line_translates_as_transformers_with_the_codes_given(
        nllb, capsys, source_lang, target_lang):
    path, model, tok = nllb
    flags = ["--source-lang", source_lang] if source_lang else []
    assert main(["--model", path, "--strategy", "greedy", "--max-new-tokens", str(NEW),
                 "--target-lang", target_lang, *flags, *SOURCES]) == 0
    ours = capsys.readouterr().out.splitlines()
    # Without --source-lang, the language the tokenizer was saved with.
    theirs = _theirs(model, tok, source_lang or "eng_Latn", target_lang)
    assert ours == theirs
    # Each language's token changes the translation (so neither could be dropped unseen).
    assert theirs != _theirs(model, tok, "eng_Latn" if source_lang else "fra_Latn",
                             target_lang)
    assert theirs != _theirs(model, tok, source_lang or "eng_Latn", "ita_Latn")


def test_the_source_language_surrounds_the_text_as_transformers_tokenizer_puts_it(nllb):
    path, _, tok = nllb
    ours = load_tokenizer(path)
    assert ours.language_id("spa_Latn") == tok.convert_tokens_to_ids("spa_Latn")
    assert len(ours.languages) == 202 and ours.languages["eng_Latn"] != ours.unk_id
    french = ours.for_source_language("fra_Latn")
    tok.src_lang = "fra_Latn"
    ids = french.encode(SOURCES[0], add_special_tokens=True)
    assert ids == tok(SOURCES[0])["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("fra_Latn") and ids[-1] == 2
    # The tokenizer it came from keeps its own language.
    assert ours.encode(SOURCES[0], add_special_tokens=True)[0] == ours.languages["eng_Latn"]
    np.testing.assert_array_equal(ids[1:], ours.encode(SOURCES[0], add_special_tokens=True)[1:])


@pytest.mark.parametrize("argv, words", [
    (["--target-lang", "spa_Latin"], ["'spa_Latin'", "202", "ace_Arab"]),
    (["--source-lang", "english"], ["'english'", "202"]),
    (["--target-lang", "spa_Latn", "--forced-bos-id", "5"], ["--target-lang",
                                                             "--forced-bos-id"]),
])
def test_bad_language_flags_are_refused_by_name(nllb, capsys, argv, words):
    path, _, _ = nllb
    assert main(["--model", path, *argv, "the cat."]) == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err, (word, err)


def test_a_model_whose_tokenizer_names_no_languages_refuses_a_code(capsys):
    assert main(["--config", "transformer-tiny", "--target-lang", "spa_Latn", "5 6 7"]) == 2
    assert "--forced-bos-id" in capsys.readouterr().err
    assert main(["--config", "gpt-tiny", "--target-lang", "spa_Latn", "5 6 7"]) == 2
    assert "encoder-decoder" in capsys.readouterr().err


def test_the_server_translates_every_request_into_its_target_language(nllb, capsys):
    """`python -m serve --target-lang --source-lang`'s setup (`serve.__main__
    .with_languages`) over the real engine and app: each completion is the command line's
    translation of its prompt."""
    import argparse

    from starlette.testclient import TestClient

    import models
    from serve import server
    from serve.__main__ import with_languages
    from serve.engine import Engine
    from serve.metrics import Metrics
    path, _, _ = nllb
    assert main(["--model", path, "--strategy", "greedy", "--max-new-tokens", str(NEW),
                 "--source-lang", "fra_Latn", "--target-lang", "spa_Latn", *SOURCES]) == 0
    want = capsys.readouterr().out.splitlines()
    pre = with_languages(models.load(path), argparse.Namespace(
        target_lang="spa_Latn", source_lang="fra_Latn"))
    engine = Engine(pre, max_slots=2, page_size=8, prefill_chunk=8, metrics=Metrics())
    engine.start(warmup=False)
    try:
        client = TestClient(server.app(engine, model_name="nllb"))
        for source, text in zip(SOURCES, want, strict=True):
            r = client.post("/v1/completions", json={"model": "nllb", "prompt": source,
                                                     "max_tokens": NEW, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == text
    finally:
        engine.stop(drain=False)
