"""Fine-tuning a model directory: a tiny random GPT-2 made by transformers, with its own
byte-level BPE tokenizer, trained with `init_from` on local text; and a tiny random
MarianMTModel with separate source and target sentencepiece models (`finetune_translation`
on parallel text). Their exports decode and load back into transformers with the same
logits."""

import io
import json
import os
import random

import jax
import numpy as np
import pytest

import decode.__main__ as decode_cli
import models
from tests.train_helpers import assert_split_encoded_as, tiny_train_config, train_metric_rows
from train import configs, export as export_lib
from train.data import (
    PipelineConfig,
    eval_batches,
    load_dataset,
    load_tokenizer,
)
from train.objectives import next_token
from train.trainer import train_and_evaluate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
# MarianTokenizer asks for sacremoses, which it never uses to encode.
pytestmark = pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")

WORDS = "the cat sat on a mat and saw one dog run to its home by the sea".split()


def _tiny_lm_dir(root, family: str):
    """A tiny `family` model ("gpt2" or "gemma2") and a byte-level BPE tokenizer trained in
    memory, saved as a hub checkpoint would be; and a text file to fine-tune on."""
    from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers, trainers
    lines = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(5 + i % 6))
             for i in range(200)]
    specials = (["<|endoftext|>", "<unk>"] if family == "gpt2"
                else ["<pad>", "<eos>", "<bos>", "<unk>"])
    backend = Tokenizer(tok_models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    torch.manual_seed(0)
    if family == "gpt2":
        tok = transformers.PreTrainedTokenizerFast(
            tokenizer_object=backend, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
            unk_token="<unk>")
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=2, n_head=2,
            bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id))
    else:           # Gemma 2: soft-caps, a sliding layer then a full one, (1 + w) norms
        tok = transformers.PreTrainedTokenizerFast(
            tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
            bos_token="<bos>", unk_token="<unk>")
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8,
            max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=2))
    model_dir = root / family
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    book = root / "book.txt"
    book.write_text("\n".join(lines) + "\n")
    return str(model_dir), str(book)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    return _tiny_lm_dir(tmp_path_factory.mktemp("finetune"), "gpt2")


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory):
    return _tiny_lm_dir(tmp_path_factory.mktemp("finetune_gemma2"), "gemma2")


def _finetune_config(data_dir, lm_dir, steps):
    model_dir, book = lm_dir
    c = tiny_train_config(data_dir, init_from=model_dir, dataset="local_text",
                          data_files=book, num_train_steps=steps, learning_rate=3e-3,
                          lr_decay="constant", warmup_steps=1, label_smoothing=0.0,
                          max_source_length=32, max_target_length=32, max_decode_length=32,
                          eval_per_device_batch_size=8, checkpoint_every_steps=1000)
    c.model_overrides = type(c.model_overrides)()        # the directory's model, as it is
    return c


@pytest.mark.parametrize("family", ["gpt2", pytest.param("gemma2", marks=pytest.mark.slow)])
def test_finetuning_lowers_the_loss_and_the_export_decodes_and_loads_in_transformers(
        data_dir, family, request, tmp_path, capsys):
    lm_dir = request.getfixturevalue(f"{family}_dir")
    untouched = train_and_evaluate(_finetune_config(data_dir, lm_dir, 0),
                                   str(tmp_path / "zero"))
    tuned = train_and_evaluate(_finetune_config(data_dir, lm_dir, 12), str(tmp_path / "ft"))
    assert tuned["validation"]["loss"] < untouched["validation"]["loss"] - 0.5
    # The export: the directory's own type and tokenizer, new weights.
    export = tuned["model"]
    pre = models.load(export)
    assert pre.model_type == family and pre.tokenizer is not None
    assert pre.tokenizer.encode("the cat") == models.load(lm_dir[0]).tokenizer.encode("the cat")
    hf = transformers.AutoModelForCausalLM.from_pretrained(export, attn_implementation="eager")
    ids = np.array([pre.tokenizer.encode("the cat sat on a mat")])
    with torch.no_grad():
        expected = hf(torch.tensor(ids)).logits.numpy()
    with jax.default_matmul_precision("highest"):
        ours = np.asarray(pre.model.apply({"params": pre.params}, ids))
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)
    capsys.readouterr()
    assert decode_cli.main(["--model", export, "--max-new-tokens", "6", "the cat", "a dog"]) == 0
    out = capsys.readouterr().out.split("\n")
    assert len(out) == 3 and out[2] == "" and all(set(line) <= set("abcdefghijklmnopqrstuvwxyz ")
                                                   for line in out[:2])
    assert os.path.exists(os.path.join(export, "tokenizer.json"))


# ---------------------------------------------------------------------------------------------
# Marian: one vocabulary, two sentencepiece models (source.spm, target.spm), as opus-mt has.

SOURCE_WORDS = "the a cat dog bird sees likes eats red big small fish".split()
TARGET_WORDS = "ku na mivgu gasgu pelto sabna bamfot lirra ozzo tamba vel pirru".split()
TRANSLATION = dict(zip(SOURCE_WORDS, TARGET_WORDS, strict=True))


def _pairs(n: int, seed: int) -> list[tuple[str, str]]:
    """Sentences of 3 to 7 words and their word-by-word translations in reverse order."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [rng.choice(SOURCE_WORDS) for _ in range(rng.randint(3, 7))]
        out.append((" ".join(words), " ".join(TRANSLATION[w] for w in reversed(words))))
    return out


def _sentencepiece(texts: list[str]) -> bytes:
    import sentencepiece as spm
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=model,
                                   vocab_size=40, model_type="unigram", character_coverage=1.0,
                                   hard_vocab_limit=False, num_threads=1, minloglevel=2)
    return model.getvalue()


@pytest.fixture(scope="module")
def marian_dir(tmp_path_factory):
    """A tiny random MarianMTModel and a MarianTokenizer whose source.spm and target.spm
    were trained on the two sides of generated pairs, saved as opus-mt's are (vocab.json:
    "</s>" 0, "<unk>" 1, both models' pieces, "<pad>" last; the decoder starts from pad;
    generation_config.json with beams, the forced end and pad banned); train.tsv and
    test.tsv to fine-tune on."""
    import sentencepiece as spm

    from tests.pretrained_helpers import randomize_seq2seq
    root = tmp_path_factory.mktemp("marian")
    train_pairs, test_pairs = _pairs(200, seed=0), _pairs(16, seed=1)
    spms = {}
    for name, side in (("source.spm", 0), ("target.spm", 1)):
        spms[name] = root / f"{name}.in"
        spms[name].write_bytes(_sentencepiece([p[side] for p in train_pairs]))
    vocab = {"</s>": 0, "<unk>": 1}
    for path in spms.values():
        sp = spm.SentencePieceProcessor(model_file=str(path))
        for i in range(sp.get_piece_size()):
            if not (sp.is_control(i) or sp.is_unknown(i)):
                vocab.setdefault(sp.id_to_piece(i), len(vocab))
    vocab["<pad>"] = pad = len(vocab)
    (root / "vocab.json").write_text(json.dumps(vocab))
    tok = transformers.MarianTokenizer(str(spms["source.spm"]), str(spms["target.spm"]),
                                       str(root / "vocab.json"))
    assert (len(tok), tok.pad_token_id, tok.eos_token_id) == (len(vocab), pad, 0)
    config = transformers.MarianConfig(
        vocab_size=len(vocab), d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48,
        decoder_ffn_dim=48, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, pad_token_id=pad, eos_token_id=0, decoder_start_token_id=pad,
        activation_function="swish", scale_embedding=True,
        share_encoder_decoder_embeddings=True)
    model = randomize_seq2seq(transformers.MarianMTModel(config), seed=7)
    model.generation_config = transformers.GenerationConfig(
        decoder_start_token_id=pad, eos_token_id=0, pad_token_id=pad, forced_eos_token_id=0,
        bad_words_ids=[[pad]], num_beams=2, max_length=64)
    model_dir = root / "opus-mt-tiny"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    files = []
    for name, pairs in (("train.tsv", train_pairs), ("test.tsv", test_pairs)):
        files.append(str(root / name))
        (root / name).write_text("".join(f"{s}\t{t}\n" for s, t in pairs))
    return str(model_dir), files


def test_marian_sources_and_targets_are_encoded_by_their_own_models_as_transformers_does(
        data_dir, marian_dir):
    """Sources through source.spm, targets through target.spm, each with EOS appended:
    exactly transformers' `tokenizer(source, text_target=target)`; the decoder input starts
    from the config's start token (Marian's pad); batch padding never reaches the logits."""
    model_dir, files = marian_dir
    pre = models.load(model_dir)
    tok, hf_tok = pre.tokenizer, transformers.AutoTokenizer.from_pretrained(model_dir)
    target_text = "bamfot lirra ozzo"
    # The source model never saw the target words: it spells them out (and has no "z").
    assert tok.encode(target_text) != tok.encode(target_text, target=True)
    assert tok.id_to_piece(tok.encode(target_text, target=True)) == [
        "▁bamfot", "▁lirra", "▁ozzo"]
    assert tok.encode(target_text).count(tok.unk_id) == 1
    assert tok.decode(tok.encode(target_text, target=True)) == target_text

    ds = load_dataset("local_translation", data_dir, data_files=tuple(files))
    want = assert_split_encoded_as(ds, "validation", tok, hf_tok)

    (batch,), _ = eval_batches(ds, tok, PipelineConfig(per_device_batch_size=16,
                                                       max_source_length=24,
                                                       max_target_length=24), "validation",
                               num_devices=1)
    batch = {k: v[0] for k, v in batch.items()}
    dec_in = next_token.shift_right(batch["targets"], batch["targets_position"],
                                    batch["targets_segmentation"], pre.config.bos_id)
    n = len(want["labels"][0])
    from transformers.models.marian.modeling_marian import shift_tokens_right
    expected_in = shift_tokens_right(torch.tensor(want["labels"][:1]), tok.pad_id,
                                     pre.config.bos_id)[0].tolist()
    assert pre.config.bos_id == tok.pad_id == len(tok.hf) - 1
    assert np.asarray(dec_in)[0, :n].tolist() == expected_in
    with jax.default_matmul_precision("highest"):
        logits = next_token.forward(pre.model, pre.params, batch, dec_in, dropout_rng=None,
                                    deterministic=True)
    hf = transformers.MarianMTModel.from_pretrained(model_dir, attn_implementation="eager")
    with torch.no_grad():                          # the first example alone, unpadded
        expected = hf(input_ids=torch.tensor(want["input_ids"][:1]),
                      labels=torch.tensor(want["labels"][:1])).logits.numpy()[0]
    np.testing.assert_allclose(np.asarray(logits)[0, :n], expected, atol=1e-4, rtol=0)


def _marian_config(data_dir, marian_dir, steps):
    model_dir, files = marian_dir
    c = configs.get("finetune_translation")
    c.update(data_dir=data_dir, init_from=model_dir, data_files=",".join(files),
             num_train_steps=steps, learning_rate=3e-3, warmup_steps=1, lr_decay="constant",
             per_device_batch_size=2, eval_per_device_batch_size=4, max_source_length=24,
             max_target_length=24, max_decode_length=12, log_every_steps=1,
             eval_every_steps=1000, checkpoint_every_steps=1000, num_eval_decode=8,
             num_test_decode=8)
    return c


@pytest.mark.slow
def test_finetuning_a_marian_lowers_the_loss_scores_bleu_and_its_export_decodes(
        data_dir, marian_dir, tmp_path, capsys):
    workdir = str(tmp_path / "ft")
    tuned = train_and_evaluate(_marian_config(data_dir, marian_dir, 40), workdir)
    losses = [row["loss"] for row in train_metric_rows(workdir)]
    assert len(losses) == 40 and np.mean(losses[-3:]) < np.mean(losses[:3]) - 1.0
    # BLEU by greedy and by the directory's beam search (num_beams 2), on both splits.
    val = tuned["validation"]
    assert {"bleu", "beam_bleu"} <= set(val) and {"bleu", "beam_bleu"} <= set(tuned["test"])
    assert all(0.0 <= val[k] <= 100.0 for k in ("bleu", "beam_bleu"))
    # What a resumed run reloads is the same tokenizer (its identity keys the token cache
    # and the data record checked on resume; resuming itself is tested on any config).
    saved = load_tokenizer(os.path.join(workdir, "tokenizer"))
    assert saved.identity == models.load(marian_dir[0]).tokenizer.identity

    export = tuned["model"]
    pre = models.load(export)
    assert pre.model_type == "marian" and pre.config.bos_id == pre.config.pad_id
    assert sorted(n for n in os.listdir(export) if n.endswith(".spm")) == [
        "source.spm", "target.spm"]
    assert pre.tokenizer.identity == models.load(marian_dir[0]).tokenizer.identity
    with open(os.path.join(export, "generation_config.json")) as f:
        generation = json.load(f)
    assert generation["num_beams"] == 2 and generation["bad_words_ids"] == [[pre.config.pad_id]]
    # `python -m train.export` writes the checkpoint with the same decoding defaults.
    again = export_lib.export(workdir, out=str(tmp_path / "again"))
    with open(os.path.join(again, "generation_config.json")) as f:
        assert json.load(f) == generation
    hf = transformers.MarianMTModel.from_pretrained(export, attn_implementation="eager")
    hf_tok = transformers.AutoTokenizer.from_pretrained(export)
    src = np.array([pre.tokenizer.encode("the red cat sees a fish", add_special_tokens=True)])
    tgt_in = np.array([[pre.config.bos_id, *pre.tokenizer.encode("pirru na", target=True)]])
    assert src[0].tolist() == hf_tok("the red cat sees a fish")["input_ids"]
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor(src), decoder_input_ids=torch.tensor(tgt_in)
                      ).logits.numpy()
    with jax.default_matmul_precision("highest"):
        ours = np.asarray(pre.model.apply({"params": pre.params}, src, tgt_in))
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)
    # It decodes as transformers' generate does with the directory's generation config (2
    # beams, pad banned, the end forced at the last step, and transformers' default
    # stopping rule, early_stopping=False, since the file names none).
    sources = ["the red cat sees a fish", "a dog", "small cat sees red fish small"]
    with torch.no_grad():
        hf_out = hf.generate(**hf_tok(sources, return_tensors="pt", padding=True),
                             max_new_tokens=12)
    capsys.readouterr()
    assert decode_cli.main(["--model", export, "--strategy", "beam", "--max-new-tokens", "12",
                            *sources]) == 0
    lines = capsys.readouterr().out.split("\n")
    assert lines == [*hf_tok.batch_decode(hf_out, skip_special_tokens=True), ""]
    assert any(lines) and all(set(line) <= set("".join(TARGET_WORDS) + " ") for line in lines)


def test_a_tokenizer_with_a_start_template_is_used_as_transformers_fine_tunes():
    """BART's tokenizer wraps both sides as `<s> x </s>`: the training data (and the
    sources evaluation decodes) are exactly `tokenizer(source, text_target=target)`, no
    second end token; text for a decoder-only model stays pieces then EOS."""
    from tokenizers import (
        Tokenizer as RawTokenizer,
        models as tok_models,
        pre_tokenizers,
        processors,
    )

    from models.tokenizer import HFTokenizer
    from train.data.pipeline import encode_side
    vocab = {w: i for i, w in enumerate(["<s>", "<pad>", "</s>", "<unk>", "a", "b", "c"])}
    raw = RawTokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<unk>")
    tok = HFTokenizer(hf)
    sources, targets = ["a b", "c"], ["b c a", "a"]
    want = hf(sources, text_target=targets)
    assert encode_side(tok, sources, "source") == want["input_ids"] == [[0, 4, 5, 2], [0, 6, 2]]
    assert encode_side(tok, targets, "target") == want["labels"]
    assert encode_side(tok, sources, "text") == [[4, 5, 2], [6, 2]]
