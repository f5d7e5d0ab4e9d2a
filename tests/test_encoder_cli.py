"""Encoder-only models from Python and from the command line (decode/encoder.py,
`python -m decode --fill-mask / --classify`).

1. Against transformers: tiny random BERT and RoBERTa checkpoints (ENCODER_CASES in
   tests/pretrained_helpers.py) with a WordPiece tokenizer written here: `fill_mask` gives
   torch's top-k ids and the softmax of its logits at the mask positions (the whole sorted
   distribution with top_k = V), `classify` its softmax over the labels, and the text
   helpers the same tokens and labels.
2. Invariants: a row's fillers do not depend on its batch or padding; `fill_mask` runs
   inside a user's `jax.jit`.
3. The command line end to end on directories saved by `models.save` with
   `ByteTokenizer(mask=True, add_bos=True, add_eos=True)`: the one-line formats, stdin and
   blank lines, and every mistake (exit 2, one `error:` line that names it).
"""

from __future__ import annotations

import io
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import decode
import decode.__main__ as decode_cli
import models
from decode import encoder_cli
from models.tokenizer import ByteTokenizer
from tests import pretrained_helpers as ph
from tests.pretrained_helpers import copy_dir, torch, transformers

encoder_ckpt, highest_precision = ph.encoder_ckpt, ph.highest_precision   # shared fixtures

ATOL = 1e-5

# ---------------------------------------------------------------------------------------------
# 1. Against transformers.

# The specials first, so that RoBERTa's ids are its config's (bos 0 = [CLS], pad 1 = [PAD],
# eos 2 = [SEP]): its position ids count the tokens that are not its pad id. BERT's forward
# pass reads no special id.
SPECIALS = ["[CLS]", "[PAD]", "[SEP]", "[UNK]", "[MASK]"]
WORDS = ("the cat sat on mat a dog ran to park . , and is was big small red blue house tree "
         "bird fish ate saw in of it he she we they old new sun moon sky sea day night rain "
         "snow hot cold fast slow up down left right one two three").split()
TEXTS = ["the cat sat on the [MASK] .", "a [MASK] dog ran to the [MASK] in the rain"]
CLASSIFY_TEXTS = ["the sun is hot", "a cold night , snow and rain", "sky"]


def _with_wordpiece_tokenizer(path: str, dst) -> tuple[str, object]:
    """A copy of the checkpoint directory with a BERT WordPiece tokenizer of exactly its
    vocab_size entries (the specials, words, then filler words w0, w1, ...)."""
    path = copy_dir(path, dst)
    vocab_size = models.load(path).config.vocab_size
    vocab = (SPECIALS + WORDS + [f"w{i}" for i in range(vocab_size)])[:vocab_size]
    assert len(set(vocab)) == vocab_size
    with open(os.path.join(path, "vocab.txt"), "w") as f:      # read as a BERT vocab.txt
        f.write("\n".join(vocab) + "\n")
    tok = transformers.BertTokenizerFast.from_pretrained(path, do_lower_case=True)
    assert len(tok) == vocab_size and tok.mask_token_id == SPECIALS.index("[MASK]")
    tok.save_pretrained(path)
    return path, tok


def _torch_probs(model, hf_tok, texts):
    """transformers' probabilities (softmax of its fp32 logits), its input ids and its
    attention mask, on the tokenizer's padded batch."""
    batch = hf_tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       token_type_ids=batch["token_type_ids"]).logits.float()
    return (torch.softmax(logits, dim=-1).numpy(), batch["input_ids"].numpy(),
            batch["attention_mask"].numpy())


@pytest.mark.parametrize("name", ["bert-mlm", "roberta-mlm"])
def test_fill_mask_gives_transformers_top_k_and_probabilities_at_the_masks(
        name, encoder_ckpt, highest_precision, tmp_path):
    c = encoder_ckpt(name)
    path, hf_tok = _with_wordpiece_tokenizer(c.path, tmp_path / name)
    pre = models.load(path)
    V = pre.config.vocab_size
    assert pre.tokenizer.mask_token == "[MASK]" and pre.tokenizer.mask_id == 4
    theirs, hf_ids, hf_mask = _torch_probs(c.model, hf_tok, TEXTS)
    lists = [pre.tokenizer.encode(t, add_special_tokens=True) for t in TEXTS]
    for b, ids in enumerate(lists):       # the same inputs: [CLS] ... [SEP]
        assert ids == hf_ids[b, :hf_mask[b].sum()].tolist()
        assert ids[0] == SPECIALS.index("[CLS]") and ids[-1] == SPECIALS.index("[SEP]")
    tokens, lengths = decode.pad_prompts(lists, pad_id=pre.config.pad_id)
    at_mask = tokens == pre.tokenizer.mask_id                  # 3 masks: 1 + 2
    their_at_mask = theirs[hf_ids == pre.tokenizer.mask_id]    # [3, V], row by row
    assert at_mask.sum() == 3 and their_at_mask.shape == (3, V)

    top = decode.fill_mask(pre.model, pre.params, tokens, lengths, top_k=5)
    assert top.ids.shape == top.probs.shape == (*tokens.shape, 5)
    assert top.ids.dtype == jnp.int32 and top.probs.dtype == jnp.float32
    want_ids = np.argsort(-their_at_mask, axis=-1, kind="stable")[:, :5]
    np.testing.assert_array_equal(np.asarray(top.ids)[at_mask], want_ids)
    np.testing.assert_allclose(np.asarray(top.probs)[at_mask],
                               np.take_along_axis(their_at_mask, want_ids, -1), atol=ATOL, rtol=0)

    # top_k = V: the whole distribution, sorted; put back in id order it is torch's.
    full = decode.fill_mask(pre.model, pre.params, tokens, lengths, top_k=V)
    ours = np.zeros((3, V), np.float32)
    np.put_along_axis(ours, np.asarray(full.ids)[at_mask], np.asarray(full.probs)[at_mask], -1)
    np.testing.assert_allclose(ours, their_at_mask, atol=ATOL, rtol=0)
    np.testing.assert_allclose(ours.sum(-1), 1.0, atol=1e-5)
    print(f"{name}: max |p - transformers' p| = {np.abs(ours - their_at_mask).max():.1e}")

    # Text in, the tokens' strings out: the same fillers, per text and per mask.
    got = decode.fill_mask_text(pre, TEXTS, top_k=3)
    assert [len(masks) for masks in got] == [1, 2]
    flat = [fillers for masks in got for fillers in masks]
    for m, fillers in enumerate(flat):
        assert [t for t, _ in fillers] == hf_tok.convert_ids_to_tokens(want_ids[m, :3].tolist())
        np.testing.assert_allclose([p for _, p in fillers],
                                   np.sort(their_at_mask[m])[::-1][:3], atol=ATOL, rtol=0)


def test_classify_gives_transformers_softmax_and_label_names(
        encoder_ckpt, highest_precision, tmp_path):
    c = encoder_ckpt("bert-classifier-gelu-new")
    path, hf_tok = _with_wordpiece_tokenizer(c.path, tmp_path / "cls")
    pre = models.load(path)
    theirs, hf_ids, hf_mask = _torch_probs(c.model, hf_tok, CLASSIFY_TEXTS)
    tokens, lengths = decode.pad_prompts(
        [pre.tokenizer.encode(t, add_special_tokens=True) for t in CLASSIFY_TEXTS])
    probs = decode.classify(pre.model, pre.params, tokens, lengths)
    assert probs.shape == (3, 3) and probs.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(probs), theirs, atol=ATOL, rtol=0)
    got = decode.classify_text(pre, CLASSIFY_TEXTS)
    names = ("neg", "neutral", "pos")
    for row, result in zip(theirs, got, strict=True):
        assert result.label == names[int(row.argmax())]
        assert result.probability == pytest.approx(float(row.max()), abs=ATOL)
        assert list(result.distribution) == list(names)
        np.testing.assert_allclose(list(result.distribution.values()), row, atol=ATOL)


# ---------------------------------------------------------------------------------------------
# 2. Tiny models of the project's own, saved with the byte tokenizer and its mask.

SMALL = dict(vocab_size=261, d_model=32, num_heads=2, mlp_dim=64, num_layers=2, max_len=64)
BYTES = ByteTokenizer(mask=True, add_bos=True, add_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Model directories: "mlm" (masked LM), "cls" (labels neg, pos), "nomask" (a tokenizer
    without a mask token), "notok" and "cls-notok" (no tokenizer files)."""
    root = tmp_path_factory.mktemp("encoders")
    cfg = models.get_config("bert-tiny", **SMALL)
    dummy = jnp.full((1, 4), 7, jnp.int32)
    params = models.build(cfg).init(jax.random.key(0), dummy)["params"]
    cls_cfg = cfg.replace(num_labels=2, label_names=("neg", "pos"))
    cls_params = models.build(cls_cfg).init(jax.random.key(1), dummy, method="classify")
    out = {name: str(root / name) for name in ("mlm", "cls", "nomask", "notok", "cls-notok")}
    models.save(out["mlm"], cfg, params, BYTES)
    models.save(out["cls"], cls_cfg, cls_params["params"], BYTES)
    models.save(out["nomask"], cfg, params, ByteTokenizer(add_bos=True, add_eos=True))
    models.save(out["notok"], cfg, params)
    models.save(out["cls-notok"], cls_cfg, cls_params["params"])
    return out


def test_a_rows_fillers_do_not_depend_on_its_batch_and_fill_mask_runs_in_your_jit(dirs):
    pre = models.load(dirs["mlm"])
    texts = ["[MASK]", "a much longer text with a [MASK] in it and [MASK] here", "x [MASK] y"]
    together = decode.fill_mask_text(pre, texts, top_k=4)
    alone = [decode.fill_mask_text(pre, [t], top_k=4)[0] for t in texts]
    for a, b in zip(together, alone, strict=True):
        assert [[t for t, _ in f] for f in a] == [[t for t, _ in f] for f in b]
        np.testing.assert_allclose([[p for _, p in f] for f in a],
                                   [[p for _, p in f] for f in b], atol=1e-6)
    lists = [BYTES.encode(t, add_special_tokens=True) for t in texts]
    tokens, lengths = decode.pad_prompts(lists)
    eager = decode.fill_mask(pre.model, pre.params, tokens, lengths, top_k=4)
    mine = jax.jit(lambda p, t, n: decode.fill_mask(pre.model, p, t, n, top_k=4))(
        pre.params, tokens, lengths)
    np.testing.assert_array_equal(mine.ids, eager.ids)
    np.testing.assert_allclose(mine.probs, eager.probs, atol=1e-6)
    assert np.all(np.diff(np.asarray(eager.probs), axis=-1) <= 0)     # best first


def test_python_errors_name_the_value_and_the_limit(dirs):
    mlm, cls = models.load(dirs["mlm"]), models.load(dirs["cls"])
    tokens, lengths = decode.pad_prompts([[2, 260, 1]])
    with pytest.raises(ValueError, match=r"num_labels=2: neg, pos\): use decode.classify"):
        decode.fill_mask(cls.model, cls.params, tokens, lengths)
    with pytest.raises(ValueError, match=r"masked-LM head \(num_labels=0\): use decode.fill"):
        decode.classify(mlm.model, mlm.params, tokens, lengths)
    for k in (0, 262):
        with pytest.raises(ValueError, match=rf"top_k={k} must be an int in \[1, vocab_size=261"):
            decode.fill_mask(mlm.model, mlm.params, tokens, lengths, top_k=k)
    long = np.full((1, 65), 9, np.int32)
    with pytest.raises(ValueError, match="tokens has length 65, beyond the limit 64"):
        decode.fill_mask(mlm.model, mlm.params, long, np.array([65], np.int32))
    with pytest.raises(ValueError, match=r"lengths\[0\]=9 must be in \[1, padded width 8\]"):
        decode.fill_mask(mlm.model, mlm.params, tokens, np.array([9], np.int32))
    with pytest.raises(ValueError, match=r"texts\[1\] 'no mask' has no mask token '\[MASK\]'"):
        decode.fill_mask_text(mlm, ["a [MASK]", "no mask"])
    with pytest.raises(ValueError, match=r"texts\[0\] is 73 tokens long \(special tokens "
                                         r"included\); the model takes at most 64 \(max_len\)"):
        decode.fill_mask_text(mlm, ["a" * 70 + "[MASK]"])
    with pytest.raises(ValueError, match="the tokenizer of this model has no mask token; "
                                         "fill-mask needs one"):
        decode.fill_mask_text(models.load(dirs["nomask"]), ["a [MASK]"])
    with pytest.raises(ValueError, match="this model has no tokenizer"):
        decode.classify_text(models.load(dirs["cls-notok"]), ["x"])
    gpt = models.build(models.get_config("gpt-tiny"))
    with pytest.raises(ValueError, match="fill-mask needs an encoder-only model .* this one "
                                         "is decoder_only"):
        decode.fill_mask(gpt, {}, tokens, lengths)
    for generate in (decode.generate, decode.beam_search):     # refused, as before
        with pytest.raises(ValueError, match="an encoder-only model does not generate"):
            generate(mlm.model, mlm.params, tokens, lengths, max_new_tokens=2)


# ---------------------------------------------------------------------------------------------
# 3. The command line.

FILLER = r"(?:[^\s']\S*|'[^']*'|\"[^\"]*\") \d\.\d{4}"


def _segment(m: int, k: int) -> str:
    return rf"\[MASK\]{m}: {FILLER}(?: \| {FILLER}){{{k - 1}}}"


def _out_lines(capsys, args) -> list[str]:
    assert decode_cli.main(args) == 0
    return capsys.readouterr().out.rstrip("\n").split("\n")


def test_cli_fill_mask_prints_one_line_per_input_with_every_masks_fillers(dirs, capsys):
    texts = ["The cat sat on the [MASK] .", "a [MASK] and a [MASK]"]
    lines = _out_lines(capsys, ["--model", dirs["mlm"], "--fill-mask", *texts])
    assert len(lines) == 2
    assert re.fullmatch(_segment(1, 5), lines[0]), lines[0]
    assert re.fullmatch(_segment(1, 5) + "; " + _segment(2, 5), lines[1]), lines[1]
    # The numbers are fill_mask_text's, rounded; best first.
    want = decode.fill_mask_text(models.load(dirs["mlm"]), texts, top_k=5)
    for line, masks in zip(lines, want, strict=True):
        for segment, fillers in zip(line.split("; "), masks, strict=True):
            shown = [f.rsplit(" ", 1) for f in segment.split(": ", 1)[1].split(" | ")]
            assert [float(p) for _, p in shown] == [round(p, 4) for _, p in fillers]
            assert [t for t, _ in shown] == [encoder_cli.shown_token(t) for t, _ in fillers]
    lines = _out_lines(capsys, ["--model", dirs["mlm"], "--fill-mask", "--top-k", "2",
                                texts[1]])
    assert re.fullmatch(_segment(1, 2) + "; " + _segment(2, 2), lines[0]), lines


def test_cli_fill_mask_and_classify_read_stdin_and_keep_blank_lines(dirs, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("a [MASK]\n\n[MASK] b [MASK]\n"))
    lines = _out_lines(capsys, ["--model", dirs["mlm"], "--fill-mask", "--top-k", "1",
                                "--batch-size", "1"])
    assert len(lines) == 3 and lines[1] == ""
    assert re.fullmatch(_segment(1, 1), lines[0])
    assert re.fullmatch(_segment(1, 1) + "; " + _segment(2, 1), lines[2])
    monkeypatch.setattr(sys, "stdin", io.StringIO("a fine film\n\ndull\n"))
    lines = _out_lines(capsys, ["--model", dirs["cls"], "--classify"])
    want = decode.classify_text(models.load(dirs["cls"]), ["a fine film", "dull"])
    assert lines == [f"{want[0].label}\t{want[0].probability:.4f}", "",
                     f"{want[1].label}\t{want[1].probability:.4f}"]
    assert all(w.label in ("neg", "pos") and w.probability >= 0.5 for w in want)


def test_cli_classify_prints_label_tab_probability(dirs, capsys):
    lines = _out_lines(capsys, ["--model", dirs["cls"], "--classify", "a sentence", "b"])
    assert len(lines) == 2
    for line in lines:
        label, p = line.split("\t")
        assert label in ("neg", "pos") and 0.5 <= float(p) <= 1 and re.fullmatch(r"\d\.\d{4}", p)
    # A directory without tokenizer files takes token ids, as generation does.
    lines = _out_lines(capsys, ["--model", dirs["cls-notok"], "--classify", "2 9 1"])
    assert lines[0].split("\t")[0] in ("neg", "pos")


def test_shown_fillers_stay_one_unambiguous_word():
    assert encoder_cli.shown_token("mat") == "mat"
    assert [encoder_cli.shown_token(t) for t in (" ", "", "|", ";", "a b", "\x17")] == [
        "' '", "''", "'|'", "';'", "'a b'", "'\\x17'"]
    assert encoder_cli.fillers_line("<mask>", [[("mat", 0.41234), ("|", 0.2)], [(".", 0.9)]]) \
        == "<mask>1: mat 0.4123 | '|' 0.2000; <mask>2: . 0.9000"


def _cli_error(capsys, args) -> str:
    assert decode_cli.main(args) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert err[-1].startswith("error: ") and captured.out == "", err
    return err[-1]


def test_cli_errors_exit_2_and_name_the_mistake(dirs, capsys):
    mlm, cls = dirs["mlm"], dirs["cls"]
    assert f"the tokenizer of {dirs['nomask']} has no mask token; fill-mask needs one" in \
        _cli_error(capsys, ["--model", dirs["nomask"], "--fill-mask", "a [MASK]"])
    assert f"{dirs['notok']} has no tokenizer; fill-mask needs one with a mask token" in \
        _cli_error(capsys, ["--model", dirs["notok"], "--fill-mask", "2 260 1"])
    assert "input 2 'no mask here' has no mask token '[MASK]'" in _cli_error(
        capsys, ["--model", mlm, "--fill-mask", "a [MASK]", "no mask here"])
    assert "input 1 is 73 tokens long (special tokens included); the model takes at most 64" \
        in _cli_error(capsys, ["--model", mlm, "--fill-mask", "a" * 70 + "[MASK]"])
    assert "input 1 is 65 tokens long; the model takes at most 64 (max_len)" in _cli_error(
        capsys, ["--model", dirs["cls-notok"], "--classify", " ".join(["9"] * 65)])
    for k in ("0", "262"):
        assert f"--top-k {k} must be in [1, vocab_size=261]" in _cli_error(
            capsys, ["--model", mlm, "--fill-mask", "--top-k", k, "[MASK]"])
    assert (f"--fill-mask needs a masked-LM model (num_labels=0); {cls} is an encoder-only "
            "classifier (num_labels=2: neg, pos): pass --classify") in _cli_error(
        capsys, ["--model", cls, "--fill-mask", "a [MASK]"])
    assert (f"--classify needs a classifier (num_labels > 0); {mlm} is an encoder-only "
            "masked-LM model (num_labels=0): pass --fill-mask") in _cli_error(
        capsys, ["--model", mlm, "--classify", "a"])
    assert f"{mlm} is an encoder-only masked-LM model (num_labels=0): it does not generate; " \
           "pass --fill-mask" in _cli_error(capsys, ["--model", mlm, "a [MASK]"])
    assert f"{cls} is an encoder-only classifier (num_labels=2: neg, pos): it does not " \
           "generate; pass --classify" in _cli_error(capsys, ["--model", cls, "a"])
    assert "--fill-mask needs an encoder-only model (BERT, RoBERTa); the preset gpt-tiny is " \
           "decoder_only" in _cli_error(capsys, ["--config", "gpt-tiny", "--fill-mask", "5 6"])
    assert "--strategy applies to generation, not --fill-mask" in _cli_error(
        capsys, ["--model", mlm, "--fill-mask", "--strategy", "beam", "a [MASK]"])
    assert "--strategy, --temperature apply to generation, not --classify" in _cli_error(
        capsys, ["--model", cls, "--classify", "--strategy", "sample", "--temperature", "0.5",
                 "a"])
    assert "--truncate applies to generation, not --classify" in _cli_error(
        capsys, ["--model", cls, "--classify", "--truncate", "a"])
    assert "--top-k applies to sampling and --fill-mask, not --classify" in _cli_error(
        capsys, ["--model", cls, "--classify", "--top-k", "3", "a"])
    with pytest.raises(SystemExit) as e:                   # argparse: exit 2, names both
        decode_cli.main(["--model", mlm, "--fill-mask", "--classify", "a"])
    assert e.value.code == 2
    assert "argument --classify: not allowed with argument --fill-mask" in \
        capsys.readouterr().err
