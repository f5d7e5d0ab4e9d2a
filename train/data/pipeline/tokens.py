"""Tokenised splits: one process's shard of a split as flat token arrays, cached by contents.

Each side of the examples is one flat array, its examples one after the other, each ending
in its end token; `offsets` says where each begins:

    texts        ["ab", "c"]                         (bytes: a=101, b=102, c=103; EOS 1)
    tokens[0]    [101 102 1 103 1]
    offsets[0]   [0 3 5]        example i is tokens[0][offsets[0][i]:offsets[0][i + 1]]

A side is tokenised as its role says (`train.data.kinds`; `encode_side`). A classification
example's label becomes its class index in the run's label order (`label_ids`).

With a `cache_dir` the arrays are saved as `.npy` files and read back memory-mapped, keyed
by the dataset's content digest, the tokenizer's identity, the roles, the split and the
shard, so edited data or another tokenizer never reads old tokens; the cache is written
whole or not at all (`train.data.cache`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from collections.abc import Sequence

import numpy as np

from models.errors import UserError
from models.tokenizer import Tokenizer
from train.data import cache as cache_lib, kinds
from train.data.datasets import Dataset, data_digest

log = logging.getLogger(__name__)

CACHE_FORMAT = 6          # in every token cache key: bump it when the cached files change


@dataclasses.dataclass
class TokenizedSplit:
    """One process's shard of a split, tokenised, every example ending in `eos_id`.

    `tokens[side][offsets[side][i]:offsets[side][i + 1]]` is example i's side (source, target
    or text). `example_ids[i]` is its index in the full split. `eos_id` is the id every
    example ends with (a sentence: its template's last id, None without one); `labels[i]`
    is a classification example's class index in the run's label order; `clips[i]` a
    speech example's (audio path, "file:line"); `weights[side]`, for a chat side, a 0/1
    flag per token (1: the assistant's, scored), aligned with `tokens[side]` (None for
    the other sides).
    """
    tokens: tuple[np.ndarray, ...]
    offsets: tuple[np.ndarray, ...]
    example_ids: np.ndarray
    eos_id: int | None
    labels: np.ndarray | None = None
    clips: list[tuple[str, str]] | None = None
    weights: tuple[np.ndarray | None, ...] | None = None

    def __len__(self) -> int:
        return len(self.example_ids)

    def lengths(self, side: int) -> np.ndarray:
        return np.diff(self.offsets[side])


def shard_indices(num_examples: int, shard_index: int, shard_count: int) -> np.ndarray:
    """Example indices of one process: `shard_index, shard_index + count, ...` (disjoint)."""
    if not 0 <= shard_index < shard_count:
        raise UserError(f"shard_index={shard_index} must be in [0, shard_count={shard_count})")
    return np.arange(shard_index, num_examples, shard_count, dtype=np.int64)


def end_id(role: kinds.Role, tokenizer: Tokenizer) -> int | None:
    """The id every example of `role` ends with: the tokenizer's EOS, or for a model input
    the id its template ends with (BERT's [SEP], RoBERTa's </s>; None when the template
    adds nothing at the end). A truncated example keeps it last.

    Raises:
        UserError: the role appends an EOS and the tokenizer has none.
    """
    if role.model_input:
        template = tokenizer.encode("", add_special_tokens=True)
        return int(template[-1]) if template else None
    if tokenizer.eos_id is None:
        raise UserError(f"the tokenizer ({tokenizer.identity[:40]}) has no end token "
                         "(eos_id None); the pipeline ends every example with one")
    return tokenizer.eos_id


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


def _applies_template(tokenizer: Tokenizer) -> bool:
    """A Hugging Face tokenizer, whose `encode_batch` takes `add_special_tokens`."""
    return getattr(tokenizer, "kind", None) == "huggingface"


def encode_side(tokenizer: Tokenizer, texts: Sequence[str], role: str | kinds.Role, *,
                prefix: Sequence[int] = ()) -> list[list[int]]:
    """One side of some examples as the model trains on them, as its `role` (a
    `kinds.Role` or its name) says: each ends with the tokenizer's EOS, after a Hugging
    Face tokenizer's own template for translation sides ("source", "target"), after the
    pieces for "text"; a "sentence" is the template alone.

        encode_side(ByteTokenizer(), ["ab"], "source")    # [[101, 102, 1]]
        encode_side(ByteTokenizer(), ["ab"], "transcript", prefix=(7, 8))
                                                          # [[7, 8, 101, 102, 1]]

    A "transcript" starts with `prefix` (Whisper's prompt after its start token).
    """
    role = kinds.role(role)
    if role.chat:
        raise UserError("a conversation is encoded by its chat template (encode_chat), "
                         "not as text")
    if role.prefixed:
        pieces = tokenizer.encode_batch(texts, target=role.target)
        return [[*map(int, prefix), *e, tokenizer.eos_id] for e in pieces]
    hugging_face = _applies_template(tokenizer)
    if role.model_input:
        if hugging_face:
            return tokenizer.encode_batch(texts, add_special_tokens=True)
        return [tokenizer.encode(t, add_special_tokens=True) for t in texts]
    template = role.template and hugging_face
    if template:
        encoded = tokenizer.encode_batch(texts, target=role.target, add_special_tokens=True)
    else:
        encoded = tokenizer.encode_batch(texts, target=role.target)
    eos = tokenizer.eos_id
    return [list(e) if e and e[-1] == eos and template else [*e, eos] for e in encoded]


def chat_start_id(template, tokenizer: Tokenizer) -> int:
    """The id a chat template's conversations begin with (Llama 3's <|begin_of_text|>,
    ChatML's <|im_start|>): the model reads it as its start token, so chat examples are
    stored without it.

    Raises:
        UserError: the template renders nothing before a user's message.
    """
    ids = tokenizer.encode(template.render([{"role": "user", "content": "x"}],
                                           add_generation_prompt=True))
    if not ids:
        raise UserError("the chat template renders a user's message as no tokens")
    return int(ids[0])


def encode_chat(tokenizer: Tokenizer, template, conversations: Sequence[str],
                example_ids: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
    """Conversations (each its messages as JSON) as chat training reads them: the
    template's ids without the first (`chat_start_id`, which every one must begin with),
    then EOS unless the template ends with it; and each id's flag, 1 on the assistant's
    (the appended EOS is not scored: the template's end of turn is).

    Raises:
        UserError: a conversation the template refuses or that begins otherwise, naming
            its example index.
    """
    import json
    start, eos = chat_start_id(template, tokenizer), tokenizer.eos_id
    out_ids, out_flags = [], []
    for text, example in zip(conversations, example_ids, strict=True):
        where = f"conversation {int(example)}"
        ids, flags = template.encode(tokenizer, json.loads(text), where=where)
        if not ids or ids[0] != start:
            raise UserError(f"{where} does not begin with the chat template's start id "
                            f"{start} (it begins with {ids[:1]})")
        ids, flags = ids[1:], flags[1:]
        if not ids or ids[-1] != eos:
            ids, flags = [*ids, eos], [*flags, 0]
        out_ids.append(ids)
        out_flags.append(flags)
    return out_ids, out_flags


def tokenize_split(dataset: Dataset, split: str, tokenizer: Tokenizer, *, shard_index: int = 0,
                   shard_count: int = 1, cache_dir: str | None = None,
                   chunk: int = 4096, text_role: str = kinds.TEXT_ROLE.name,
                   label_names: tuple[str, ...] = (), target_prefix: tuple[int, ...] = (),
                   chat_template=None) -> TokenizedSplit:
    """Tokenises this process's shard of a split (or loads it from `cache_dir`).

    Each side is encoded as its role says (`dataset.data_kind.roles(text_role)`: targets
    as the tokenizer's target side, text as `text_role`, classification examples as
    sentences, transcripts behind `target_prefix`, conversations by `chat_template` with
    their assistant flags, `encode_chat`), labels in the order of `label_names`
    (see `label_ids`), a speech example's clip by its path. The cache is keyed
    by the dataset's content `digest`, the tokenizer's `identity` (both sides' models) and
    these roles, so edited data or another tokenizer never reads old tokens. It is written
    whole or not at all, and read only when whole (see `train.data.cache`). A dataset
    without a digest (made by hand) is not cached.

    Raises:
        OSError: writing the cache failed; the message names the path.
    """
    kind = dataset.data_kind
    roles = kind.roles(text_role)
    ends = {end_id(r, tokenizer) for r in roles}
    assert len(ends) == 1, f"the sides of {kind.name} examples end alike ({roles})"
    (end,) = ends
    source = dataset.split(split)
    ids = shard_indices(len(source), shard_index, shard_count)
    labels = label_ids(dataset, split, ids, label_names) if kind.labelled else None
    clips = _clips(dataset, split, ids) if kind.audio else None
    sides = len(roles)
    chat = [r.chat for r in roles]
    if any(chat) and chat_template is None:
        raise UserError(f"dataset {dataset.name!r} holds conversations: it needs the "
                         "model's chat template (a model directory with one, or "
                         "chat_template=FILE)")
    cache = key = None
    if cache_dir and not dataset.digest:
        log.warning("dataset %r has no content digest: its tokens are not cached",
                    dataset.name)
    elif cache_dir:
        key = hashlib.sha256(repr((CACHE_FORMAT, data_digest(dataset, tokenizer),
                                   dataset.keys, tuple(r.name for r in roles), split,
                                   len(source), shard_index, shard_count,
                                   tuple(map(int, target_prefix)),
                                   chat_template.identity if any(chat) else None)
                                  ).encode()).hexdigest()
        cache = os.path.join(cache_dir, f"{dataset.name.replace('/', '_')}-{split}-{key[:16]}")
        cached = _from_arrays(cache_lib.load(cache, key), sides, end, chat)
        if cached is not None:
            return dataclasses.replace(cached, labels=labels, clips=clips)
    dtype = np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
    pieces: list[list[np.ndarray]] = [[] for _ in range(sides)]
    lengths: list[list[np.ndarray]] = [[] for _ in range(sides)]
    flagged: list[list[np.ndarray]] = [[] for _ in range(sides)]
    for start in range(0, len(ids), chunk):
        texts = dataset.examples(split, ids[start:start + chunk])
        for s in range(sides):
            if chat[s]:
                encoded, flags = encode_chat(tokenizer, chat_template, [t[s] for t in texts],
                                             ids[start:start + chunk])
                flagged[s].append(np.asarray([f for e in flags for f in e], np.uint8))
            else:
                encoded = encode_side(tokenizer, [t[s] for t in texts], roles[s],
                                      prefix=target_prefix)
            lengths[s].append(np.fromiter((len(e) for e in encoded), np.int64, len(encoded)))
            flat = [tok for e in encoded for tok in e]
            pieces[s].append(np.asarray(flat, dtype))
    tokens, offsets = [], []
    for s in range(sides):
        tokens.append(np.concatenate(pieces[s]) if pieces[s] else np.zeros(0, dtype))
        lens = np.concatenate(lengths[s]) if lengths[s] else np.zeros(0, np.int64)
        offsets.append(np.concatenate([[0], np.cumsum(lens)]).astype(np.int64))
    weights = tuple((np.concatenate(flagged[s]) if flagged[s] else np.zeros(0, np.uint8))
                    if chat[s] else None for s in range(sides)) if any(chat) else None
    out = TokenizedSplit(tuple(tokens), tuple(offsets), ids, end, labels, clips, weights)
    if cache:
        arrays = {**{f"tokens{s}.npy": out.tokens[s] for s in range(sides)},
                  **{f"offsets{s}.npy": out.offsets[s] for s in range(sides)},
                  **{f"weights{s}.npy": weights[s] for s in range(sides) if chat[s]},
                  "example_ids.npy": ids}
        cache_lib.save(cache, key, arrays)
    return out


def check_clips(data: TokenizedSplit, cfg) -> None:
    """A speech split's clips against the window of the model that reads them
    (`cfg.audio`, a `PipelineConfig`'s; `train.data.speech.check_windows`)."""
    if data.clips is not None and cfg.audio is not None:
        from train.data.speech import check_windows
        check_windows(data.clips, cfg.audio)


def _clips(dataset: Dataset, split: str, ids: np.ndarray) -> list[tuple[str, str]]:
    """(audio path, "file:line") of examples `ids` of a speech split."""
    at = dataset.keys.index(dataset.data_kind.audio_key)
    return [(ex[at], ex[at + 1]) for ex in dataset.examples(split, ids)]


def _from_arrays(arrays: dict | None, sides: int, eos_id: int | None,
                 chat: list[bool]) -> TokenizedSplit | None:
    """A cached split, or None when there is none or its arrays do not fit together."""
    if arrays is None:
        return None
    try:
        weights = (tuple(arrays[f"weights{s}.npy"] if chat[s] else None for s in range(sides))
                   if any(chat) else None)
        out = TokenizedSplit(tuple(arrays[f"tokens{s}.npy"] for s in range(sides)),
                             tuple(arrays[f"offsets{s}.npy"] for s in range(sides)),
                             arrays["example_ids.npy"], eos_id, weights=weights)
    except KeyError:
        return None
    if all(len(out.offsets[s]) == len(out) + 1 and out.offsets[s][-1] == len(out.tokens[s])
           and (not chat[s] or len(weights[s]) == len(out.tokens[s])) for s in range(sides)):
        return out
    return None
