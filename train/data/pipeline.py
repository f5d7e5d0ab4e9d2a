"""The input pipeline: tokenise, filter, pack or bucket, shuffle, shard, batch; checkpointable.

A split is tokenised once per process (and cached as memory-mapped `.npy` when given a
`cache_dir`, keyed by the dataset's content digest and the tokenizer's identity, and written
whole or not at all); after that every batch is a pure function of `(seed, step)`:

    step -> epoch, batch in epoch -> rows of example items -> numpy arrays

so the iterator's state is just the next step, and a resumed run sees exactly the batches an
uninterrupted one would have seen. grain runs that function on prefetch threads (or worker
processes) and checkpoints the position (`iterator.get_state()` / `set_state()`).

Batches are dicts of int32 arrays shaped `[R, B, W]` for `R` local devices and `B` rows per
device, with the Flax WMT example's names:

    inputs, inputs_segmentation, inputs_position      (translation, classification)
    targets, targets_segmentation, targets_position   (translation, text)
    labels                                            (classification)

An encoder-only model reads each text as its tokenizer's template makes a model input,
`encode(text, add_special_tokens=True)` (`text_role="sentence"`: BERT's `[CLS] x [SEP]`,
RoBERTa's `<s> x </s>`, ours `<s> x </s>` when made with add_bos/add_eos), with nothing
appended. A classification example's label is its class index in the run's label order
(`label_names`), written at the first position of its segment (0 elsewhere), so packed
rows carry one label per example:

    inputs                [CLS a1 a2 SEP CLS b1 SEP  0]
    inputs_segmentation   [ 1   1  1   1   2  2   2  0]
    labels                [ 3   0  0   0   1  0   0  0]    (a is class 3, b class 1)

A translation example's source is encoded as the source side of the tokenizer and its
target as the target side (`tokenizer.encode_batch(texts, target=True)`: Marian's
target.spm). A Hugging Face tokenizer applies its own template (`add_special_tokens`:
BART's `<s> x </s>`, Marian's and T5's `x </s>`), which is what transformers'
`tokenizer(source, text_target=target)` gives as `input_ids` and `labels`; the project's
tokenizers give pieces. The tokenizer's EOS is appended where the template did not end
with it, so every example ends in EOS (text examples: pieces, then EOS).

A packed row holds several examples, numbered 1, 2, ... in its segmentation
(0 is padding; masks come from it, never from a pad id), with positions restarting at 0
for each:

    targets               [a1 a2 EOS b1 EOS  0]
    targets_segmentation  [ 1  1   1  2   2  0]
    targets_position      [ 0  1   2  0   1  0]
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import sys
import threading
from collections.abc import Sequence

import grain
import numpy as np

from models.errors import UserError
from models.tokenizer import Tokenizer
from train.data import cache as cache_lib
from train.data.datasets import Dataset, data_digest

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """How examples become batches.

    Attributes:
        per_device_batch_size: rows per device per step.
        max_source_length / max_target_length: row widths, EOS included.
        packing: several examples per row (with segment ids and positions); otherwise one.
        bucket_boundaries: without packing, batch widths are the smallest boundary that holds
            the batch's longest example (fewer distinct shapes = fewer compilations); empty
            pads every batch to the maximum length.
        overlong: translation examples longer than the maximum: "drop" or "truncate" (keeping
            EOS last). Text examples are always cut into chunks of the maximum length.
        seed: shuffling seed; epoch e shuffles with (seed, e).
        pack_bins: open rows the first-fit packer tries before closing the fullest.
        num_threads / prefetch: grain read threads and prefetch buffer (batches).
        worker_count: grain worker processes (0: threads only).
        text_role: how a text example is encoded: "text" (pieces then EOS: language
            modelling) or "sentence" (the tokenizer's model-input template: encoder-only
            models). Classification examples are always sentences.
        label_names: the run's class order for classification data (a model's label
            names); empty: the dataset's own order. A label not among them is an error.
    """
    per_device_batch_size: int
    max_source_length: int = 64
    max_target_length: int = 64
    packing: bool = True
    bucket_boundaries: tuple[int, ...] = ()
    overlong: str = "drop"
    seed: int = 0
    pack_bins: int = 8
    num_threads: int = 2
    prefetch: int = 4
    worker_count: int = 0
    text_role: str = "text"
    label_names: tuple[str, ...] = ()

    def __post_init__(self):
        if self.per_device_batch_size < 1:
            raise UserError(f"per_device_batch_size={self.per_device_batch_size} must be >= 1")
        for name in ("max_source_length", "max_target_length"):
            if getattr(self, name) < 2:
                raise UserError(f"{name}={getattr(self, name)} must be >= 2 (a token and EOS)")
        if self.overlong not in ("drop", "truncate"):
            raise UserError(f"overlong={self.overlong!r} must be 'drop' or 'truncate'")
        if self.text_role not in ("text", "sentence"):
            raise UserError(f"text_role={self.text_role!r} must be 'text' or 'sentence'")
        if list(self.bucket_boundaries) != sorted(set(self.bucket_boundaries)) or any(
                b < 2 for b in self.bucket_boundaries):
            raise UserError(f"bucket_boundaries={self.bucket_boundaries} must be increasing "
                             "and >= 2")


# ---------------------------------------------------------------------------------------------
# Tokenised splits.

@dataclasses.dataclass
class TokenizedSplit:
    """One process's shard of a split, tokenised, the tokenizer's EOS (`eos_id`) appended to
    every example.

    `tokens[side][offsets[side][i]:offsets[side][i + 1]]` is example i's side (source, target
    or text). `example_ids[i]` is its index in the full split. `eos_id` is the id every
    example ends with (a sentence: its template's last id, None without one); `labels[i]`
    is a classification example's class index in the run's label order.
    """
    tokens: tuple[np.ndarray, ...]
    offsets: tuple[np.ndarray, ...]
    example_ids: np.ndarray
    eos_id: int | None
    labels: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.example_ids)

    def lengths(self, side: int) -> np.ndarray:
        return np.diff(self.offsets[side])


def shard_indices(num_examples: int, shard_index: int, shard_count: int) -> np.ndarray:
    """Example indices of one process: `shard_index, shard_index + count, ...` (disjoint)."""
    if not 0 <= shard_index < shard_count:
        raise UserError(f"shard_index={shard_index} must be in [0, shard_count={shard_count})")
    return np.arange(shard_index, num_examples, shard_count, dtype=np.int64)


CACHE_FORMAT = 5          # in every token cache key: bump it when the cached files change


def side_roles(dataset: Dataset, text_role: str = "text") -> tuple[str, ...]:
    """How each side of an example is encoded: ("source", "target") for translation (the
    target with `target=True`); (`text_role`,) for text; ("sentence",) for classification."""
    if dataset.kind == "translation":
        return ("source", "target")
    return ("sentence",) if dataset.kind == "classification" else (text_role,)


def sentence_end(tokenizer: Tokenizer) -> int | None:
    """The id a sentence's template ends with (BERT's [SEP], RoBERTa's </s>; None when
    the template adds nothing at the end): a truncated sentence keeps it last."""
    template = tokenizer.encode("", add_special_tokens=True)
    return int(template[-1]) if template else None


def label_ids(dataset: Dataset, split: str, ids: np.ndarray,
              label_names: tuple[str, ...] = ()) -> np.ndarray:
    """The class index of each example `ids` of a classification split, in the order of
    `label_names` (the dataset's own when empty).

    Raises:
        UserError: a label of the data that `label_names` lacks, naming both.
    """
    labels = np.asarray(dataset.label_ids(split, ids), np.int32)
    if not label_names or tuple(label_names) == tuple(dataset.label_names):
        return labels
    order = {name: i for i, name in enumerate(label_names)}
    unknown = [n for n in dataset.label_names if n not in order]
    if unknown:
        raise UserError(f"dataset {dataset.name!r} has label(s) {unknown} that the model's "
                         f"labels {list(label_names)} do not name")
    remap = np.asarray([order[n] for n in dataset.label_names], np.int32)
    return remap[labels]


def encode_side(tokenizer: Tokenizer, texts: Sequence[str], role: str) -> list[list[int]]:
    """One side of some examples as the model trains on them (see the module docstring):
    each ends with the tokenizer's EOS, after a Hugging Face tokenizer's own template for
    translation sides ("source", "target"), after the pieces for "text"; a "sentence" is
    the template alone."""
    if role == "sentence":
        if getattr(tokenizer, "kind", None) == "huggingface":
            return tokenizer.encode_batch(texts, add_special_tokens=True)
        return [tokenizer.encode(t, add_special_tokens=True) for t in texts]
    template = role != "text" and getattr(tokenizer, "kind", None) == "huggingface"
    if template:
        encoded = tokenizer.encode_batch(texts, target=role == "target",
                                         add_special_tokens=True)
    else:
        encoded = tokenizer.encode_batch(texts, target=role == "target")
    eos = tokenizer.eos_id
    return [list(e) if e and e[-1] == eos and template else [*e, eos] for e in encoded]


def tokenize_split(dataset: Dataset, split: str, tokenizer: Tokenizer, *, shard_index: int = 0,
                   shard_count: int = 1, cache_dir: str | None = None,
                   chunk: int = 4096, text_role: str = "text",
                   label_names: tuple[str, ...] = ()) -> TokenizedSplit:
    """Tokenises this process's shard of a split (or loads it from `cache_dir`).

    Targets are encoded as the target side (`encode_batch(..., target=True)`), sources and
    text as the source side; text as `text_role` says and classification examples as
    sentences, with their labels in the order of `label_names` (see `label_ids`). The cache
    is keyed by the dataset's content `digest`, the tokenizer's `identity` (both sides'
    models) and these roles, so edited data or another tokenizer never reads old tokens.
    It is written whole or not at all, and read only when whole (see `train.data.cache`).
    A dataset without a digest (made by hand) is not cached.

    Raises:
        OSError: writing the cache failed; the message names the path.
    """
    roles = side_roles(dataset, text_role)
    if roles != ("sentence",) and tokenizer.eos_id is None:
        raise UserError(f"the tokenizer ({tokenizer.identity[:40]}) has no end token "
                         "(eos_id None); the pipeline ends every example with one")
    end_id = sentence_end(tokenizer) if roles == ("sentence",) else tokenizer.eos_id
    source = dataset.split(split)
    ids = shard_indices(len(source), shard_index, shard_count)
    labels = (label_ids(dataset, split, ids, label_names) if dataset.kind == "classification"
              else None)
    sides = len(roles)
    cache = key = None
    if cache_dir and not dataset.digest:
        log.warning("dataset %r has no content digest: its tokens are not cached",
                    dataset.name)
    elif cache_dir:
        key = hashlib.sha256(repr((CACHE_FORMAT, data_digest(dataset, tokenizer),
                                   dataset.keys, roles, split, len(source), shard_index,
                                   shard_count)).encode()).hexdigest()
        cache = os.path.join(cache_dir, f"{dataset.name.replace('/', '_')}-{split}-{key[:16]}")
        cached = _from_arrays(cache_lib.load(cache, key), sides, end_id)
        if cached is not None:
            return dataclasses.replace(cached, labels=labels)
    dtype = np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
    pieces: list[list[np.ndarray]] = [[] for _ in range(sides)]
    lengths: list[list[np.ndarray]] = [[] for _ in range(sides)]
    for start in range(0, len(ids), chunk):
        texts = dataset.examples(split, ids[start:start + chunk])
        for s in range(sides):
            encoded = encode_side(tokenizer, [t[s] for t in texts], roles[s])
            lengths[s].append(np.fromiter((len(e) for e in encoded), np.int64, len(encoded)))
            flat = [tok for e in encoded for tok in e]
            pieces[s].append(np.asarray(flat, dtype))
    tokens, offsets = [], []
    for s in range(sides):
        tokens.append(np.concatenate(pieces[s]) if pieces[s] else np.zeros(0, dtype))
        lens = np.concatenate(lengths[s]) if lengths[s] else np.zeros(0, np.int64)
        offsets.append(np.concatenate([[0], np.cumsum(lens)]).astype(np.int64))
    out = TokenizedSplit(tuple(tokens), tuple(offsets), ids, end_id, labels)
    if cache:
        arrays = {**{f"tokens{s}.npy": out.tokens[s] for s in range(sides)},
                  **{f"offsets{s}.npy": out.offsets[s] for s in range(sides)},
                  "example_ids.npy": ids}
        cache_lib.save(cache, key, arrays)
    return out


def _from_arrays(arrays: dict | None, sides: int, eos_id: int) -> TokenizedSplit | None:
    """A cached split, or None when there is none or its arrays do not fit together."""
    if arrays is None:
        return None
    try:
        out = TokenizedSplit(tuple(arrays[f"tokens{s}.npy"] for s in range(sides)),
                             tuple(arrays[f"offsets{s}.npy"] for s in range(sides)),
                             arrays["example_ids.npy"], eos_id)
    except KeyError:
        return None
    if all(len(out.offsets[s]) == len(out) + 1 and out.offsets[s][-1] == len(out.tokens[s])
           for s in range(sides)):
        return out
    return None


# ---------------------------------------------------------------------------------------------
# Items: what survives the length rules.

@dataclasses.dataclass
class DataStats:
    """What the length rules did to one shard of a split (each rule counted on its own)."""
    examples: int = 0
    kept: int = 0
    dropped_empty: int = 0
    dropped_too_long: int = 0
    truncated: int = 0
    chunks: int = 0

    def summary(self) -> str:
        parts = [f"{self.kept}/{self.examples} examples kept"]
        for name in ("dropped_empty", "dropped_too_long", "truncated"):
            if getattr(self, name):
                parts.append(f"{getattr(self, name)} {name.replace('_', ' ')}")
        if self.chunks:
            parts.append(f"{self.chunks} chunks")
        return ", ".join(parts)


@dataclasses.dataclass
class Items:
    """Rows to draw from: per side, a start offset and length into the tokens; the example."""
    example: np.ndarray
    starts: tuple[np.ndarray, ...]
    lengths: tuple[np.ndarray, ...]

    def __len__(self) -> int:
        return len(self.example)


def select_items(data: TokenizedSplit, kind: str, max_lengths: tuple[int, ...],
                 overlong: str) -> tuple[Items, DataStats]:
    """Applies the length rules: drop empty, drop or truncate long pairs, chunk long text."""
    stats = DataStats(examples=len(data))
    if kind == "text":
        starts, lens, example = [], [], []
        (max_len,) = max_lengths
        lengths = data.lengths(0)
        empty = lengths <= 1
        stats.dropped_empty = int(empty.sum())
        for i in np.flatnonzero(~empty):
            for off in range(0, int(lengths[i]), max_len):
                starts.append(data.offsets[0][i] + off)
                lens.append(min(max_len, int(lengths[i]) - off))
                example.append(i)
        stats.kept = len(data) - stats.dropped_empty
        stats.chunks = len(example)
        return Items(np.asarray(example, np.int64), (np.asarray(starts, np.int64),),
                     (np.asarray(lens, np.int64),)), stats
    lengths = [data.lengths(s) for s in range(len(max_lengths))]
    empty = np.zeros(len(data), bool)
    long = np.zeros(len(data), bool)
    for s, max_len in enumerate(max_lengths):
        empty |= lengths[s] <= 1
        long |= lengths[s] > max_len
    long &= ~empty
    stats.dropped_empty = int(empty.sum())
    if overlong == "drop":
        keep = ~empty & ~long
        stats.dropped_too_long = int(long.sum())
    else:
        keep = ~empty
        stats.truncated = int(long.sum())
    stats.kept = int(keep.sum())
    idx = np.flatnonzero(keep)
    return Items(idx, tuple(data.offsets[s][:-1][idx] for s in range(len(max_lengths))),
                 tuple(np.minimum(lengths[s][idx], m) for s, m in enumerate(max_lengths))), stats


# ---------------------------------------------------------------------------------------------
# Epoch plans: which items go in which row of which batch.

def epoch_rng(seed: int, epoch: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch])


def pack_rows(order: np.ndarray, lengths: tuple[np.ndarray, ...], max_lengths: tuple[int, ...],
              bins: int) -> list[list[int]]:
    """First-fit packing of items (in `order`) into rows, trying at most `bins` open rows.

    When no open row has room, the fullest open row is closed. Rows come out in the order
    they close, then the open ones.
    """
    rows: list[list[int]] = []
    open_rows: list[list[int]] = []
    used: list[list[int]] = []
    sides = range(len(max_lengths))
    for item in order:
        need = [int(lengths[s][item]) for s in sides]
        for r, u in enumerate(used):
            if all(u[s] + need[s] <= max_lengths[s] for s in sides):
                open_rows[r].append(int(item))
                for s in sides:
                    u[s] += need[s]
                break
        else:
            if len(open_rows) == bins:
                fullest = max(range(bins), key=lambda r: sum(used[r]))
                rows.append(open_rows.pop(fullest))
                used.pop(fullest)
            open_rows.append([int(item)])
            used.append(need)
    return rows + open_rows


def plan_epoch(items: Items, cfg: PipelineConfig, max_lengths: tuple[int, ...],
               rows_per_batch: int, epoch: int) -> list[list[list[int]]]:
    """The batches of one epoch: each a list of `rows_per_batch` rows of item indices.

    The last incomplete batch is left out of this epoch (its items are reshuffled into the
    next). Packing and bucketing only reorder and group; each item appears once per epoch.
    """
    rng = epoch_rng(cfg.seed, epoch)
    order = rng.permutation(len(items))
    if cfg.packing:
        rows = pack_rows(order, items.lengths, max_lengths, cfg.pack_bins)
    elif cfg.bucket_boundaries:
        window = rows_per_batch * 64
        longest = np.max(np.stack(items.lengths), axis=0)
        rows = []
        for w in range(0, len(order), window):
            chunk = order[w:w + window]
            rows += [[int(i)] for i in chunk[np.argsort(longest[chunk], kind="stable")]]
    else:
        rows = [[int(i)] for i in order]
    batches = [rows[b:b + rows_per_batch]
               for b in range(0, len(rows) - rows_per_batch + 1, rows_per_batch)]
    if cfg.bucket_boundaries and not cfg.packing:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


def assemble(tokens: tuple[np.ndarray, ...], items: Items, rows: list[list[int]],
             widths: tuple[int, ...], names: tuple[str, ...], end_id: int | None,
             labels: np.ndarray | None = None) -> dict:
    """Numpy arrays `[rows, width]` for each side: tokens, segmentation and positions.
    With `end_id`, every item's last token is set to it (a truncated translation example
    still ends in EOS). With `labels` (one per example), `labels` `[rows, width]` holds each
    item's label at its first position."""
    out = {}
    if labels is not None:
        lab = np.zeros((len(rows), widths[0]), np.int32)
        for r, row in enumerate(rows):
            col = 0
            for item in row:
                lab[r, col] = labels[items.example[item]]
                col += int(items.lengths[0][item])
        out["labels"] = lab
    for s, (name, width) in enumerate(zip(names, widths, strict=True)):
        tok = np.zeros((len(rows), width), np.int32)
        seg = np.zeros((len(rows), width), np.int32)
        pos = np.zeros((len(rows), width), np.int32)
        for r, row in enumerate(rows):
            col = 0
            for k, item in enumerate(row, start=1):
                start, n = int(items.starts[s][item]), int(items.lengths[s][item])
                tok[r, col:col + n] = tokens[s][start:start + n]
                if end_id is not None:
                    tok[r, col + n - 1] = end_id
                seg[r, col:col + n] = k
                pos[r, col:col + n] = np.arange(n)
                col += n
        out[name] = tok
        out[f"{name}_segmentation"] = seg
        out[f"{name}_position"] = pos
    return out


def _bucket(length: int, boundaries: tuple[int, ...], max_len: int) -> int:
    for b in boundaries:
        if length <= b <= max_len:
            return b
    return max_len


# ---------------------------------------------------------------------------------------------
# The random-access batch source that grain iterates.

class BatchSource:
    """`source[step]` is this process's part of the batch of global step `step` (endless).

    Every process plans the same global batches over the whole split; process `i` of `n`
    takes rows `[i * rows, (i + 1) * rows)` of each. The processes' rows are disjoint, together
    they are exactly the batch a single process would see, so a multi-host run trains on the
    same data as one host with as many devices.

    Epoch plans are computed on demand and cached; the number of batches per epoch may differ
    between epochs when packing, so step -> (epoch, batch) walks cumulative counts.
    """

    def __init__(self, data: TokenizedSplit, items: Items, kind: str, cfg: PipelineConfig,
                 num_devices: int, shard_index: int = 0, shard_count: int = 1):
        if len(items) == 0:
            raise UserError("no examples left to batch after the length rules")
        if not 0 <= shard_index < shard_count:
            raise UserError(f"shard_index={shard_index} must be in [0, shard_count="
                             f"{shard_count})")
        self._data, self._items, self._cfg = data, items, cfg
        self._devices = num_devices
        self._rows = num_devices * cfg.per_device_batch_size       # this process's rows
        self._shard = shard_index
        self._global_rows = self._rows * shard_count
        self._names = side_names(kind)
        self._max = _max_lengths(kind, cfg)
        self._end_id = None if kind == "text" else data.eos_id
        self._lock = threading.Lock()
        self._starts = [0]            # first step of each epoch computed so far
        self._plans: dict[int, list] = {}
        if not self._plan(0):
            raise UserError(f"an epoch has {len(items)} usable examples, fewer than one batch "
                             f"of {self._global_rows} rows ({shard_count} processes x "
                             f"{num_devices} devices x {cfg.per_device_batch_size})")

    def __len__(self) -> int:
        return sys.maxsize

    def __getstate__(self) -> dict:     # pickled into grain's worker processes
        state = dict(self.__dict__)
        del state["_lock"]
        state["_plans"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _plan(self, epoch: int) -> list:
        with self._lock:
            if epoch not in self._plans:
                if len(self._plans) >= 2:
                    self._plans.pop(min(self._plans))
                self._plans[epoch] = plan_epoch(self._items, self._cfg, self._max,
                                                self._global_rows, epoch)
            return self._plans[epoch]

    def locate(self, step: int) -> tuple[int, int]:
        """(epoch, batch within epoch) of a global step."""
        while True:
            with self._lock:
                starts = list(self._starts)
            e = int(np.searchsorted(starts, step, side="right")) - 1
            if e < len(starts) - 1:
                return e, step - starts[e]
            last = len(starts) - 1
            count = len(self._plan(last))
            if step < starts[last] + count:
                return last, step - starts[last]
            with self._lock:
                if len(self._starts) == last + 1:
                    self._starts.append(starts[last] + count)

    def __getitem__(self, step: int) -> dict:
        epoch, b = self.locate(int(step))
        rows = self._plan(epoch)[b][self._shard * self._rows:(self._shard + 1) * self._rows]
        widths = self._max
        if self._cfg.bucket_boundaries and not self._cfg.packing:
            widths = tuple(_bucket(max(int(self._items.lengths[s][r[0]]) for r in rows),
                                   self._cfg.bucket_boundaries, m)
                           for s, m in enumerate(self._max))
        batch = assemble(self._data.tokens, self._items, rows, widths, self._names,
                         self._end_id, self._data.labels)
        return {k: v.reshape(self._devices, -1, v.shape[-1]) for k, v in batch.items()}


def _mark_absl_flags_parsed() -> None:
    """grain's worker processes read absl flags; under pytest or a script nobody parsed them."""
    from absl import flags
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def train_iterator(source: BatchSource, cfg: PipelineConfig) -> grain.DatasetIterator:
    """An endless, checkpointable iterator over `source` (`get_state()` / `set_state()`)."""
    ds = grain.MapDataset.source(source).to_iter_dataset(
        grain.ReadOptions(num_threads=cfg.num_threads, prefetch_buffer_size=cfg.prefetch))
    if cfg.worker_count:
        _mark_absl_flags_parsed()
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.worker_count))
    return iter(ds)


# ---------------------------------------------------------------------------------------------
# Entry points.

def _shard_defaults(shard_index, shard_count, num_devices):
    import jax
    return (jax.process_index() if shard_index is None else shard_index,
            jax.process_count() if shard_count is None else shard_count,
            jax.local_device_count() if num_devices is None else num_devices)


def _max_lengths(kind: str, cfg: PipelineConfig) -> tuple[int, ...]:
    """Each side's row width: a classification sentence is as long as a source."""
    return {"translation": (cfg.max_source_length, cfg.max_target_length),
            "classification": (cfg.max_source_length,)}.get(kind, (cfg.max_target_length,))


def side_names(kind: str) -> tuple[str, ...]:
    """The batch names of each side: what the model reads first is `inputs`."""
    return {"translation": ("inputs", "targets"),
            "classification": ("inputs",)}.get(kind, ("targets",))


def train_source(dataset: Dataset, tokenizer: Tokenizer, cfg: PipelineConfig, *,
                 split: str = "train", num_devices: int | None = None,
                 shard_index: int | None = None, shard_count: int | None = None,
                 cache_dir: str | None = None) -> tuple[BatchSource, DataStats]:
    """The endless training batches of this process, and what the length rules did.

    Shards default to `jax.process_index()` of `jax.process_count()`; devices to
    `jax.local_device_count()`. See `BatchSource` for how processes split each batch.
    """
    shard_index, shard_count, num_devices = _shard_defaults(shard_index, shard_count,
                                                            num_devices)
    data = tokenize_split(dataset, split, tokenizer, cache_dir=cache_dir,
                          text_role=cfg.text_role, label_names=cfg.label_names)
    items, stats = select_items(data, dataset.kind, _max_lengths(dataset.kind, cfg),
                                cfg.overlong)
    return BatchSource(data, items, dataset.kind, cfg, num_devices, shard_index,
                       shard_count), stats


def _agreed_batches(needed: int, shard_count: int, dataset: Dataset, tokenizer: Tokenizer,
                    split: str) -> int:
    """`needed`; when the shards are the processes (`shard_count == jax.process_count() > 1`),
    the largest `needed` of all processes: a collective, so every process must call it.

    The processes also compare what they read (the split's size, the dataset's digest and
    the tokenizer's identity): processes with other data would plan other batches, so all of
    them stop with the same error instead.

    Raises:
        UserError: the processes read different data (on every process).
    """
    import jax
    if not shard_count == jax.process_count() > 1:
        return needed
    from jax.experimental import multihost_utils
    size = len(dataset.split(split))
    digest = hashlib.sha256(repr((dataset.digest, dataset.keys, tokenizer.identity, split,
                                  size)).encode()).digest()
    mine = np.array([needed, size, *np.frombuffer(digest[:8], np.int32)], np.int32)
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, len(mine))
    if np.any(every[:, 1:] != mine[1:]):
        seen = "; ".join(f"process {p}: {row[1]} examples, digest "
                         f"{row[2:].astype(np.int32).tobytes().hex()}"
                         for p, row in enumerate(every))
        raise UserError(f"the processes read different data for split {split!r} of "
                         f"{dataset.name!r} ({seen}); every process must read the same files "
                         "(data_files, data_dir) with the same tokenizer")
    return int(every[:, 0].max())


def eval_batches(dataset: Dataset, tokenizer: Tokenizer, cfg: PipelineConfig, split: str, *,
                 num_devices: int | None = None, shard_index: int | None = None,
                 shard_count: int | None = None, num_batches: int | None = None,
                 cache_dir: str | None = None) -> tuple[list[dict], DataStats]:
    """One pass over this process's shard of a split in order, one item per row, no shuffling.

    Every eval step is a collective over all devices of all processes, so every process must
    get the same number of batches, the last ones padded with empty rows (all zeros) whose
    `example_index` is -1. Batches carry `example_index` `[R, B]`: each row's index in the
    full split (the reference to score against; a text example cut into several chunks
    gives several rows with its index).

    How many batches: translation examples are one row each, so the largest shard's example
    count (from the split's size, the same in every process) fixes it. Text examples are cut
    into chunks of `max_target_length`, and how many a shard gets depends on its texts:

        shard 0: one 300-token line -> 19 chunks of 16 -> 5 batches of 4 rows
        shard 1: one 11-token line  ->  1 chunk         -> 1 batch, then 4 all-padding ones

    Translation shards are sized from the split's length alone, so they agree unless the
    processes read different data or have different numbers of local devices. When the
    shards are the processes (`shard_count == jax.process_count() > 1`, the default there),
    they therefore agree on the largest count through a collective, for both kinds, and check
    that they all read the same data (an error on every process if not; see
    `_agreed_batches`), so every process must call this; otherwise each shard gets the
    batches it needs unless given `num_batches`.

    Args:
        num_devices / shard_index / shard_count: default to `jax.local_device_count()`,
            `jax.process_index()` and `jax.process_count()`.
        num_batches: the number of batches instead, the same for every shard (at least what
            this shard needs); for several shards batched in one process.
    """
    shard_index, shard_count, num_devices = _shard_defaults(shard_index, shard_count,
                                                            num_devices)
    data = tokenize_split(dataset, split, tokenizer, shard_index=shard_index,
                          shard_count=shard_count, cache_dir=cache_dir,
                          text_role=cfg.text_role, label_names=cfg.label_names)
    max_lengths = _max_lengths(dataset.kind, cfg)
    items, stats = select_items(data, dataset.kind, max_lengths, cfg.overlong)
    rows_per_batch = num_devices * cfg.per_device_batch_size
    # Rows to hold: this shard's chunks (text); the largest shard's examples (translation,
    # classification: ceil(N / shard_count), the same in every process).
    rows_needed = (len(items) if dataset.kind == "text"
                   else -(-len(dataset.split(split)) // shard_count))
    needed = max(1, -(-rows_needed // rows_per_batch))
    if num_batches is None:
        num_batches = _agreed_batches(needed, shard_count, dataset, tokenizer, split)
    elif num_batches < needed:
        raise UserError(f"num_batches={num_batches} is fewer than the {needed} batches of "
                         f"{rows_per_batch} rows that shard {shard_index} of {shard_count} "
                         f"needs for its {len(items)} items of split {split!r}")
    names = side_names(dataset.kind)
    batches = []
    for b in range(num_batches):
        rows = [[i] for i in range(b * rows_per_batch, min(len(items), (b + 1) * rows_per_batch))]
        index = np.full(rows_per_batch, -1, np.int32)
        index[:len(rows)] = data.example_ids[items.example[[r[0] for r in rows]]] if rows else []
        rows += [[]] * (rows_per_batch - len(rows))
        batch = assemble(data.tokens, items, rows, max_lengths, names,
                         None if dataset.kind == "text" else data.eos_id, data.labels)
        batch["example_index"] = index
        batches.append({k: v.reshape(num_devices, -1, *v.shape[1:]) for k, v in batch.items()})
    return batches, stats
