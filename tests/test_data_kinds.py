"""Dataset kinds: the one table (train.data.kinds) that builders, datasets and every pipeline
stage ask. Each kind's entry decides its batches' arrays, widths, roles, labels and length
rule; a kind added to the table goes through the pipeline unchanged."""

import numpy as np
import pytest

from train import data
from train.data import builders, kinds, local_files
from train.data.datasets import Dataset
from train.data.pipeline import Shard

TOK = data.ByteTokenizer()


def _cfg(**kw):
    return data.PipelineConfig(**{"per_device_batch_size": 2, "max_source_length": 12,
                                  "max_target_length": 16, **kw})


class _Records:
    """A random-access split in memory, like `tfds.data_source` (features are bytes)."""

    def __init__(self, rows: list[dict]):
        self.rows = [{k: v.encode() for k, v in r.items()} for r in rows]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]

    def __getitems__(self, indices):
        return [self.rows[i] for i in indices]


def _arrays(names) -> set[str]:
    return {f"{n}{suffix}" for n in names for suffix in ("", "_segmentation", "_position")}


@pytest.mark.parametrize("name, files", [("copy", ()), ("toy_classification", ()),
                                         ("toy_text", ())])
def test_each_kind_says_what_its_batches_hold(name, files, data_dir):
    ds = data.load_dataset(name, data_dir, data_files=files)
    kind = ds.data_kind
    assert kind is kinds.get(ds.kind) and ds.keys == kind.keys
    assert data.dataset_kind(name) == ds.kind
    cfg = _cfg()
    source, stats = data.train_source(ds, TOK, cfg, num_devices=1, shard_index=0, shard_count=1)
    batch = source[0]
    assert set(batch) == _arrays(kind.batch_names) | ({"labels"} if kind.labelled else set())
    for side, width in zip(kind.batch_names, kind.max_lengths(cfg), strict=True):
        assert batch[side].shape == (1, 2, width)
    assert (stats.chunks > 0) == kind.chunked
    if kind.labelled:          # one label at the first position of each segment
        seg = batch[f"{kind.batch_names[0]}_segmentation"]
        first = (seg > 0) & (batch[f"{kind.batch_names[0]}_position"] == 0)
        assert np.all(batch["labels"][~first] == 0)
        assert set(batch["labels"][first].tolist()) <= set(range(len(ds.label_names)))


def test_kind_table_entries():
    assert kinds.TRANSLATION.roles() == (kinds.SOURCE_ROLE, kinds.TARGET_ROLE)
    assert kinds.TEXT.roles("sentence") == (kinds.SENTENCE_ROLE,)
    assert kinds.TEXT.roles() == (kinds.TEXT_ROLE,)
    assert kinds.CLASSIFICATION.roles("text") == (kinds.SENTENCE_ROLE,)   # always sentences
    assert kinds.CLASSIFICATION.label_key == "label"
    assert kinds.TEXT.max_lengths(_cfg()) == (16,)
    assert kinds.CLASSIFICATION.max_lengths(_cfg()) == (12,)
    assert {n: data.dataset_kind(n) for n in ("local_text", "lm1b", "toy_translation")} == {
        "local_text": "text", "lm1b": "text", "toy_translation": "translation"}


def test_unknown_kinds_roles_and_datasets_are_named():
    with pytest.raises(ValueError, match=r"dataset kind 'audio' must be one of "
                                         r"\['chat', 'classification', 'preference', "
                                         r"'prompts', 'speech', "
                                         r"'text', 'translation'\]"):
        kinds.get("audio")
    with pytest.raises(ValueError, match=r"role 'caption' must be one of \['chat', 'sentence', "
                                         r"'source', 'target', 'text', 'transcript'\]"):
        data.pipeline.encode_side(TOK, ["x"], "caption")
    with pytest.raises(ValueError, match="text_role='source' must be 'text' or 'sentence'"):
        data.PipelineConfig(per_device_batch_size=1, text_role="source")
    with pytest.raises(ValueError, match="unknown dataset 'wmt99'; available: "):
        data.dataset_kind("wmt99")
    with pytest.raises(ValueError, match="a text dataset has no labels"):
        _ = kinds.TEXT.label_key
    with pytest.raises(ValueError, match="a text dataset has no audio"):
        _ = kinds.TEXT.audio_key


def test_roles_encode_each_side_as_the_table_says():
    sentence_tok = data.ByteTokenizer(add_bos=True, add_eos=True)
    texts = ["ab", ""]
    ab = [ord("a") + 4, ord("b") + 4]
    assert data.pipeline.encode_side(TOK, texts, kinds.SOURCE_ROLE) == [ab + [1], [1]]
    assert data.pipeline.encode_side(TOK, texts, "text") == [ab + [1], [1]]
    # A sentence is the model-input template alone: nothing appended after its end.
    assert data.pipeline.encode_side(sentence_tok, texts, "sentence") == [
        sentence_tok.encode("ab", add_special_tokens=True), [2, 1]]
    # A transcript follows the pipeline's prefix (Whisper's prompt after its start token).
    assert data.pipeline.encode_side(TOK, texts, "transcript", prefix=(7, 8)) == [
        [7, 8, *ab, 1], [7, 8, 1]]


def test_a_kind_added_to_the_table_goes_through_the_pipeline(monkeypatch):
    """A new kind (here pairs read as two plain texts, labelled by a third feature) is one
    table entry: tokenising, the length rules, packing, labels and evaluation batches all
    follow it with no change elsewhere."""
    pairs = kinds.DataKind(
        "paraphrase", ("first", "second", "verdict"),
        (kinds.Side("inputs", "max_source_length", kinds.TEXT_ROLE),
         kinds.Side("targets", "max_target_length", kinds.TEXT_ROLE)), labelled=True)
    monkeypatch.setitem(kinds.KINDS, "paraphrase", pairs)
    rows = [{"first": f"a{i}", "second": "b" * (i % 5), "verdict": ("no", "yes")[i % 2]}
            for i in range(40)]
    ds = Dataset("in_memory", "paraphrase", {"train": _Records(rows), "test": _Records(rows)},
                 ("first", "second", "verdict"), label_names=("no", "yes"))
    assert ds.data_kind is pairs
    cfg = _cfg(max_source_length=4, max_target_length=4)
    source, stats = data.train_source(ds, TOK, cfg, num_devices=2, shard_index=0, shard_count=1)
    # "b" * 0 is one token (EOS alone): empty; "b" * 4 is 5 tokens: too long for 4.
    assert (stats.kept, stats.dropped_empty, stats.dropped_too_long) == (24, 8, 8)
    batch = source[0]
    assert set(batch) == _arrays(("inputs", "targets")) | {"labels"}
    batches, _ = data.eval_batches(ds, TOK, cfg, "test", num_devices=2, shard_index=0,
                                   shard_count=1)
    seen = 0
    for b in batches:
        for row in range(4):
            i = int(b["example_index"].reshape(-1)[row])
            if i < 0:
                continue
            for side, feature in (("inputs", "first"), ("targets", "second")):
                tokens = b[side].reshape(4, 4)[row]
                segment = b[f"{side}_segmentation"].reshape(4, 4)[row]
                assert tokens[segment > 0].tolist() == TOK.encode(rows[i][feature]) + [1]
            assert b["labels"].reshape(4, 4)[row, 0] == i % 2
            seen += 1
    assert seen == 24


def test_shards_name_their_limits(data_dir):
    with pytest.raises(ValueError, match=r"shard_index=3 must be in \[0, shard_count=3\)"):
        Shard(3, 3, 1)
    copy = data.load_dataset("copy", data_dir)
    with pytest.raises(ValueError, match=r"shard_index=2 must be in \[0, shard_count=2\)"):
        data.train_source(copy, TOK, _cfg(), num_devices=1, shard_index=2, shard_count=2)
    assert Shard.of(1, 2, 4) == Shard(1, 2, 4)


def test_local_builders_group_their_files_into_sources():
    assert builders.LOCAL["local_translation"].sources(("a.tsv", "b.en", "b.de")) == [
        ("a.tsv",), ("b.en", "b.de")]
    assert builders.LOCAL["local_text"].sources(("tr.txt", "te.txt")) == [("tr.txt",),
                                                                         ("te.txt",)]
    with pytest.raises(ValueError, match="got 4 data sources"):
        builders.LOCAL["local_classification"].sources(("a", "b", "c", "d"))
    origins = local_files.split_origins([("tr.en", "tr.de"), ("te.tsv",)])
    assert origins == {"train": "'tr.en,tr.de'", "validation": "'te.tsv'", "test": "'te.tsv'"}
