"""The input pipeline: packing keeps segments apart, exact resume, shards, length rules."""

import os
import shutil
import socket
import subprocess
import sys

import chex
import jax
import numpy as np
import pytest

import models
from tests.helpers import tiny
from train import data
from train.data import pipeline as P

TOK = data.ByteTokenizer()


@pytest.fixture(scope="module")
def copy_ds(data_dir):
    return data.load_dataset("copy", data_dir)


def _cfg(**kw):
    return data.PipelineConfig(**{"per_device_batch_size": 4, "max_source_length": 24,
                                  "max_target_length": 24, **kw})


def _segments(tokens, seg, pos):
    """Rows of (segment id, tokens) with positions checked to restart at 0 per segment."""
    out = []
    for k in sorted(set(seg.tolist()) - {0}):
        where = np.flatnonzero(seg == k)
        assert np.array_equal(where, np.arange(where[0], where[-1] + 1)), "segment not contiguous"
        assert np.array_equal(pos[where], np.arange(len(where)))
        out.append(tokens[where])
    assert np.all(tokens[seg == 0] == 0) and np.all(pos[seg == 0] == 0)
    return out


def test_packed_rows_hold_whole_examples_in_order(copy_ds):
    source, stats = data.train_source(copy_ds, TOK, _cfg(), num_devices=2, shard_index=0,
                                      shard_count=1)
    assert stats.kept == stats.examples == 20_000
    batch = source[3]
    chex.assert_shape(list(batch.values()), (2, 4, 24))
    want = {TOK.decode(TOK.encode(s)) for s, _ in copy_ds.examples("train", range(20_000))}
    seen = 0
    for r in range(2):
        for b in range(4):
            ins = _segments(*(batch[f"inputs{k}"][r, b] for k in ("", "_segmentation",
                                                                 "_position")))
            tgs = _segments(*(batch[f"targets{k}"][r, b] for k in ("", "_segmentation",
                                                                  "_position")))
            assert len(ins) == len(tgs) >= 1
            for i, t in zip(ins, tgs, strict=True):
                assert i[-1] == t[-1] == data.EOS_ID
                assert TOK.decode(i) == TOK.decode(t) in want      # copy task: same sides
                seen += 1
    assert seen > 8, "packing put several examples in a row"


def test_packed_row_equals_its_examples_alone_through_the_model(copy_ds, key):
    cfg = tiny("encoder_decoder", vocab_size=TOK.vocab_size, max_len=24)
    model = models.build(cfg)
    source, _ = data.train_source(copy_ds, TOK, _cfg(per_device_batch_size=2), num_devices=1,
                                  shard_index=0, shard_count=1)
    b = jax.tree.map(lambda x: x[0], source[0])
    tgt_in = np.where(b["targets_position"] == 0, cfg.bos_id, np.roll(b["targets"], 1, axis=-1))
    tgt_in = np.where(b["targets_segmentation"] == 0, 0, tgt_in)
    params = model.init(key, b["inputs"], tgt_in)["params"]
    forward = jax.jit(lambda *a, **kw: model.apply({"params": params}, *a, **kw))
    packed = forward(b["inputs"], tgt_in, src_segment_ids=b["inputs_segmentation"],
                     tgt_segment_ids=b["targets_segmentation"],
                     src_positions=b["inputs_position"], tgt_positions=b["targets_position"])
    checked = 0
    for row in range(2):
        for k in set(b["targets_segmentation"][row].tolist()) - {0}:
            s_mask = b["inputs_segmentation"][row] == k
            t_mask = b["targets_segmentation"][row] == k
            src, tgt = np.zeros((2, 24), np.int32), np.zeros((2, 24), np.int32)
            src[0, :s_mask.sum()] = b["inputs"][row][s_mask]          # alone, right-padded
            tgt[0, :t_mask.sum()] = tgt_in[row][t_mask]
            # Source padding is given by lengths (the pad id masks nothing).
            alone = forward(src, tgt, src_lengths=np.array([s_mask.sum(), 1], np.int32))
            chex.assert_trees_all_close(packed[row][t_mask], alone[0, :t_mask.sum()], atol=1e-5)
            checked += 1
    assert checked > 2


def test_resumed_iterator_yields_the_same_next_batches(copy_ds):
    cfg = _cfg(seed=3)
    source, _ = data.train_source(copy_ds, TOK, cfg, num_devices=2, shard_index=0, shard_count=1)
    epoch_len = len(P.plan_epoch(source._items, cfg, (24, 24), 8, 0))
    it = data.train_iterator(source, cfg)
    for _ in range(epoch_len - 2):          # stop just before an epoch boundary
        next(it)
    state = it.get_state()
    straight = [next(it) for _ in range(5)]
    fresh_source, _ = data.train_source(copy_ds, TOK, cfg, num_devices=2, shard_index=0,
                                        shard_count=1)
    resumed = data.train_iterator(fresh_source, cfg)
    resumed.set_state(state)
    for a, b in zip(straight, [next(resumed) for _ in range(5)], strict=True):
        chex.assert_trees_all_equal(a, b)
    assert not np.array_equal(source[0]["inputs"], source[epoch_len]["inputs"])


def test_worker_processes_give_the_same_batches_and_resume(copy_ds):
    cfg = _cfg(worker_count=2)
    source, _ = data.train_source(copy_ds, TOK, cfg, num_devices=1, shard_index=0, shard_count=1)
    it = data.train_iterator(source, cfg)
    first = [next(it) for _ in range(4)]
    for step, batch in enumerate(first):
        chex.assert_trees_all_equal(batch, source[step])
    state = it.get_state()
    again = data.train_iterator(source, cfg)
    again.set_state(state)
    chex.assert_trees_all_equal(next(again), source[4])


def test_process_shards_are_disjoint_and_make_up_the_single_process_batch(copy_ds):
    cfg = _cfg(per_device_batch_size=2)
    whole, _ = data.train_source(copy_ds, TOK, cfg, num_devices=4, shard_index=0, shard_count=1)
    parts = [data.train_source(copy_ds, TOK, cfg, num_devices=2, shard_index=i,
                               shard_count=2)[0] for i in range(2)]
    for step in (0, 7, 5000):                      # 5000 is in a later epoch
        merged = {k: np.concatenate([p[step][k] for p in parts]) for k in whole[step]}
        chex.assert_trees_all_equal(merged, whole[step])
    # Over one epoch the processes' rows are disjoint and cover every planned item.
    plan = P.plan_epoch(whole._items, cfg, (24, 24), 8, 0)
    per_process = [{i for batch in plan for row in batch[p * 4:(p + 1) * 4] for i in row}
                   for p in range(2)]
    assert not per_process[0] & per_process[1]
    assert per_process[0] | per_process[1] == {i for b in plan for row in b for i in row}
    # Evaluation shards by example: disjoint, and together the whole split.
    n = len(copy_ds.split("validation"))
    shards = [data.tokenize_split(copy_ds, "validation", TOK, shard_index=i, shard_count=3)
              for i in range(3)]
    ids = np.concatenate([s.example_ids for s in shards])
    assert len(ids) == n and set(ids.tolist()) == set(range(n))
    with pytest.raises(ValueError, match="shard_index=3 must be in"):
        data.shard_indices(10, 3, 3)


def test_every_example_once_per_epoch_except_the_remainder(copy_ds):
    for cfg in (_cfg(), _cfg(packing=False), _cfg(packing=False, bucket_boundaries=(8, 16))):
        source, _ = data.train_source(copy_ds, TOK, cfg, num_devices=1, shard_index=0,
                                      shard_count=1)
        plan = P.plan_epoch(source._items, cfg, (24, 24), 4, epoch=1)
        items = [i for batch in plan for row in batch for i in row]
        assert len(items) == len(set(items))
        assert len(source._items) - len(items) < 4 * 24    # at most one batch's worth left


def test_bucketed_batches_take_the_smallest_width_that_fits(copy_ds):
    cfg = _cfg(packing=False, bucket_boundaries=(8, 16))
    source, _ = data.train_source(copy_ds, TOK, cfg, num_devices=1, shard_index=0, shard_count=1)
    widths = set()
    for step in range(40):
        batch = source[step]
        w = batch["inputs"].shape[-1]
        longest = int((batch["inputs_segmentation"] > 0).sum(-1).max())
        assert longest <= w and (w == 8 or longest > {16: 8, 24: 16}[w])
        widths.add(w)
    assert widths == {8, 16, 24}


def test_length_rules_are_counted_and_truncation_keeps_eos(copy_ds):
    drop, d = data.train_source(copy_ds, TOK, _cfg(max_source_length=11, max_target_length=11),
                                num_devices=1, shard_index=0, shard_count=1)
    cut, c = data.train_source(copy_ds, TOK, _cfg(max_source_length=11, max_target_length=11,
                                                  overlong="truncate"),
                               num_devices=1, shard_index=0, shard_count=1)
    lengths = np.array([len(s) + 1 for s, _ in copy_ds.examples("train", range(20_000))])
    assert d.dropped_too_long == c.truncated == int((lengths > 11).sum()) > 0
    assert d.kept + d.dropped_too_long == c.kept == 20_000
    batch = cut[0]
    for row_tokens, row_seg in zip(batch["targets"][0], batch["targets_segmentation"][0],
                                   strict=True):
        for k in set(row_seg.tolist()) - {0}:
            assert row_tokens[row_seg == k][-1] == data.EOS_ID


def test_text_is_cut_into_chunks_and_empty_lines_counted(data_dir, tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("".join(f"line {i} " * (i % 7 + 1) + "\n" for i in range(400)))
    ds = data.load_dataset("local_text", data_dir, data_files=(str(path),))
    cfg = _cfg(max_target_length=16)
    source, stats = data.train_source(ds, TOK, cfg, num_devices=1, shard_index=0, shard_count=1)
    lengths = [len(t) + 1 for (t,) in ds.examples("train", range(len(ds.split("train"))))]
    assert stats.chunks == sum(-(-n // 16) for n in lengths) > stats.kept == len(lengths)
    assert set(source[0]) == {"targets", "targets_segmentation", "targets_position"}


def test_eval_batches_cover_each_example_once_with_equal_counts(copy_ds):
    cfg = _cfg(per_device_batch_size=16)
    per_shard = [data.eval_batches(copy_ds, TOK, cfg, "test", num_devices=2, shard_index=i,
                                   shard_count=3)[0] for i in range(3)]
    assert len({len(b) for b in per_shard}) == 1
    index = np.concatenate([b["example_index"].ravel() for bs in per_shard for b in bs])
    assert sorted(index[index >= 0].tolist()) == list(range(1000))
    for bs in per_shard:
        for b in bs:
            empty = b["example_index"] < 0
            assert np.all(b["inputs"][empty] == 0)
            for r, i in zip(b["inputs"][~empty], b["example_index"][~empty], strict=True):
                assert TOK.decode(r) == copy_ds.example("test", int(i))[0]


def test_eval_batches_of_text_shards_with_unequal_chunk_counts_can_be_made_equal(data_dir,
                                                                              tmp_path):
    """Two shards of a text split, one long line (19 chunks of 16) and one short (1 chunk):
    alone each gets the batches it needs (5 and 1 of 4 rows); given the largest count (what
    processes agree on), both get 5, the extra ones all padding, every chunk in one row."""
    files = {"train.txt": "a train line\n" * 8, "test.txt": "a test line\n",
             "validation.txt": "a long line, " * 23 + "\nshort line\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    ds = data.load_dataset("local_text", data_dir, data_files=tuple(
        str(tmp_path / n) for n in ("train.txt", "validation.txt", "test.txt")))
    cfg = _cfg(per_device_batch_size=2, max_target_length=16)

    def shards(**kw):
        return [data.eval_batches(ds, TOK, cfg, "validation", num_devices=2, shard_index=i,
                                  shard_count=2, **kw)[0] for i in range(2)]

    alone = shards()
    assert sorted(len(bs) for bs in alone) == [1, 5]
    agreed = shards(num_batches=5)
    assert [len(bs) for bs in agreed] == [5, 5]
    texts = {}
    for bs, alone_bs in zip(agreed, alone, strict=True):
        chex.assert_trees_all_equal(bs[:len(alone_bs)], alone_bs)
        for b in bs[len(alone_bs):]:
            assert np.all(b["example_index"] == -1) and not np.any(b["targets"])
        for b in bs:
            for row, seg, i in zip(b["targets"].reshape(-1, 16),
                                   b["targets_segmentation"].reshape(-1, 16),
                                   b["example_index"].ravel(), strict=True):
                texts.setdefault(int(i), []).extend(row[seg > 0].tolist())
    assert texts.pop(-1) == []
    assert texts == {i: TOK.encode(ds.example("validation", i)[0]) + [data.EOS_ID]
                     for i in range(2)}
    with pytest.raises(ValueError, match="num_batches=4 is fewer than the 5 batches of 4 rows "
                                         "that shard . of 2 needs for its 19 items"):
        shards(num_batches=4)


def test_pipeline_errors_name_the_value(copy_ds):
    with pytest.raises(ValueError, match="per_device_batch_size=0 must be >= 1"):
        data.PipelineConfig(per_device_batch_size=0)
    with pytest.raises(ValueError, match="overlong='clip' must be"):
        data.PipelineConfig(per_device_batch_size=1, overlong="clip")
    with pytest.raises(ValueError, match=r"bucket_boundaries=\(16, 8\) must be increasing"):
        data.PipelineConfig(per_device_batch_size=1, bucket_boundaries=(16, 8))
    with pytest.raises(ValueError,
                       match="fewer than one batch of 40000 rows .1 processes x 4 devices"):
        data.train_source(copy_ds, TOK, _cfg(per_device_batch_size=10_000, packing=False),
                          num_devices=4, shard_index=0, shard_count=1)


# ---------------------------------------------------------------------------------------------
# The token cache: keyed by the data's contents, written whole or not at all.

def _book(tmp_path, words=("cat", "dog")) -> tuple[str, str, str]:
    """local_text files for train (30 lines of `words`), validation and test."""
    (tmp_path / "train.txt").write_text("".join(f"the {words[i % 2]} {i} sat on the mat\n"
                                                for i in range(30)))
    for name in ("validation", "test"):
        (tmp_path / f"{name}.txt").write_text(f"a {name} line\n")
    return tuple(str(tmp_path / f"{n}.txt") for n in ("train", "validation", "test"))


def _train_tokens(split: P.TokenizedSplit) -> list[list[int]]:
    return [split.tokens[0][a:b].tolist() for a, b in zip(split.offsets[0][:-1],
                                                          split.offsets[0][1:], strict=True)]


def _expected_tokens(ds) -> list[list[int]]:
    n = len(ds.split("train"))
    return [TOK.encode(t) + [data.EOS_ID] for (t,) in ds.examples("train", range(n))]


def test_an_edited_file_with_the_same_line_count_gives_new_tokens(data_dir, tmp_path):
    """The cache is keyed by the data's contents: a resumed run on an edited file trains on
    the new text, not on tokens cached from the old one."""
    files, cache = _book(tmp_path), str(tmp_path / "cache")
    old = data.load_dataset("local_text", data_dir, data_files=files)
    first = data.tokenize_split(old, "train", TOK, cache_dir=cache)
    assert _train_tokens(first) == _expected_tokens(old)
    _book(tmp_path, words=("cow", "pig"))                      # same line count, new words
    new = data.load_dataset("local_text", data_dir, data_files=files)
    assert len(new.split("train")) == len(old.split("train"))
    again = data.tokenize_split(new, "train", TOK, cache_dir=cache)
    assert _train_tokens(again) == _expected_tokens(new) != _expected_tokens(old)
    assert new.digest != old.digest
    source, _ = data.train_source(new, TOK, _cfg(per_device_batch_size=1, max_target_length=16),
                                  num_devices=1, shard_index=0, shard_count=1, cache_dir=cache)
    text = bytes(t - 4 for t in source[0]["targets"].ravel() if t >= 4).decode()
    assert ("cow" in text or "pig" in text) and "cat" not in text and "dog" not in text


def test_the_token_cache_is_written_whole_or_not_at_all(data_dir, tmp_path, monkeypatch):
    """A write that fails (a full disk) names the path and leaves nothing a later run would
    read; the next run writes the cache and reads it back."""
    ds = data.load_dataset("local_text", data_dir, data_files=_book(tmp_path))
    cache = tmp_path / "cache"
    real_save, saved = np.save, []

    def full_disk(f, array):
        if saved:
            raise OSError(28, "No space left on device")
        saved.append(f)
        real_save(f, array)

    monkeypatch.setattr(np, "save", full_disk)
    with pytest.raises(OSError, match=r"\[Errno 28\] cannot write the cache: No space left "
                                      r"on device: '.*cache/local_text-train-[0-9a-f]{16}\.tmp-"
                                      r"\d+@.*/offsets0\.npy'"):
        data.tokenize_split(ds, "train", TOK, cache_dir=str(cache))
    assert os.listdir(cache) == []                   # no cache, no temporary directory
    monkeypatch.setattr(np, "save", real_save)
    written = data.tokenize_split(ds, "train", TOK, cache_dir=str(cache))
    (entry,) = os.listdir(cache)
    assert sorted(os.listdir(cache / entry)) == ["done", "example_ids.npy", "offsets0.npy",
                                                 "tokens0.npy"]
    read = data.tokenize_split(ds, "train", TOK, cache_dir=str(cache))
    assert isinstance(read.tokens[0], np.memmap)     # read from the cache this time
    assert _train_tokens(read) == _train_tokens(written) == _expected_tokens(ds)


def test_a_damaged_or_unfinished_cache_is_not_trusted(data_dir, tmp_path):
    """A cache whose file is cut short (its `done` marker lists another size), one without
    its `done` marker, and the temporary directory of a writer that was killed are never
    read; the killed writer's directory is removed."""
    ds = data.load_dataset("local_text", data_dir, data_files=_book(tmp_path))
    cache = tmp_path / "cache"
    want = _expected_tokens(ds)
    data.tokenize_split(ds, "train", TOK, cache_dir=str(cache))
    (entry,) = os.listdir(cache)
    tokens = cache / entry / "tokens0.npy"
    tokens.write_bytes(tokens.read_bytes()[:-40])                 # cut short, `done` kept
    assert _train_tokens(data.tokenize_split(ds, "train", TOK, cache_dir=str(cache))) == want
    assert os.listdir(cache) == [entry] and os.path.getsize(tokens) > 0
    os.remove(cache / entry / "done")
    (cache / entry / "offsets0.npy").write_bytes(b"\x93NUMPY")    # half-written, no marker
    assert _train_tokens(data.tokenize_split(ds, "train", TOK, cache_dir=str(cache))) == want
    assert (cache / entry / "done").exists()
    # A writer killed mid-way left its temporary directory (with wrong tokens in it).
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftover = cache / f"{entry}.tmp-{dead.pid}@{socket.gethostname()}-abc123"
    shutil.copytree(cache / entry, leftover)
    np.save(leftover / "tokens0.npy", np.zeros(10, np.uint16))
    shutil.rmtree(cache / entry)
    assert _train_tokens(data.tokenize_split(ds, "train", TOK, cache_dir=str(cache))) == want
    assert os.listdir(cache) == [entry]
