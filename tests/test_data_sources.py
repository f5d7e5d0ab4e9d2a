"""Tokenizers, TFDS builders (no network), bad lines, and the standard-dataset path."""

import numpy as np
import pytest
import sentencepiece as spm
import tensorflow_datasets as tfds

from train import data
from train.data import datasets as datasets_mod


def test_byte_tokenizer_round_trips_unicode_and_stops_at_eos(tmp_path):
    tok = data.ByteTokenizer()
    text = "naïve café ☃ 12+3"
    ids = tok.encode(text)
    assert min(ids) >= 4 and max(ids) < tok.vocab_size == 260
    assert tok.decode(ids) == text
    assert tok.decode([data.BOS_ID, *ids, data.EOS_ID, *tok.encode("junk"), 0]) == text
    assert tok.id_to_piece([data.BOS_ID, *tok.encode("a+é"), data.EOS_ID]) == [
        "<s>", "a", "+", "<0xC3>", "<0xA9>", "</s>"]
    tok.save(str(tmp_path))
    assert data.load_tokenizer(str(tmp_path)).encode(text) == ids


def test_sentencepiece_has_fixed_ids_round_trips_and_reloads(tmp_path):
    texts = [f"the {a} dog sees {n} cats ." for a in ("big", "small", "old") for n in range(50)]
    tok = data.train_sentencepiece(texts, 320)
    assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.unk_id) == (0, 1, 2, 3)
    assert tok.id_to_piece([0, 1, 2, 3]) == ["<pad>", "</s>", "<s>", "<unk>"]
    with pytest.raises(ValueError,
                       match=f"token id -1 is outside \\[0, vocab_size={tok.vocab_size}"):
        tok.id_to_piece([-1])
    ids = tok.encode(texts[0])
    reference = spm.SentencePieceProcessor(model_proto=tok.model_proto)
    assert tok.id_to_piece(ids) == reference.encode(texts[0], out_type=str)
    for text in texts[:5] + ["unseen wörds ☃ with byte fallback"]:
        ids = tok.encode(text)
        assert data.UNK_ID not in ids
        assert tok.decode(ids + [data.EOS_ID, 7, 8]) == text
    tok.save(str(tmp_path))
    again = data.load_tokenizer(str(tmp_path))
    assert again.vocab_size == tok.vocab_size and again.encode(texts[3]) == tok.encode(texts[3])


def test_our_tokenizers_have_a_mask_token_only_when_asked_and_keep_it_through_save(tmp_path):
    plain, masked = data.ByteTokenizer(), data.ByteTokenizer(mask=True)
    assert plain.mask_id is None and plain.special_ids == {0, 1, 2, 3}
    assert plain.encode("[MASK]") == [b + 4 for b in b"[MASK]"]
    ids = masked.encode("a [MASK] b[MASK]")
    assert masked.vocab_size == 261 and ids == [101, 36, 260, 36, 102, 260]
    assert masked.decode(ids) == "a [MASK] b[MASK]" and masked.id_to_piece([260]) == ["[MASK]"]
    assert masked.special_ids == {0, 1, 2, 3, 260} and masked.identity != plain.identity
    masked.save(str(tmp_path / "byte"))
    assert data.load_tokenizer(str(tmp_path / "byte")) == masked

    texts = [f"the {a} dog sees {n} cats ." for a in ("big", "small", "old") for n in range(50)]
    assert data.train_sentencepiece(texts, 320).mask_id is None
    spm_tok = data.train_sentencepiece(texts, 320, mask=True)
    ids = spm_tok.encode("the [MASK] dog")
    assert spm_tok.mask_id in ids and spm_tok.mask_token == "[MASK]"
    assert spm_tok.mask_id in spm_tok.special_ids and spm_tok.decode(ids) == "the [MASK] dog"
    spm_tok.save(str(tmp_path / "spm"))
    assert data.load_tokenizer(str(tmp_path / "spm")).mask_id == spm_tok.mask_id


def test_tokenizer_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="vocab_size=100 is below 300"):
        data.train_sentencepiece(["a b c"], 100)
    with pytest.raises(ValueError, match="empty corpus"):
        data.train_sentencepiece(["", ""], 400)
    with pytest.raises(ValueError, match=r"token id 260 is outside \[0, vocab_size=260\)"):
        data.ByteTokenizer().id_to_piece([5, 260])
    with pytest.raises(FileNotFoundError, match="no tokenizer in"):
        data.load_tokenizer(str(tmp_path / "missing"))


def test_generated_builder_prepares_once_and_reads_without_tensorflow(data_dir):
    import sys
    ds = data.load_dataset("toy_translation", data_dir)
    assert {k: len(v) for k, v in ds.splits.items()} == {
        "train": 50_000, "validation": 1_000, "test": 1_000}
    sources = {split: {ds.example(split, i)[0] for i in range(len(ds.splits[split]))}
               for split in ("validation", "test")}
    assert not sources["validation"] & sources["test"]
    assert "tensorflow" not in sys.modules
    again = data.load_dataset("toy_translation", data_dir)      # reuses the prepared files
    assert again.example("test", 5) == ds.example("test", 5)
    assert again.splits["train"].dataset_info.file_format.value == "array_record"


def test_local_translation_counts_every_malformed_line(data_dir, tmp_path):
    train = tmp_path / "train.tsv"
    train.write_bytes(b"hello world\tbonjour le monde\n"          # 1 ok
                      b"no tab here\n"                          # 2 no tab
                      b"\tempty source\n"                       # 3 empty side
                      b"good one\tbon un\n"                     # 4 ok
                      b"bad \xff\xfe bytes\tx\n"                # 5 invalid UTF-8
                      b"a\tb\tc\n"                              # 6 more than one tab
                      b"source only\t  \n")                     # 7 empty side
    test = tmp_path / "test.tsv"
    test.write_text("one\tun\ntwo\tdeux\n")
    ds = data.load_dataset("local_translation", data_dir, data_files=(str(train), str(test)))
    assert len(ds.splits["train"]) == 2 and len(ds.splits["test"]) == 2
    assert sorted(ds.example("train", i) for i in range(2)) == [
        ("good one", "bon un"), ("hello world", "bonjour le monde")]
    assert ds.bad_lines.counts == {"no tab": 1, "empty side": 2, "invalid UTF-8": 1,
                                   "more than one tab": 1}
    assert ds.bad_lines.examples == [f"{train}:2: no tab", f"{train}:3: empty side",
                                     f"{train}:5: invalid UTF-8", f"{train}:6: more than one tab",
                                     f"{train}:7: empty side"]
    # The report survives preparation: a second run that reuses the files still reports it.
    again = data.load_dataset("local_translation", data_dir, data_files=(str(train), str(test)))
    assert again.bad_lines.counts == ds.bad_lines.counts


def test_text_records_are_read_as_tfdss_decoder_reads_them(data_dir, tmp_path):
    """Our datasets' features are all `Text`: their records are parsed from the stored
    tf.train.Example directly, equal to what TFDS's own decoder gives, in the order asked."""
    from tensorflow_datasets.core.data_sources.array_record import ArrayRecordDataSource
    train = tmp_path / "train.tsv"
    train.write_text("naïve café ☃\tun café naïf\nhello\tbonjour\n"
                     + "".join(f"line {i}\tligne {i} \U0001f600\n" for i in range(30)),
                     encoding="utf-8")
    test = tmp_path / "test.tsv"
    test.write_text("one\tun\n")
    local = data.load_dataset("local_translation", data_dir, data_files=(str(train), str(test)))
    for ds in (local, data.load_dataset("toy_classification", data_dir)):
        source = ds.split("train")
        assert sorted(datasets_mod._text_feature_names(source)) == sorted(ds.keys)
        indices = [len(source) - 1, 0, len(source) // 2, 0]     # any order, repeats
        want = [source[i] for i in indices]                  # TFDS's decoder
        assert ds._records("train", indices) == want and ds._records("train", []) == []
        assert ds.examples("train", indices) == [
            tuple(r[k].decode() for k in ds.keys) for r in want]
    assert ("naïve café ☃", "un café naïf") in local.examples(
        "train", range(len(local.split("train"))))
    # A source with decoders (or a feature other than Text) goes through TFDS's decoder.
    decoded = ArrayRecordDataSource(source.dataset_info, "train", decoders={"text": None})
    assert datasets_mod._text_feature_names(decoded) is None


def test_line_aligned_files_and_local_text(data_dir, tmp_path):
    src, tgt = tmp_path / "a.en", tmp_path / "a.fr"
    src.write_text("one\ntwo\n\nfour\n")
    tgt.write_text("un\ndeux\ntrois\nquatre\n")
    ds = data.load_dataset("local_translation", data_dir, data_files=(str(src), str(tgt)))
    total = sum(len(v) for v in ds.splits.values())
    assert total == 3 and ds.bad_lines.examples == [f"{src}:3: empty side"]
    text = tmp_path / "book.txt"
    text.write_text("First line.\n\nSecond line.\n   \nThird.\n")
    lm = data.load_dataset("local_text", data_dir, data_files=(str(text),))
    assert lm.kind == "text" and sum(len(v) for v in lm.splits.values()) == 3
    assert lm.bad_lines.counts == {"blank line": 2}
    tgt.write_text("un\ndeux\n")
    with pytest.raises(ValueError, match=r"a.en' has 4 lines, .*a.fr' has 2"):
        data.load_dataset("local_translation", data_dir, data_files=(str(src), str(tgt)))
    with pytest.raises(ValueError, match="needs a line-aligned target file"):
        data.load_dataset("local_translation", data_dir, data_files=(str(src),))


def test_missing_file_and_unknown_dataset_are_named(data_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="data file '.*nothere.tsv' does not exist"):
        data.load_dataset("local_translation", data_dir,
                          data_files=(str(tmp_path / "nothere.tsv"),))
    with pytest.raises(ValueError, match="local datasets need data_files"):
        data.load_dataset("local_text", data_dir)
    with pytest.raises(ValueError, match=r"unknown dataset 'wmt99'; available: .*toy_translation"):
        data.load_dataset("wmt99", data_dir)


def test_dataset_needing_tensorflow_to_prepare_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets_mod, "_tensorflow_available", lambda: False)
    with pytest.raises(ImportError, match=r"'tiny_shakespeare' is not prepared .*tfds-prepare"):
        data.load_dataset("tiny_shakespeare", str(tmp_path))


@pytest.mark.parametrize("name", ["wmt14_translate/de-en", "tiny_shakespeare"])
def test_standard_datasets_go_through_the_same_pipeline(name, tmp_path, monkeypatch):
    monkeypatch.setattr(datasets_mod, "_tensorflow_available", lambda: True)
    with tfds.testing.mock_data(num_examples=40, policy=tfds.testing.MockPolicy.USE_CODE):
        ds = data.load_dataset(name, str(tmp_path), reverse_translation=name.startswith("wmt"))
        assert ds.keys == (("en", "de") if name.startswith("wmt") else ("text",))
        cfg = data.PipelineConfig(per_device_batch_size=2, max_source_length=24,
                                  max_target_length=24)
        source, stats = data.train_source(ds, data.ByteTokenizer(), cfg, num_devices=2,
                                          shard_index=0, shard_count=1)
        batch = source[0]
    assert stats.examples == 40
    chex_shape = (2, 2, 24)
    assert batch["targets"].shape == chex_shape
    assert np.all(batch["targets"][batch["targets_segmentation"] == 0] == 0)


def test_a_split_too_small_to_have_examples_names_the_file_and_the_counts(data_dir, tmp_path):
    """A file split 90/5/5 by line hash can leave a split empty: asking for that split says
    which file and how many examples each split got (not a KeyError)."""
    from train.data import local_files
    lines = [f"line {i}" for i in range(40)]
    book = tmp_path / "book.txt"
    book.write_text("".join(f"{t}\n" for t in lines if local_files._split_of(t) != "validation"))
    counts = {s: sum(local_files._split_of(t) == s for t in lines) for s in ("train", "test")}
    ds = data.load_dataset("local_text", data_dir, data_files=(str(book),))
    assert len(ds.split("train")) == counts["train"] and "validation" not in ds.splits
    want = (f"local_text: split 'validation' has no examples: it comes from {str(book)!r} "
            f"(split 90/5/5 by a hash of each line), and the splits have train "
            f"{counts['train']}, validation 0, test {counts['test']} examples; each split needs "
            "at least one (give more valid lines, or three files: train, validation, test)")
    with pytest.raises(ValueError) as e:
        data.eval_batches(ds, data.ByteTokenizer(),
                          data.PipelineConfig(per_device_batch_size=2), "validation",
                          num_devices=1, shard_index=0, shard_count=1)
    assert str(e.value) == want
    # Three files: the one that gave no valid lines is named.
    files = [tmp_path / n for n in ("tr.txt", "va.txt", "te.txt")]
    for path, text in zip(files, ("a\nb\n", "\n  \n", "c\n"), strict=True):
        path.write_text(text)
    ds = data.load_dataset("local_text", data_dir, data_files=tuple(map(str, files)))
    with pytest.raises(ValueError, match=f"split 'validation' has no examples: it comes from "
                                         f"'{files[1]}', and the splits have train 2, "
                                         "validation 0, test 1 examples"):
        ds.examples("validation", [0])


def test_a_directory_given_as_a_data_file_says_it_is_a_directory(data_dir, tmp_path):
    with pytest.raises(IsADirectoryError, match=f"data file '{tmp_path}' is a directory, not a "
                                                "file"):
        data.load_dataset("local_text", data_dir, data_files=(str(tmp_path),))


def test_dataset_digests_follow_the_contents_and_name_the_changed_file(data_dir, tmp_path):
    """`digest` is the same for the same examples (a moved file included) and differs when
    they differ; `data_changes` between two `data_record`s names the edited file."""
    toy = data.load_dataset("copy", data_dir)
    assert toy.digest == data.load_dataset("copy", data_dir).digest
    assert len({toy.digest, data.load_dataset("reverse", data_dir).digest,
                data.load_dataset("copy", data_dir, reverse_translation=True).digest}) == 3
    tok = data.ByteTokenizer()
    book = tmp_path / "book.txt"
    book.write_text("one line\nanother line\n" * 20)
    ds = data.load_dataset("local_text", data_dir, data_files=(str(book),))
    saved = data.data_record(ds, tok)
    moved = tmp_path / "moved.txt"
    moved.write_bytes(book.read_bytes())
    same = data.load_dataset("local_text", data_dir, data_files=(str(moved),))
    assert same.digest == ds.digest and data.data_changes(saved, data.data_record(same, tok)) == []
    book.write_text("one line\nanother LINE\n" * 20)
    edited = data.load_dataset("local_text", data_dir, data_files=(str(book),))
    current = data.data_record(edited, tok)
    assert current["digest"] == data.data_digest(edited, tok) != saved["digest"]
    (change,) = data.data_changes(saved, current)
    assert change.startswith(f"data file '{book}' changed (sha256 ")
    sp = data.train_sentencepiece([f"word {i}" for i in range(300)], 300)
    assert data.data_digest(edited, sp) != data.data_digest(edited, tok)
    assert data.data_changes(current, data.data_record(edited, sp))[0].startswith(
        "the tokenizer changed")
