"""A model directory's decoding defaults: generation_config.json, read as transformers reads it.

    gen = models.load("path/to/opus-mt-en-de").generation
    gen.eos_ids, gen.start_id, gen.banned_ids, gen.num_beams     # (0,), 58100, (58100,), 4
    gen.to_json()                      # the file's contents, as `models.save` writes them

Where the settings come from (transformers v5): generation_config.json when the directory
has one, as a whole; config.json's generation fields only when it has none (old checkpoints
kept them there). The special ids are the exception: `eos_ids` and `start_id` fall back to
config.json field by field when the file does not give them, as the model config defines
them (and `eos_ids` then to the `TransformerConfig`'s eos_id).

This module reads and writes the settings, typed and checked (every id against the
vocabulary); the decoder start is the one that changes the model config
(`decoder_config`). What decoding makes of the others (a request, the settings it does not
apply) is `decode.request`'s business: `decode.DecodeRequest.from_generation(gen, config)`.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import warnings

from models.config import TransformerConfig
from models.errors import UserError, is_int
from models.pretrained.files import read_json, write_json

FILE = "generation_config.json"
# transformers' beam-search stopping rules: stop once num_beams have finished (true), a
# heuristic bound (false, its default), only when no beam can improve ("never").
EARLY_STOPPING = (True, False, "never")

# transformers' GenerationConfig fields: what config.json may hold for an old checkpoint.
FIELDS = frozenset({
    "max_length", "max_new_tokens", "min_length", "min_new_tokens", "early_stopping",
    "max_time", "stop_strings", "do_sample", "num_beams", "temperature", "top_k", "top_p",
    "min_p", "top_h", "typical_p", "epsilon_cutoff", "eta_cutoff", "repetition_penalty",
    "encoder_repetition_penalty", "length_penalty", "no_repeat_ngram_size", "bad_words_ids",
    "renormalize_logits", "forced_bos_token_id", "forced_eos_token_id",
    "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "sequence_bias", "token_healing", "guidance_scale",
    "watermarking_config", "num_return_sequences", "pad_token_id", "bos_token_id",
    "eos_token_id", "encoder_no_repeat_ngram_size", "decoder_start_token_id", "penalty_alpha",
    "dola_layers", "diversity_penalty", "num_beam_groups", "constraints", "force_words_ids",
    "forced_decoder_ids", "use_cache"})


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
    """What `generation_config.json` (or an old checkpoint's config.json) says decoding
    should default to (`decode.request` maps each field to a request's).

    Attributes:
        eos_ids: the end token(s), or None when the model names none.
        start_id: decoder_start_token_id (an encoder-decoder's first decoder input), or None.
        forced_bos_id: forced_bos_token_id: the first new token, or None.
        forced_eos_id: forced_eos_token_id: the token at the last step, or None.
        banned_ids: ids never generated (bad_words_ids of one token, suppress_tokens).
        num_beams: beam search's width, or None (transformers' default is 1).
        length_penalty: transformers' exponent alpha (score = sum / length ** alpha), or
            None (transformers' default is 1.0).
        max_length: new tokens plus the decoder's prompt (an encoder-decoder's start token,
            a decoder-only model's prompt), or None.
        max_new_tokens: new tokens, or None; it wins over max_length, as in transformers.
        min_length: like max_length, the length before which no end token is generated.
        min_new_tokens: like max_new_tokens; it wins over min_length.
        no_repeat_ngram_size: no n-gram of this size occurs twice (0 or None: off).
        repetition_penalty: CTRL's penalty (1.0 or None: off).
        renormalize_logits: a log_softmax after the constraints (beam scores), or None.
        early_stopping: beam search's stopping rule, True, False or "never"
            (`EARLY_STOPPING`), or None (transformers' default is False).
        raw: the file's fields as read (config.json's generation fields for an old
            checkpoint without the file), so that saving writes them back; a field above
            left at its default keeps raw's value when saved.
    """

    eos_ids: tuple[int, ...] | None = None
    start_id: int | None = None
    forced_bos_id: int | None = None
    forced_eos_id: int | None = None
    banned_ids: tuple[int, ...] = ()
    num_beams: int | None = None
    length_penalty: float | None = None
    max_length: int | None = None
    max_new_tokens: int | None = None
    min_length: int | None = None
    min_new_tokens: int | None = None
    no_repeat_ngram_size: int | None = None
    repetition_penalty: float | None = None
    renormalize_logits: bool | None = None
    early_stopping: bool | str | None = None
    raw: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def from_dict(cls, raw: dict, vocab_size: int, *, model_config: dict | None = None,
                  default_eos: int | None = None, where: str = FILE) -> GenerationDefaults:
        """Parses a generation config's fields, checking every id against the vocabulary.

        Args:
            raw: the generation config's fields (generation_config.json as read).
            vocab_size: ids must be in [0, vocab_size).
            model_config: config.json, for the special ids the generation config lacks.
            default_eos: the end id when neither gives one (the TransformerConfig's).
            where: the source, for error messages.

        Raises:
            UserError: naming the field, its value and what it must be (a bad_words_ids
                entry of several tokens is refused).

            >>> GenerationDefaults.from_dict({"eos_token_id": [1, 2], "bad_words_ids": [[7]],
            ...                               "num_beams": 4}, vocab_size=10).banned_ids
            (7,)
        """
        if not isinstance(raw, dict):
            raise UserError(f"{where} must hold a JSON object, got {type(raw).__name__}")
        model_config = model_config or {}
        fields = _Fields(raw, vocab_size, where)
        eos = raw.get("eos_token_id")
        if eos is None:                    # absent, or an explicit null: the model's own
            fields = _Fields({**raw, "eos_token_id": model_config.get("eos_token_id",
                                                                      default_eos)},
                             vocab_size, where)
        eos_ids = fields.end_ids(_as_tuple(model_config.get("eos_token_id")) or ())
        start = raw.get("decoder_start_token_id", model_config.get("decoder_start_token_id"))
        start_id = _Fields({"decoder_start_token_id": start}, vocab_size, where).id(
            "decoder_start_token_id")
        forced_eos = fields.ids("forced_eos_token_id")
        banned = [i for i in fields.single_token_words("bad_words_ids")
                  if i not in (eos_ids or ())]               # transformers drops end ids
        banned += [i for i in fields.ids("suppress_tokens") or () if i not in banned]
        return cls(
            eos_ids=eos_ids, start_id=start_id, forced_bos_id=fields.id("forced_bos_token_id"),
            forced_eos_id=forced_eos[0] if forced_eos and len(forced_eos) == 1 else None,
            banned_ids=tuple(dict.fromkeys(banned)),
            num_beams=fields.int("num_beams", 1), length_penalty=fields.number("length_penalty"),
            max_length=fields.int("max_length", 1), max_new_tokens=fields.int("max_new_tokens", 1),
            min_length=fields.int("min_length", 0), min_new_tokens=fields.int("min_new_tokens", 0),
            no_repeat_ngram_size=fields.int("no_repeat_ngram_size", 0),
            repetition_penalty=fields.number("repetition_penalty", positive=True),
            renormalize_logits=fields.bool("renormalize_logits"),
            early_stopping=fields.early_stopping(), raw=dict(raw))

    def to_json(self) -> dict:
        """generation_config.json's contents: `raw` with the typed fields written over it
        (a field left at its default keeps raw's value).

            GenerationDefaults(eos_ids=(1,), raw={"num_beams": 4}).to_json()
            -> {"num_beams": 4, "eos_token_id": 1}
        """
        out = dict(self.raw)
        if self.eos_ids and _as_tuple(out.get("eos_token_id")) != self.eos_ids:
            out["eos_token_id"] = self.eos_ids[0] if len(self.eos_ids) == 1 else list(self.eos_ids)
        if self.banned_ids and set(self.banned_ids) != _loose_banned(out, self.eos_ids):
            out["bad_words_ids"] = [[i] for i in self.banned_ids]
            out.pop("suppress_tokens", None)
        if self.forced_eos_id is not None and _as_tuple(out.get("forced_eos_token_id")) != (
                self.forced_eos_id,):
            out["forced_eos_token_id"] = self.forced_eos_id
        for key, value in (("decoder_start_token_id", self.start_id),
                           ("forced_bos_token_id", self.forced_bos_id),
                           ("num_beams", self.num_beams), ("length_penalty", self.length_penalty),
                           ("max_length", self.max_length), ("max_new_tokens", self.max_new_tokens),
                           ("min_length", self.min_length), ("min_new_tokens", self.min_new_tokens),
                           ("no_repeat_ngram_size", self.no_repeat_ngram_size),
                           ("repetition_penalty", self.repetition_penalty),
                           ("renormalize_logits", self.renormalize_logits),
                           ("early_stopping", self.early_stopping)):
            if value is not None:
                out[key] = value
        return out

    def decoder_config(self, config: TransformerConfig) -> TransformerConfig:
        """An encoder-decoder's config with bos_id (the decoder start) = start_id when the
        defaults give one; any other config unchanged."""
        if config.is_encoder_decoder and self.start_id is not None and \
                self.start_id != config.bos_id:
            return config.replace(bos_id=self.start_id)
        return config


def read_generation(path: str, hf: dict, config: TransformerConfig) -> GenerationDefaults:
    """A model directory's defaults: its generation_config.json, or config.json's generation
    fields when it has none (`hf`: config.json as read)."""
    file = os.path.join(path, FILE)
    if os.path.exists(file):
        raw, where = read_json(file), f"{path}: {FILE}"
    else:
        raw = {k: v for k, v in hf.items() if k in FIELDS and v is not None}
        where = f"{path}: config.json"
    return GenerationDefaults.from_dict(raw, config.vocab_size, model_config=hf,
                                        default_eos=config.eos_id, where=where)


def with_generation(path: str, hf: dict, config: TransformerConfig,
                    ) -> tuple[TransformerConfig, GenerationDefaults]:
    """`read_generation`, and the config with the decoder start it gives
    (`GenerationDefaults.decoder_config`): what `models.load` uses."""
    generation = read_generation(path, hf, config)
    return generation.decoder_config(config), generation


def generation_defaults(path: str, config: TransformerConfig) -> GenerationDefaults:
    """generation_config.json's decoding defaults (the config's eos when it has none)."""
    return read_generation(path, read_json(os.path.join(path, "config.json")), config)


def write_generation(directory: str, generation: GenerationDefaults | None) -> None:
    """Writes generation_config.json into `directory` when there is anything to write."""
    if generation is None:
        return
    contents = generation.to_json()
    if contents:
        write_json(os.path.join(directory, FILE), contents)


def _as_tuple(value) -> tuple | None:
    if value is None:
        return None
    return tuple(value) if isinstance(value, list) else (value,)


def _loose_banned(raw: dict, eos_ids) -> set:
    """The ids raw's bad_words_ids and suppress_tokens ban (unchecked: for comparisons)."""
    words = raw.get("bad_words_ids") or []
    banned = {w[0] for w in words if isinstance(w, list) and len(w) == 1} - set(eos_ids or ())
    return banned | set(raw.get("suppress_tokens") or [])


class _Fields:
    """Typed reads of a generation config's fields; each error names the field and value."""

    def __init__(self, raw: dict, vocab_size: int, where: str):
        self.raw, self.vocab_size, self.where = raw, vocab_size, where

    def _error(self, name: str, must: str) -> UserError:
        return UserError(f"{self.where}: {name}={self.raw[name]!r} must be {must}")

    def id(self, name: str) -> int | None:
        value = self.raw.get(name)
        if value is None:
            return None
        if not is_int(value):
            raise self._error(name, f"a token id (an int in [0, vocab_size={self.vocab_size}))")
        self._check_id(name, value)
        return value

    def ids(self, name: str) -> tuple[int, ...] | None:
        """An id or a list of ids, as a tuple; None (or an empty list) as None."""
        value = self.raw.get(name)
        if value is None:
            return None
        values = value if isinstance(value, list) else [value]
        if not all(is_int(v) for v in values):
            raise self._error(name, "a token id or a list of token ids")
        for v in values:
            self._check_id(name, v)
        return tuple(values) or None

    def end_ids(self, warned: tuple) -> tuple[int, ...] | None:
        """`ids("eos_token_id")` without the ids outside the vocabulary, which the model
        never produces (transformers runs such configs); a `UserWarning` names them, unless
        they are all in `warned` (config.json's end ids, which reading it named)."""
        value = self.raw.get("eos_token_id")
        values = value if isinstance(value, list) else [value]
        outside = [v for v in values if is_int(v) and not 0 <= v < self.vocab_size]
        if not outside:
            return self.ids("eos_token_id")
        if not set(outside) <= set(warned):
            warnings.warn(f"{self.where}: eos_token_id {', '.join(map(str, outside))} outside "
                          f"[0, vocab_size={self.vocab_size}): a token the model never "
                          "produces; loaded without it", UserWarning, stacklevel=4)
        kept = [v for v in values if v not in outside]
        return _Fields({"eos_token_id": kept}, self.vocab_size, self.where).ids("eos_token_id")

    def single_token_words(self, name: str) -> list[int]:
        value = self.raw.get(name)
        if value is None:
            return []
        if not isinstance(value, list) or not all(isinstance(w, list) for w in value):
            raise self._error(name, "a list of lists of token ids")
        out = []
        for word in value:
            if not word or not all(is_int(t) for t in word):
                raise self._error(name, "a list of lists of token ids")
            for t in word:
                self._check_id(name, t)
            if len(word) == 1:          # several tokens: a sequence ban, not applied
                out.append(word[0])
        return out

    def int(self, name: str, lowest: int) -> int | None:
        value = self.raw.get(name)
        if value is None:
            return None
        if not is_int(value) or value < lowest:
            raise self._error(name, f"an int >= {lowest}")
        return value

    def number(self, name: str, positive: bool = False) -> float | None:
        value = self.raw.get(name)
        if value is None:
            return None
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or value != value \
                or (positive and value <= 0):
            raise self._error(name, "a positive number" if positive else "a number")
        return float(value)

    def bool(self, name: str) -> bool | None:
        value = self.raw.get(name)
        if value is not None and not isinstance(value, bool):
            raise self._error(name, "true or false")
        return value

    def early_stopping(self) -> bool | str | None:
        """true, false or "never"; 1, "true" and the like are refused (transformers would
        read 1 as neither true nor "never": its default rule)."""
        value = self.raw.get("early_stopping")
        if value is None or isinstance(value, bool) or value == "never":
            return value
        raise self._error("early_stopping", 'true, false or "never"')

    def _check_id(self, name: str, value: int) -> None:
        if not 0 <= value < self.vocab_size:
            raise UserError(f"{self.where}: {name} {value!r} is outside [0, vocab_size="
                             f"{self.vocab_size})")

