"""Tokenizers behind one protocol: the project's sentencepiece and byte tokenizers, and any
Hugging Face tokenizer (through `transformers.AutoTokenizer`, the optional `hf` extra).

The project's own tokenizers share these special ids (a loaded model's tokenizer and config
carry their own; nothing downstream assumes these):

    pad = 0   eos = 1   bos = 2   unk = 3

`encode(text)` gives the pieces alone; `encode(text, add_special_tokens=True)` follows the
tokenizer's own convention for a model input, as Hugging Face's do (GPT-2 adds nothing,
Llama a leading BOS, Marian and T5 a trailing EOS). The project's tokenizers carry theirs
in `add_bos` / `add_eos`, set when a model is exported with them: a decoder-only model's
prompts start with BOS (its training inputs did), an encoder-decoder's sources end in EOS.

Two sides. An encoder-decoder's targets may have a tokenizer of their own: Marian keeps
`source.spm` for what the encoder reads and `target.spm` for what the decoder writes (one
`vocab.json` maps both models' pieces to ids). `encode(text, target=True)` and
`encode_batch(texts, target=True)` encode target-side text (Hugging Face's `text_target=`),
and `decode` reads model outputs, which are target-side text. Every other tokenizer (ours,
GPT-2's, BART's, T5's) has one model, and `target` changes nothing:

    tok.encode("the cat")               # Marian: source.spm's pieces, mapped by vocab.json
    tok.encode("die Katze", target=True)   # target.spm's pieces
    tok.decode(output_ids)              # target.spm's pieces back to text

`tok.save(dir)` and `load_tokenizer(dir)` use a model directory's files: the project's
`zoo_tokenizer.json` (+ `spm.model`), or Hugging Face's.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from typing import Protocol

import sentencepiece as spm

from models.atomic import read_json
from models.errors import UserError

PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3
_SPECIALS = {PAD_ID, EOS_ID, BOS_ID}
OWN_FILE = "zoo_tokenizer.json"
_LEGACY_FILE = "tokenizer.json"          # what runs before the Hugging Face layout wrote
HF_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt",
            "spiece.model", "sentencepiece.bpe.model", "source.spm", "tokenizer.model")
HF_EXTRA = "pip install 'jax-transformer-zoo[hf]'"


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int | None
    eos_id: int | None
    bos_id: int | None
    unk_id: int | None
    mask_id: int | None            # masked LM's mask token (None: the tokenizer has none)
    mask_token: str | None         # how it is written in text ("[MASK]", "<mask>")
    special_ids: frozenset[int]    # every special id: never chosen for masking

    def encode(self, text: str, *, add_special_tokens: bool = False,
               target: bool = False) -> list[int]: ...
    def encode_batch(self, texts: Sequence[str], *,
                     target: bool = False) -> list[list[int]]: ...   # pieces only
    def decode(self, ids: Iterable[int]) -> str: ...   # target side, up to the first EOS,
                                                       # no specials
    def id_to_piece(self, ids: Iterable[int]) -> list[str]: ...
    def save(self, directory: str) -> None: ...

    @property
    def identity(self) -> str:
        """Equal for two tokenizers exactly when they map text to the same pieces, on both
        sides (caches are keyed by it)."""


def _checked_ids(ids: Iterable[int], vocab_size: int) -> list[int]:
    out = [int(i) for i in ids]
    bad = [i for i in out if not 0 <= i < vocab_size]
    if bad:
        raise UserError(f"token id {bad[0]} is outside [0, vocab_size={vocab_size})")
    return out


@dataclasses.dataclass(frozen=True)
class _OwnTokenizer:
    """The project's fixed special ids, its convention flags, and its file."""

    add_bos: bool = False
    add_eos: bool = False
    pad_id, eos_id, bos_id, unk_id = PAD_ID, EOS_ID, BOS_ID, UNK_ID
    mask_id = mask_token = None           # the byte and sentencepiece ones may have one
    kind = "?"

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset({PAD_ID, EOS_ID, BOS_ID, UNK_ID} | (
            set() if self.mask_id is None else {self.mask_id}))

    def encode(self, text: str, *, add_special_tokens: bool = False,
               target: bool = False) -> list[int]:
        del target                            # one model for both sides
        ids = self._pieces(text)
        if add_special_tokens:
            ids = [BOS_ID] * self.add_bos + ids + [EOS_ID] * self.add_eos
        return ids

    def with_specials(self, *, add_bos: bool, add_eos: bool):
        """This tokenizer with another convention for `add_special_tokens`."""
        return dataclasses.replace(self, add_bos=add_bos, add_eos=add_eos)

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

    def _save_meta(self, directory: str, **extra) -> None:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, OWN_FILE), "w") as f:
            json.dump({"kind": self.kind, "vocab_size": self.vocab_size,
                       "add_bos": self.add_bos, "add_eos": self.add_eos, **extra}, f)


@dataclasses.dataclass(frozen=True)
class ByteTokenizer(_OwnTokenizer):
    """UTF-8 bytes shifted past the specials: byte b is id b + 4; vocab_size 260.

    With `mask=True` (for masked LM) one more id, 260, is the mask token, written
    "[MASK]" in text: `encode("a [MASK] b")` gives the bytes of "a ", 260, the bytes of
    " b"; vocab_size is then 261.
    """

    mask: bool = False
    kind = "byte"
    offset = 4
    MASK_TOKEN = "[MASK]"

    @property
    def vocab_size(self) -> int:
        return 256 + self.offset + self.mask

    @property
    def mask_id(self) -> int | None:
        return 256 + self.offset if self.mask else None

    @property
    def mask_token(self) -> str | None:
        return self.MASK_TOKEN if self.mask else None

    @property
    def identity(self) -> str:
        return "byte+mask" if self.mask else "byte"

    def _pieces(self, text: str) -> list[int]:
        if not self.mask:
            return [b + self.offset for b in text.encode("utf-8")]
        out = []
        for k, part in enumerate(text.split(self.MASK_TOKEN)):
            out += [self.mask_id] * (k > 0) + [b + self.offset for b in part.encode("utf-8")]
        return out

    def encode_batch(self, texts: Sequence[str], *, target: bool = False) -> list[list[int]]:
        return [self._pieces(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        out, text = bytearray(), []
        for i in self._until_eos(ids):
            if i == self.mask_id:
                text.append(out.decode("utf-8", errors="replace") + self.MASK_TOKEN)
                out = bytearray()
            elif i >= self.offset:
                out.append(i - self.offset)
        return "".join(text) + out.decode("utf-8", errors="replace")

    def id_to_piece(self, ids: Iterable[int]) -> list[str]:
        """One label per id (for plots): printable ASCII as itself, other bytes as <0xNN>."""
        names = {PAD_ID: "<pad>", EOS_ID: "</s>", BOS_ID: "<s>", UNK_ID: "<unk>",
                 self.mask_id: self.mask_token}
        out = []
        for i in _checked_ids(ids, self.vocab_size):
            b = i - self.offset
            out.append(names.get(i) or (chr(b) if 32 <= b < 127 else f"<0x{b:02X}>"))
        return out

    def save(self, directory: str) -> None:
        self._save_meta(directory, **({"mask": True} if self.mask else {}))


@dataclasses.dataclass(frozen=True)
class SentencePieceTokenizer(_OwnTokenizer):
    """A sentencepiece model whose special ids are the project's fixed ones. Its mask
    token, if any, is the user-defined piece "[MASK]" (`train_sentencepiece(...,
    mask=True)`), which text can spell out."""

    MASK_TOKEN = "[MASK]"

    model_proto: bytes = b""            # the serialised model (what `spm.model` holds)
    kind = "sentencepiece"

    def __init__(self, model_proto: bytes, *, add_bos: bool = False, add_eos: bool = False):
        object.__setattr__(self, "model_proto", bytes(model_proto))
        object.__setattr__(self, "add_bos", add_bos)
        object.__setattr__(self, "add_eos", add_eos)
        sp = spm.SentencePieceProcessor(model_proto=self.model_proto)
        got = (sp.pad_id(), sp.eos_id(), sp.bos_id(), sp.unk_id())
        if got != (PAD_ID, EOS_ID, BOS_ID, UNK_ID):
            raise UserError(f"sentencepiece model has special ids (pad, eos, bos, unk)={got}; "
                             f"this project needs {(PAD_ID, EOS_ID, BOS_ID, UNK_ID)}")
        object.__setattr__(self, "_sp", sp)
        mask = sp.piece_to_id(self.MASK_TOKEN)
        if mask != sp.unk_id() and not sp.is_control(mask):
            object.__setattr__(self, "mask_id", mask)
            object.__setattr__(self, "mask_token", self.MASK_TOKEN)

    def with_specials(self, *, add_bos: bool, add_eos: bool) -> SentencePieceTokenizer:
        return SentencePieceTokenizer(self.model_proto, add_bos=add_bos, add_eos=add_eos)

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def identity(self) -> str:
        return f"{self.kind}:{hashlib.sha256(self.model_proto).hexdigest()}"

    def _pieces(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str], *, target: bool = False) -> list[list[int]]:
        return self._sp.encode(list(texts))

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode(self._until_eos(ids))

    def id_to_piece(self, ids: Iterable[int]) -> list[str]:
        """The piece of each id, specials included (for plots)."""
        return [self._sp.id_to_piece(i) for i in _checked_ids(ids, self.vocab_size)]

    def save(self, directory: str) -> None:
        self._save_meta(directory)
        with open(os.path.join(directory, "spm.model"), "wb") as f:
            f.write(self.model_proto)


class HFTokenizer:
    """A Hugging Face tokenizer behind the protocol. Loaded with `local_files_only` and
    never with `trust_remote_code`.

    `target=True` encodes as `tokenizer(text_target=...)` does (Marian's target.spm; the
    same pieces for tokenizers with one model), and `decode` as the target side too."""

    kind = "huggingface"
    # Where transformers' sentencepiece-based tokenizers without a `tokenizers` backend keep
    # their models (Marian: one per side); `identity` hashes them with the vocabulary.
    SENTENCEPIECE_ATTRIBUTES = ("sp_model", "spm_source", "spm_target")

    def __init__(self, tokenizer):
        self.hf = tokenizer
        self.vocab_size = len(tokenizer)
        self.pad_id, self.eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
        self.bos_id, self.unk_id = tokenizer.bos_token_id, tokenizer.unk_token_id
        self.mask_id, self.mask_token = tokenizer.mask_token_id, tokenizer.mask_token
        self.special_ids = frozenset(tokenizer.all_special_ids)
        # Marian's tokenizer with one vocab.json decodes with source.spm unless told
        # otherwise; the others take no such argument (some refuse unknown ones).
        self._decode_target = ({"use_source_tokenizer": False}
                               if hasattr(tokenizer, "spm_target") else {})

    @classmethod
    def from_directory(cls, directory: str) -> HFTokenizer:
        config = os.path.join(directory, "tokenizer_config.json")
        if os.path.exists(config) and "auto_map" in read_json(config):
            raise UserError(f"{config} has auto_map: it asks to run code from the directory, "
                             "which this project never does")
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ImportError(f"{directory} holds a Hugging Face tokenizer; reading it needs "
                              f"transformers: {HF_EXTRA}") from None
        return cls(AutoTokenizer.from_pretrained(directory, local_files_only=True,
                                                 trust_remote_code=False))

    def encode(self, text: str, *, add_special_tokens: bool = False,
               target: bool = False) -> list[int]:
        if target:
            return self.hf(text_target=text, add_special_tokens=add_special_tokens)["input_ids"]
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def encode_batch(self, texts: Sequence[str], *, target: bool = False,
                     add_special_tokens: bool = False) -> list[list[int]]:
        """Pieces only, or with `add_special_tokens` the tokenizer's own template (BART's
        `<s> x </s>`, Marian's and T5's `x </s>`)."""
        side = "text_target" if target else "text"
        return self.hf(**{side: list(texts)}, add_special_tokens=add_special_tokens)["input_ids"]

    def decode(self, ids: Iterable[int]) -> str:
        """Target-side text (what a model generates; Marian: target.spm's pieces)."""
        ids = [int(i) for i in ids]
        if self.eos_id is not None and self.eos_id in ids:
            ids = ids[:ids.index(self.eos_id)]
        return self.hf.decode(ids, skip_special_tokens=True, **self._decode_target)

    def id_to_piece(self, ids: Iterable[int]) -> list[str]:
        return self.hf.convert_ids_to_tokens(_checked_ids(ids, self.vocab_size))

    def save(self, directory: str) -> None:
        self.hf.save_pretrained(directory)

    @functools.cached_property
    def languages(self) -> dict[str, int]:
        """The language codes of a translation model's tokenizer, as transformers' takes
        them (`src_lang`, `tgt_lang`), each with its token's id: M2M-100's "es" (the token
        __es__), NLLB-200's "spa_Latn", mBART-50's "es_XX". Empty for a tokenizer without
        languages."""
        codes = getattr(self.hf, "lang_code_to_id", None)          # M2M-100's
        if isinstance(codes, dict) and codes:
            return {str(code): int(i) for code, i in codes.items()}
        if not isinstance(getattr(type(self.hf), "src_lang", None), property):
            return {}
        specials = list(getattr(self.hf, "extra_special_tokens", None) or
                        getattr(self.hf, "additional_special_tokens", None) or ())
        ids = self.hf.convert_tokens_to_ids(specials) if specials else []
        return {t: int(i) for t, i in zip(specials, ids, strict=True)
                if i is not None and i != self.unk_id}

    def language_id(self, code: str) -> int:
        """The token id of language `code` (the target language's forced first token)."""
        if not self.languages:
            raise UserError(f"the tokenizer ({type(self.hf).__name__}) names no languages: "
                            "a language code needs a translation model's (NLLB-200, M2M-100, "
                            "mBART-50); give the token id instead")
        if code not in self.languages:
            known = sorted(self.languages)
            raise UserError(f"language {code!r} is not one of the tokenizer's {len(known)} "
                            f"({', '.join(known[:6])}{', ...' if len(known) > 6 else ''})")
        return self.languages[code]

    def for_source_language(self, code: str) -> HFTokenizer:
        """This tokenizer with `code` as its source language: the language token and end
        token around each source exactly as transformers' tokenizer puts them with
        `src_lang=code` (NLLB-200, M2M-100, mBART-50: before the text; mBART-25: after)."""
        return self.for_languages(code, None)

    def for_languages(self, source: str | None, target: str | None) -> HFTokenizer:
        """This tokenizer with a source and / or target language: sources encoded as
        `src_lang=source` puts them, targets (`target=True`) as `tgt_lang=target` does
        (NLLB-200: `[code] pieces </s>` on both sides), as transformers' tokenizer encodes
        `tokenizer(source, text_target=target)` for fine-tuning. Saved, the tokenizer keeps
        both (tokenizer_config.json's src_lang and tgt_lang)."""
        for code in (source, target):
            if code is not None:
                self.language_id(code)
        hf = copy.deepcopy(self.hf)
        if target is not None:
            hf.tgt_lang = target
        if source is not None:
            hf.src_lang = source
        return HFTokenizer(hf)

    @functools.cached_property
    def identity(self) -> str:
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is not None:
            spec = backend.to_str()
        else:          # the vocabulary, and each sentencepiece model by its role
            spec = json.dumps(self.hf.get_vocab(), sort_keys=True)
            spms = {name: hashlib.sha256(sp.serialized_model_proto()).hexdigest()
                    for name in self.SENTENCEPIECE_ATTRIBUTES
                    if (sp := getattr(self.hf, name, None)) is not None}
            if spms:
                spec += json.dumps(spms, sort_keys=True)
            if getattr(self.hf, "separate_vocabs", False):      # Marian's target_vocab.json
                spec += json.dumps(self.hf.get_tgt_vocab(), sort_keys=True)
        return f"{self.kind}:{type(self.hf).__name__}:{hashlib.sha256(spec.encode()).hexdigest()}"


def load_tokenizer(directory: str, *, missing_ok: bool = False) -> Tokenizer | None:
    """The tokenizer saved in `directory`: the project's own, or a Hugging Face one.

    Raises:
        FileNotFoundError: naming the directory when it holds no tokenizer (unless
            `missing_ok`, which returns None).
    """
    own = os.path.join(directory, OWN_FILE)
    legacy = os.path.join(directory, _LEGACY_FILE)
    if not os.path.exists(own) and os.path.exists(legacy) and os.path.getsize(legacy) < 4096:
        if read_json(legacy).get("kind") in (ByteTokenizer.kind, SentencePieceTokenizer.kind):
            own = legacy
    if os.path.exists(own):
        meta = read_json(own)
        if "kind" not in meta:
            raise UserError(f"{own} names no tokenizer kind")
        flags = {"add_bos": meta.get("add_bos", False), "add_eos": meta.get("add_eos", False)}
        if meta["kind"] == ByteTokenizer.kind:
            return ByteTokenizer(mask=bool(meta.get("mask", False)), **flags)
        if meta["kind"] == SentencePieceTokenizer.kind:
            with open(os.path.join(directory, "spm.model"), "rb") as f:
                return SentencePieceTokenizer(f.read(), **flags)
        raise UserError(f"unknown tokenizer kind {meta['kind']!r} in {own}")
    if any(os.path.exists(os.path.join(directory, name)) for name in HF_FILES):
        return HFTokenizer.from_directory(directory)
    if missing_ok:
        return None
    raise FileNotFoundError(f"no tokenizer in {directory!r} (expected {OWN_FILE} or a "
                            "Hugging Face tokenizer's files)")

