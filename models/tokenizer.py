"""Tokenizers behind one small protocol: sentencepiece for real text, bytes for tiny tasks.

The project's own tokenizers share these special ids (a loaded checkpoint's model config
carries its own; nothing downstream assumes these):

    pad = 0   eos = 1   bos = 2   unk = 3

A tokenizer is saved into a directory (`tokenizer.json` naming the kind, plus `spm.model` for
sentencepiece) that travels with the run's checkpoints; `load_tokenizer(dir)` brings it back.
Training a sentencepiece model is the data pipeline's job (`train.data.train_sentencepiece`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from typing import Protocol

import sentencepiece as spm

PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3
_SPECIALS = {PAD_ID, EOS_ID, BOS_ID}


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    eos_id: int
    bos_id: int
    unk_id: int

    def encode(self, text: str) -> list[int]: ...
    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...
    def decode(self, ids: Iterable[int]) -> str: ...
    def id_to_piece(self, ids: Iterable[int]) -> list[str]: ...
    def save(self, directory: str) -> None: ...

    @property
    def identity(self) -> str:
        """Equal for two tokenizers exactly when they map text to the same ids (caches are
        keyed by it)."""


class _Specials:
    pad_id, eos_id, bos_id, unk_id = PAD_ID, EOS_ID, BOS_ID, UNK_ID

    @staticmethod
    def _until_eos(ids: Iterable[int]) -> list[int]:
        """Ids before the first EOS, without pad/bos: what `decode` turns into text."""
        out = []
        for i in ids:
            i = int(i)
            if i == EOS_ID:
                break
            if i not in _SPECIALS:
                out.append(i)
        return out


def _checked_ids(ids: Iterable[int], vocab_size: int) -> list[int]:
    out = [int(i) for i in ids]
    bad = [i for i in out if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside [0, vocab_size={vocab_size})")
    return out


class ByteTokenizer(_Specials):
    """UTF-8 bytes shifted past the specials: byte b is id b + 4; vocab_size 260."""

    kind = "byte"
    offset = 4
    vocab_size = 256 + offset
    identity = kind

    def encode(self, text: str) -> list[int]:
        return [b + self.offset for b in text.encode("utf-8")]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        data = bytes(i - self.offset for i in self._until_eos(ids) if i >= self.offset)
        return data.decode("utf-8", errors="replace")

    def id_to_piece(self, ids: Iterable[int]) -> list[str]:
        """One label per id (for plots): printable ASCII as itself, other bytes as <0xNN>."""
        names = {PAD_ID: "<pad>", EOS_ID: "</s>", BOS_ID: "<s>", UNK_ID: "<unk>"}
        out = []
        for i in _checked_ids(ids, self.vocab_size):
            b = i - self.offset
            out.append(names.get(i) or (chr(b) if 32 <= b < 127 else f"<0x{b:02X}>"))
        return out

    def save(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "tokenizer.json"), "w") as f:
            json.dump({"kind": self.kind, "vocab_size": self.vocab_size}, f)


class SentencePieceTokenizer(_Specials):
    """A sentencepiece model whose special ids are the project's fixed ones."""

    kind = "sentencepiece"

    def __init__(self, model_proto: bytes):
        self._proto = bytes(model_proto)
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        got = (self._sp.pad_id(), self._sp.eos_id(), self._sp.bos_id(), self._sp.unk_id())
        if got != (PAD_ID, EOS_ID, BOS_ID, UNK_ID):
            raise ValueError(f"sentencepiece model has special ids (pad, eos, bos, unk)={got}; "
                             f"this project needs {(PAD_ID, EOS_ID, BOS_ID, UNK_ID)}")
        self.vocab_size = self._sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sp.encode(list(texts))

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode(self._until_eos(ids))

    @property
    def model_proto(self) -> bytes:
        """The serialised sentencepiece model (what `spm.model` holds)."""
        return self._proto

    @property
    def identity(self) -> str:
        return f"{self.kind}:{hashlib.sha256(self._proto).hexdigest()}"

    def id_to_piece(self, ids: Iterable[int]) -> list[str]:
        """The piece of each id, specials included (for plots)."""
        return [self._sp.id_to_piece(i) for i in _checked_ids(ids, self.vocab_size)]

    def save(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "spm.model"), "wb") as f:
            f.write(self._proto)
        with open(os.path.join(directory, "tokenizer.json"), "w") as f:
            json.dump({"kind": self.kind, "vocab_size": self.vocab_size}, f)


def load_tokenizer(directory: str) -> Tokenizer:
    """The tokenizer saved by `Tokenizer.save(directory)`.

    Raises:
        FileNotFoundError: naming the directory, if no tokenizer was saved there.
    """
    meta_path = os.path.join(directory, "tokenizer.json")
    if not os.path.exists(meta_path):
        raise FileNotFoundError(f"no tokenizer in {directory!r} (expected tokenizer.json)")
    with open(meta_path) as f:
        kind = json.load(f)["kind"]
    if kind == ByteTokenizer.kind:
        return ByteTokenizer()
    if kind == SentencePieceTokenizer.kind:
        with open(os.path.join(directory, "spm.model"), "rb") as f:
            return SentencePieceTokenizer(f.read())
    raise ValueError(f"unknown tokenizer kind {kind!r} in {meta_path}")
