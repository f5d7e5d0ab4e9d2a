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


PAIRS = [("the cat sat.", "el gato."), ("a dog ran.", "un perro."), ("the sea.", "el mar."),
         ("a red cat.", "un gato rojo."), ("the dog sat.", "el perro."),
         ("a cat ran to the sea.", "un gato al mar.")] * 4


def _finetune_config(data_dir, path, files, **languages):
    from train import configs
    c = configs.get("finetune_translation")
    c.update(data_dir=data_dir, init_from=path, data_files=",".join(files),
             num_train_steps=2, warmup_steps=1, per_device_batch_size=2,
             eval_per_device_batch_size=4, max_source_length=32, max_target_length=32,
             max_decode_length=8, eval_every_steps=1000, checkpoint_every_steps=1000,
             num_eval_decode=4, num_test_decode=4, **languages)
    return c


@pytest.mark.slow
def test_fine_tuning_with_a_language_pair_encodes_and_exports_as_transformers(
        nllb, data_dir, tmp_path):
    """`source_lang` / `target_lang`: the data is transformers' `tokenizer(source,
    text_target=target)` with src_lang / tgt_lang (each side's language code first, EOS
    last), the decoder reads the start token then the target language's code, and the
    export forces that code first (generation_config.json) and keeps both languages."""
    import json
    import os

    from tests.train_helpers import assert_split_encoded_as
    from train.data import eval_batches, load_dataset
    from train.data.pipeline import PipelineConfig
    from train.objectives import next_token
    from train.trainer import train_and_evaluate
    path, _, tok = nllb
    files = []
    for name, rows in (("train.tsv", PAIRS), ("test.tsv", PAIRS[:6])):
        (tmp_path / name).write_text("".join(f"{s}\t{t}\n" for s, t in rows))
        files.append(str(tmp_path / name))
    workdir = str(tmp_path / "ft")
    out = train_and_evaluate(_finetune_config(data_dir, path, files, source_lang="fra_Latn",
                                              target_lang="spa_Latn"), workdir)
    ours = load_tokenizer(os.path.join(workdir, "tokenizer"))      # what the run encoded with
    tok.src_lang, tok.tgt_lang = "fra_Latn", "spa_Latn"
    ds = load_dataset("local_translation", data_dir, data_files=tuple(files))
    want = assert_split_encoded_as(ds, "validation", ours, tok)
    spanish = tok.convert_tokens_to_ids("spa_Latn")
    assert want["labels"][0][0] == spanish and want["input_ids"][0][0] == (
        tok.convert_tokens_to_ids("fra_Latn"))
    batches, _ = eval_batches(ds, ours, PipelineConfig(per_device_batch_size=4,
                                                       max_source_length=32,
                                                       max_target_length=32),
                              "validation", num_devices=1)
    batch = {k: v[0] for k, v in batches[0].items()}
    dec_in = next_token.shift_right(batch["targets"], batch["targets_position"],
                                    batch["targets_segmentation"], 2)
    assert np.asarray(dec_in)[0, :2].tolist() == [2, spanish]
    with open(os.path.join(out["model"], "generation_config.json")) as f:
        assert json.load(f)["forced_bos_token_id"] == spanish
    with open(os.path.join(out["model"], "tokenizer_config.json")) as f:
        saved = json.load(f)
    assert (saved["src_lang"], saved["tgt_lang"]) == ("fra_Latn", "spa_Latn")


@pytest.mark.parametrize("languages, words", [
    (dict(target_lang="spa_Latin"), ["target_lang", "'spa_Latin'", "202 languages"]),
    (dict(source_lang="english"), ["source_lang", "'english'"]),
])
def test_a_language_the_tokenizer_does_not_name_is_refused_by_key(nllb, data_dir, tmp_path,
                                                                  languages, words):
    from models.errors import UserError
    from train.trainer import train_and_evaluate
    path, _, _ = nllb
    (tmp_path / "train.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in PAIRS))
    config = _finetune_config(data_dir, path, [str(tmp_path / "train.tsv")], **languages)
    with pytest.raises(UserError) as e:
        train_and_evaluate(config, str(tmp_path / "ft"))
    for word in words:
        assert word in str(e.value), (word, str(e.value))


def test_m2m100s_short_codes_name_its_language_tokens(tmp_path):
    """M2M-100's tokenizer (sentencepiece, no tokenizers backend) takes "es" for its token
    __es__: both sides encode as transformers' src_lang / tgt_lang encode them."""
    import json

    import sentencepiece as spm

    from tests.test_finetune import _sentencepiece
    model = _sentencepiece(["the cat sat on a mat", "a dog ran to the sea", "el gato"] * 20)
    (tmp_path / "sentencepiece.bpe.model").write_bytes(model)
    sp = spm.SentencePieceProcessor(model_proto=model)
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for i in range(sp.get_piece_size()):
        vocab.setdefault(sp.id_to_piece(i), len(vocab))
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    tok = transformers.M2M100Tokenizer(str(tmp_path / "vocab.json"),
                                       str(tmp_path / "sentencepiece.bpe.model"),
                                       src_lang="en", tgt_lang="es")
    tok.save_pretrained(str(tmp_path))
    ours = load_tokenizer(str(tmp_path))
    assert len(ours.languages) == 100 and ours.language_id("es") == tok.get_lang_id("es")
    both = ours.for_languages("de", "fr")
    tok.src_lang, tok.tgt_lang = "de", "fr"
    assert both.encode("the cat", add_special_tokens=True) == tok("the cat")["input_ids"]
    assert both.encode("el gato", target=True, add_special_tokens=True) == tok(
        text_target="el gato")["input_ids"]
    assert both.encode("the cat", add_special_tokens=True)[0] == tok.get_lang_id("de")
    with pytest.raises(ValueError, match="'__es__' is not one of the tokenizer's 100"):
        ours.language_id("__es__")
