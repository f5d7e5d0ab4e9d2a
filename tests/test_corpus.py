"""bench.corpus: .mo catalogues read, pairs cleaned and split as its docstring says (no
download: the catalogues are written here)."""

import collections
import struct

import pytest

from bench import corpus


def _write_mo(path, entries, charset="UTF-8"):
    """A little-endian .mo file of (msgid, msgstr) byte strings, with a header entry."""
    header = (b"", f"Content-Type: text/plain; charset={charset}\n".encode())
    entries = sorted([header, *entries])
    n = len(entries)
    ids_at, strs_at = 28, 28 + 8 * n
    data_at = strs_at + 8 * n
    blob, id_table, str_table = b"", b"", b""
    for msgid, _ in entries:
        id_table += struct.pack("<2I", len(msgid), data_at + len(blob))
        blob += msgid + b"\0"
    for _, msgstr in entries:
        str_table += struct.pack("<2I", len(msgstr), data_at + len(blob))
        blob += msgstr + b"\0"
    head = struct.pack("<7I", 0x950412DE, 0, n, ids_at, strs_at, 0, 0)
    path.write_bytes(head + id_table + str_table + blob)


def test_read_mo_drops_the_header_and_contexts_and_keeps_plural_singulars(tmp_path):
    path = tmp_path / "a.mo"
    _write_mo(path, [(b"menu\x04_Open", b"_\xc3\x96ffnen"),
                     (b"%d file\x00%d files", b"%d Datei\x00%d Dateien"),
                     (b"Close", b"Schlie\xc3\x9fen")])
    assert sorted(corpus.read_mo(str(path))) == [
        ("%d file", "%d Datei"), ("Close", "Schließen"), ("_Open", "_Öffnen")]


def test_read_mo_decodes_by_the_header_charset_and_refuses_other_files(tmp_path):
    path = tmp_path / "latin.mo"
    _write_mo(path, [(b"Size", b"Gr\xf6\xdfe")], charset="ISO-8859-1")
    assert corpus.read_mo(str(path)) == [("Size", "Größe")]
    (tmp_path / "x.mo").write_bytes(b"not a catalogue at all")
    with pytest.raises(ValueError, match="not a .mo file"):
        corpus.read_mo(str(tmp_path / "x.mo"))


@pytest.mark.parametrize("source,target,expected", [
    ("_Open File", "Datei _öffnen", ("Open File", "Datei öffnen")),
    ("&Save", "&Speichern", ("Save", "Speichern")),
    ("~Insert", "~Einfügen", ("Insert", "Einfügen")),
    ("T_hemed", "Thema", ("Themed", "Thema")),
    ("Save & Close", "Speichern &\nschließen", ("Save & Close", "Speichern & schließen")),
    ("%1$s of %2$d", "%2$d von %1$s", ("%1$s of %2$d", "%2$d von %1$s")),
    ("100% done", "100 % fertig", ("100% done", "100 % fertig")),
    ("%d files", "%s Dateien", "placeholders differ"),
    ("Hello {name}", "Hallo", "placeholders differ"),
    ("<b>Bold</b>", "<b>Fett</b>", "markup"),
    ("Tom &amp; Jerry", "Tom und Jerry", "markup"),
    ("PDF", "PDF", "target == source"),
    ("1.5", "1,5", "no letter in the source"),
    ("Yes", " ", "untranslated"),
    (" ".join(["word"] * 31), " ".join(["Wort"] * 31), "too long"),
    ("Open the file now", "Ö", "length ratio"),
])
def test_clean(source, target, expected):
    assert corpus.clean(source, target) == expected


def test_build_dedupes_by_key_and_splits_by_hash_whatever_the_order(monkeypatch):
    monkeypatch.setattr(corpus, "TEST_PAIRS", 5)
    monkeypatch.setattr(corpus, "VALIDATION_PAIRS", 5)
    entries = [(f"Item number {i}", f"Eintrag Nummer {i}") for i in range(40)]
    entries += [("Open...", "Öffnen …"), ("open", "öffnen"), ("Open", "Öffnen"),
                ("Close", "Schließen"), ("Close", "Zumachen"), ("Close", "Schließen")]
    stats = collections.Counter()
    splits = corpus.build(entries, stats)
    again = corpus.build(list(reversed(entries)), collections.Counter())
    assert splits == again
    assert [len(splits[s]) for s in ("test", "validation", "train")] == [5, 5, 32]
    everything = [p for pairs in splits.values() for p in pairs]
    assert ("Close", "Schließen") in everything              # the most common translation
    assert sum(corpus.key(s) == "open" for s, _ in everything) == 1
    keys = {name: {corpus.key(s) for s, _ in pairs} for name, pairs in splits.items()}
    assert not keys["train"] & keys["test"] and not keys["train"] & keys["validation"]
    assert stats["entries"] == 46 and stats["distinct keys"] == 42


def test_catalogue_paths_take_only_the_languages_own_directory(tmp_path):
    for sub in ("de", "de_CH", "fr"):
        (tmp_path / "share" / sub / "LC_MESSAGES").mkdir(parents=True)
        (tmp_path / "share" / sub / "LC_MESSAGES" / "app.mo").write_bytes(b"")
    assert corpus.catalogue_paths(str(tmp_path)) == [
        str(tmp_path / "share" / "de" / "LC_MESSAGES" / "app.mo")]


def test_corpus_score_scores_the_runs_averaged_export_greedy_and_with_beams(
        data_dir, tmp_path):
    """bench.corpus_score on a tiny copy-task run: the model it decodes is the one the run
    exports (the mean of the newest checkpoints), and a source copied to itself scores
    what the run's own greedy decoding scores."""
    import models
    from bench import corpus_score
    from tests.train_helpers import tiny_train_config
    from train import checkpoint, evaluate
    from train.trainer import train_and_evaluate
    workdir = str(tmp_path / "run")
    config = tiny_train_config(data_dir, checkpoint_every_steps=2, average_last_checkpoints=2)
    summary = train_and_evaluate(config, workdir)
    pairs = [("a b c", "a b c"), ("d e", "d e"), ("f g h i", "f g h i")]
    got = corpus_score.score(workdir, pairs, beam_size=2)
    assert got["pairs"] == 3 and got["step"] == 6 and got["averaged_steps"] == [4, 6]
    assert got["beam_size"] == 2 and 0 <= got["beam_bleu"] <= 100
    pre = models.load(summary["model"])
    tok = checkpoint.restore_model(workdir).tokenizer        # the run's own
    hyps = evaluate.translate(pre.model, pre.params, tok, [s for s, _ in pairs],
                              max_source_length=24, max_new_tokens=8)
    assert got["greedy_bleu"] == evaluate.scores(hyps, [t for _, t in pairs], "bleu")["bleu"]
    assert corpus_score.score(workdir, pairs, step=4)["averaged_steps"] == [2, 4]
    assert corpus_score.score(workdir, pairs, average_last=1)["averaged_steps"] == []
