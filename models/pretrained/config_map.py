"""A family's config map: config.json <-> TransformerConfig as one table, read both ways.

    MAP = ConfigMap(
        fields=(Field("hidden_size", "d_model"), Field("rms_norm_eps", "norm_eps", 1e-6)),
        fixed=dict(architecture="decoder_only", norm="rmsnorm", num_kv_heads=MULTI_HEAD),
        constants=dict(is_encoder_decoder=False),
        ids=SpecialIds(start="eos"))
    MAP.read(ConfigReader(hf, "llama"))   # {"d_model": ..., "norm_eps": ..., "architecture": ...,
                                          #  "pad_id": ..., "eos_id": ..., "bos_id": ...}
    MAP.write(cfg, "llama")               # {"hidden_size": ..., "rms_norm_eps": ...,
                                          #  "is_encoder_decoder": False, "bos_token_id": ...}

What a table cannot say (a value refused with a reason of its own, a field that depends on
another) the family's `config_from_hf` / `config_to_hf` add around `read` and `write`.
`SpecialIds` reads and writes the special ids of every family, from the family's defaults.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any, Literal

from models.config import TransformerConfig
from models.errors import is_int
from models.pretrained.family import REQUIRED, ConfigReader, require

DECODER_START = "decoder_start_token_id"


@dataclasses.dataclass(frozen=True)
class Derived:
    """A `ConfigMap.fixed` value that is a function of the config."""

    of: Callable[[TransformerConfig], Any]


MULTI_HEAD = Derived(lambda cfg: cfg.num_heads)        # num_kv_heads: no grouped-query attention
D_OVER_N = Derived(lambda cfg: cfg.d_model // cfg.num_heads)                 # head_dim


@dataclasses.dataclass(frozen=True)
class Field:
    """A config.json key and the TransformerConfig field it holds, the same value both ways.

    Attributes:
        key: the config.json key.
        ours: the TransformerConfig field.
        default: the value when config.json omits the key or holds null (its Hugging Face
            class's default); without one, a config.json that omits it is refused.
        cast: applied to the value read (`float` for rates that JSON may hold as 0).
    """

    key: str
    ours: str
    default: Any = REQUIRED
    cast: Callable | None = None

    def read(self, r: ConfigReader):
        value = r.take(self.key, self.default)
        return value if self.cast is None or value is None else self.cast(value)


@dataclasses.dataclass(frozen=True)
class SpecialIds:
    """A family's special ids: where config.json holds our start id, and the defaults of
    the ids it leaves out (its Hugging Face class's). One reader and one writer serve every
    family.

        BART = SpecialIds(pad=1, eos=2, start=2, start_key=DECODER_START, source_bos="start")
        BART.read(ConfigReader({}, "bart"))   # {"pad_id": 1, "eos_id": 2, "bos_id": 2}
        BART.write(cfg)                       # pad_token_id, eos_token_id,
                                              # decoder_start_token_id, bos_token_id

    A list of end ids (Llama 3) keeps its first as our `eos_id` (an empty list: None); the
    whole list is a generation default (`generation` reads it).

    An end id, or a decoder-only or encoder-only model's start id, outside [0, vocab_size)
    is a token the model never produces or reads (transformers runs such configs): it is
    dropped (None, or left out of a list of end ids) with one `UserWarning` naming it. An
    encoder-decoder's decoder start outside the vocabulary is refused: the decoder reads it.

        SpecialIds(start="eos").read(ConfigReader({"vocab_size": 10, "eos_token_id": [12, 3]},
                                                  "llama"))
        # {"pad_id": None, "eos_id": 3, "bos_id": 3}, and a warning naming eos_token_id 12

    Attributes:
        pad, eos: the defaults of pad_token_id and eos_token_id.
        start: the default of our `bos_id`: an id, None, or "pad" / "eos": the pad or end
            id as read (T5's decoder starts from pad; Qwen2 names no start token, so a
            sequence starts where a previous one ended).
        start_key: where config.json holds our `bos_id`: "bos_token_id" (a decoder-only or
            encoder-only model's first token) or `DECODER_START` (an encoder-decoder's
            decoder start, which cannot be None).
        source_bos: an encoder-decoder's `bos_token_id`, which starts the source text: the
            tokenizer adds it and the model never reads it, so reading drops it, and
            writing gives it as "start" (the start id, BART), "eos" (the end id: Whisper's
            <|endoftext|>), "null" (Marian) or "absent" (not written, T5).
        null_is_none: an explicit null in config.json stays None (T5, BERT, RoBERTa);
            otherwise it means the default, as `ConfigReader.take` reads every field.
    """

    pad: int | None = None
    eos: int | None = None
    start: int | Literal["pad", "eos"] | None = None
    start_key: str = "bos_token_id"
    source_bos: Literal["start", "eos", "null", "absent"] = "absent"
    null_is_none: bool = False

    def read(self, r: ConfigReader) -> dict:
        """{"pad_id", "eos_id", "bos_id"} of config.json; a decoder start that is None is
        refused by name."""
        pad = self._take(r, "pad_token_id", self.pad)
        vocab = r.hf.get("vocab_size")
        outside = []                                 # (key, id) of ids never produced

        def inside(key, value):
            if is_int(value) and is_int(vocab) and not 0 <= value < vocab:
                outside.append((key, value))
                return False
            return True

        eos = self._take(r, "eos_token_id", self.eos)
        if isinstance(eos, list):
            kept = [e for e in eos if inside("eos_token_id", e)]
            eos = kept[0] if kept else None
        elif not inside("eos_token_id", eos):
            eos = None
        start = self._take(r, self.start_key, pad if self.start == "pad" else
                           eos if self.start == "eos" else self.start)
        if self.start_key != DECODER_START and not inside(self.start_key, start):
            start = None
        if outside:
            shown = ", ".join(f"{key} {value}" for key, value in outside)
            warnings.warn(f"{r.model_type} config.json: {shown} outside [0, vocab_size={vocab})"
                          ": a token the model never produces; loaded without it",
                          UserWarning, stacklevel=2)
        if self.start_key == DECODER_START:
            r.take("bos_token_id", None)           # the source's start token: dropped
            if start is None:
                r.refuse(DECODER_START, None, "the decoder needs a start token; config.json "
                         "names none" + (", nor a pad token to start from"
                                         if self.start == "pad" else ""))
        return {"pad_id": pad, "eos_id": eos, "bos_id": start}

    def _take(self, r: ConfigReader, key: str, default):
        if self.null_is_none and key in r.hf:
            return r.take(key, None)
        return r.take(key, default)

    def write(self, cfg: TransformerConfig) -> dict:
        out = {"pad_token_id": cfg.pad_id, "eos_token_id": cfg.eos_id, self.start_key: cfg.bos_id}
        if self.source_bos != "absent":
            out["bos_token_id"] = {"start": cfg.bos_id, "eos": cfg.eos_id}.get(self.source_bos)
        return out


@dataclasses.dataclass(frozen=True)
class ConfigMap:
    """A family's config.json <-> TransformerConfig map.

    Attributes:
        fields: `Field`s, read and written as they are.
        fixed: our fields the model type always has, set when reading; a config to write
            must have them (`require`, which also holds every field neither here nor in
            `fields` to its `PLAIN` value). A `Derived` value, a function of the config
            (`MULTI_HEAD`, `D_OVER_N`), is checked when writing and left to
            TransformerConfig's defaults when reading.
        constants: config.json keys at the one value this project computes with: another
            value is refused by name, and the value is written.
        accepted: like `constants`, but not written (transformers' defaults, or switches
            that config.json files of earlier transformers versions hold).
        unread: config.json keys that change nothing the model computes (initialisation,
            heads the project does not build): accepted with any value, not written.
        ids: the special ids.
    """

    fields: tuple[Field, ...]
    fixed: dict = dataclasses.field(default_factory=dict)
    constants: dict = dataclasses.field(default_factory=dict)
    accepted: dict = dataclasses.field(default_factory=dict)
    unread: tuple[str, ...] = ()
    ids: SpecialIds = SpecialIds()

    def read(self, r: ConfigReader) -> dict:
        """TransformerConfig fields from config.json (not yet finished: the family reads the
        rest, then calls `r.finish()`)."""
        for key, value in {**self.constants, **self.accepted}.items():
            r.expect(key, value)
        for key in self.unread:
            r.take(key, None)
        fixed = {k: v for k, v in self.fixed.items() if not isinstance(v, Derived)}
        return {**fixed, **{f.ours: f.read(r) for f in self.fields}, **self.ids.read(r)}

    def write(self, cfg: TransformerConfig, model_type: str, **required) -> dict:
        """config.json fields of `cfg`, or `Inexpressible` naming the first field of `cfg`
        that the model type cannot express (`required` adds values the family computes)."""
        mapped = {f.ours: getattr(cfg, f.ours) for f in self.fields}       # any value
        fixed = {k: v.of(cfg) if isinstance(v, Derived) else v for k, v in self.fixed.items()}
        require(cfg, model_type, **{**mapped, **fixed, **required})
        return {**{f.key: getattr(cfg, f.ours) for f in self.fields}, **self.constants,
                **self.ids.write(cfg)}
