"""One decoding request: how to decode, as one frozen value that checks itself.

    request = decode.DecodeRequest(strategy="sample", temperature=0.7, top_p=0.9,
                                   max_new_tokens=32)
    decode.run(model, params, prompts, lengths, request, rng=key)      # whatever its strategy
    decode.generate(model, params, prompts, lengths, request, rng=key)  # the same, as arrays
    request.replace(top_p=0.95)           # field by field; an unknown name is refused by name
    request.override(top_k=None)          # None skips: what a command line's unset flags are

A request holds the strategy ("greedy", "sample", "beam"), the sampling values, the token
constraints, the beam settings and the number of new tokens. Every value is concrete and
checked when the request is made (a `UserError` naming the field, its value and the rule);
a traced value goes to `decode.generate` / `decode.beam_search` as a keyword instead.
Fields that the strategy does not read are carried and unused: greedy decoding reads no
sampling value but the repetition penalty, beam search no sampling value at all, and only
beam search reads the beam settings. `generate_options()` and `beam_options()` are the
request as those calls' keyword arguments.

A model directory's generation_config.json gives a request:
`DecodeRequest.from_generation(pre.generation, pre.config, prompt_len=...)`, read as
transformers reads it (`decode.defaults` maps each setting to a field).
"""

from __future__ import annotations

import dataclasses
import difflib
import numbers

import numpy as np

from decode.beam_steps import NORMALIZATIONS, stopping_rule
from decode.checks import CONFIG_EOS, check_in_range
from decode.defaults import STRATEGIES, request_fields
from models.cache_int8 import check_kv_cache_dtype
from models.checks import is_concrete
from models.config import TransformerConfig
from models.errors import UserError, check_positive_int, is_int
from models.pretrained.generation import GenerationDefaults

_ID_SEQUENCES = (list, tuple, set, frozenset, np.ndarray)


@dataclasses.dataclass(frozen=True)
class DecodeRequest:
    """How to decode: one value for every row of every batch.

    Attributes:
        strategy: "greedy", "sample" or "beam".
        max_new_tokens: N, the new tokens per row; None leaves it to the call (a keyword).
        temperature, top_k, top_p, min_p: sampling ("sample" only): a temperature > 0 (0 is
            greedy), the k best tokens (0 off), the smallest set of mass >= top_p (1 off),
            tokens of probability >= min_p x the top one (0 off).
        repetition_penalty: CTRL's penalty on tokens already seen ("greedy" and "sample";
            1 off).
        eos_id: "config" (the model config's end token), a tuple of end ids (one id is
            made a tuple of one), or None to always generate N tokens.
        forced_bos_id, forced_eos_id: the first / the last new token, or None.
        banned_ids: ids never generated (a tuple).
        min_new_tokens: no end token before this many new tokens (0 off).
        no_repeat_ngram_size: no n-gram of this size occurs twice (0 off).
        beam_size: W, the beams ("beam" only).
        length_penalty: alpha ("beam" only): >= 0 with "gnmt", any with "hf".
        length_normalization: "gnmt", log-prob / ((5 + len) / 6) ** alpha, or "hf",
            transformers' log-prob / len ** alpha ("beam" only).
        renormalize_logits: a log_softmax again after the constraints ("beam" only).
        early_stopping: when a source's beam search stops ("beam" only), transformers'
            three rules: "never" (the default), once no alive beam can beat the W-th
            finished one, an exact stop; False (transformers' default), once W have
            finished and the W-th scores at least the best alive beam at its current
            length; True, once W have finished. A model directory's comes from its
            generation_config.json (`from_generation`).
        kv_cache_dtype: the self-attention KV cache's: "auto" (the config's dtype) or
            "int8" (int8 keys and values with a scale per token per kv head,
            `models.cache_int8`); every strategy.

    Raises:
        UserError: a value of the wrong type or out of range, naming the field, the value
            and the rule (`top_p=0 is outside (0.0, 1.0]`).
    """

    strategy: str = "greedy"
    max_new_tokens: int | None = None
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    eos_id: str | tuple[int, ...] | None = CONFIG_EOS
    forced_bos_id: int | None = None
    forced_eos_id: int | None = None
    banned_ids: tuple[int, ...] = ()
    min_new_tokens: int = 0
    no_repeat_ngram_size: int = 0
    beam_size: int = 4
    length_penalty: float = 0.6
    length_normalization: str = "gnmt"
    renormalize_logits: bool = False
    early_stopping: bool | str = "never"
    kv_cache_dtype: str = "auto"

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise UserError(f"strategy={self.strategy!r} must be one of {STRATEGIES}")
        if self.length_normalization not in NORMALIZATIONS:
            raise UserError(f"length_normalization={self.length_normalization!r} must be "
                            f"one of {NORMALIZATIONS}")
        checked = dict(
            max_new_tokens=None if self.max_new_tokens is None else check_positive_int(
                _one(self.max_new_tokens, "max_new_tokens"), "max_new_tokens"),
            temperature=_number(self.temperature, "temperature", 0.0, np.inf),
            top_k=_integer(self.top_k, "top_k"),
            top_p=_number(self.top_p, "top_p", 0.0, 1.0, lo_open=True),
            min_p=_number(self.min_p, "min_p", 0.0, 1.0, hi_open=True),
            repetition_penalty=_number(self.repetition_penalty, "repetition_penalty", 0.0,
                                       np.inf, lo_open=True, hi_open=True),
            eos_id=_end_ids(self.eos_id),
            forced_bos_id=_token_or_none(self.forced_bos_id, "forced_bos_id"),
            forced_eos_id=_token_or_none(self.forced_eos_id, "forced_eos_id"),
            banned_ids=_token_ids(self.banned_ids, "banned_ids"),
            min_new_tokens=_integer(self.min_new_tokens, "min_new_tokens"),
            no_repeat_ngram_size=_integer(self.no_repeat_ngram_size, "no_repeat_ngram_size"),
            beam_size=check_positive_int(_one(self.beam_size, "beam_size"), "beam_size"),
            length_penalty=(_number(self.length_penalty, "length_penalty", 0.0, np.inf,
                                    hi_open=True)
                            if self.length_normalization == "gnmt" else
                            _number(self.length_penalty, "length_penalty", -np.inf, np.inf,
                                    lo_open=True, hi_open=True)),
            renormalize_logits=_bool(self.renormalize_logits, "renormalize_logits"),
            early_stopping=_early_stopping(self.early_stopping),
            kv_cache_dtype=check_kv_cache_dtype(_one(self.kv_cache_dtype, "kv_cache_dtype")))
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    def replace(self, **changes) -> DecodeRequest:
        """A copy with `changes` (checked again); an unknown field is refused by name.

            DecodeRequest().replace(temprature=0.7)
            -> UserError: DecodeRequest has no field 'temprature' (did you mean 'temperature'?)
        """
        _check_names(changes)
        return dataclasses.replace(self, **changes)

    def override(self, **changes) -> DecodeRequest:
        """`replace` with the changes that are not None: a command line's unset flags are
        None and leave their field as it is (set a field to None with `replace`).

            DecodeRequest(top_k=5).override(top_k=None, top_p=0.9)   # top_k 5, top_p 0.9
        """
        _check_names(changes)
        return self.replace(**{k: v for k, v in changes.items() if v is not None})

    def generate_options(self) -> dict:
        """The request as keyword arguments of `decode.generate` ("greedy" or "sample"):
        `eos_id` always, the number of new tokens when set, and every other value that is
        not off (the sampling values only when sampling).

            DecodeRequest(max_new_tokens=8, banned_ids=(3,))
            -> {"eos_id": "config", "max_new_tokens": 8, "banned_ids": (3,)}

        Raises:
            UserError: a beam-search request (`decode.beam_search` or `decode.run` runs it).
        """
        if self.strategy == "beam":
            raise UserError("this request is beam search (strategy='beam'): decode.beam_search "
                            "or decode.run runs it, not decode.generate")
        options = self._common_options()
        if self.repetition_penalty != 1.0:
            options["repetition_penalty"] = self.repetition_penalty
        if self.strategy == "sample":
            options["temperature"] = self.temperature
            for name, off in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0)):
                if getattr(self, name) != off:
                    options[name] = getattr(self, name)
        return options

    def beam_options(self) -> dict:
        """The request as keyword arguments of `decode.beam_search` ("beam"): those of
        `generate_options` but the sampling values, and the beam settings
        (`renormalize_logits` when True, `early_stopping` when not "never").

            DecodeRequest(strategy="beam", beam_size=2, max_new_tokens=8)
            -> {"eos_id": "config", "max_new_tokens": 8, "beam_size": 2,
                "length_penalty": 0.6, "length_normalization": "gnmt"}

        Raises:
            UserError: a greedy or sampling request (`decode.generate` or `decode.run`).
        """
        if self.strategy != "beam":
            raise UserError(f"this request is strategy={self.strategy!r}, not beam search: "
                            "decode.generate or decode.run runs it (or "
                            "request.replace(strategy='beam'))")
        options = self._common_options()
        options.update(beam_size=self.beam_size, length_penalty=self.length_penalty,
                       length_normalization=self.length_normalization)
        if self.renormalize_logits:
            options["renormalize_logits"] = True
        if self.early_stopping != "never":
            options["early_stopping"] = self.early_stopping
        return options

    def _common_options(self) -> dict:
        options: dict = {"eos_id": self.eos_id}
        if self.max_new_tokens is not None:
            options["max_new_tokens"] = self.max_new_tokens
        for name in ("forced_bos_id", "forced_eos_id"):
            if getattr(self, name) is not None:
                options[name] = getattr(self, name)
        for name in ("banned_ids", "min_new_tokens", "no_repeat_ngram_size"):
            if getattr(self, name):
                options[name] = getattr(self, name)
        if self.kv_cache_dtype != "auto":
            options["kv_cache_dtype"] = self.kv_cache_dtype
        return options

    @classmethod
    def from_generation(cls, generation: GenerationDefaults, config: TransformerConfig, *,
                        prompt_len: int | None = None) -> DecodeRequest:
        """The request a model directory's decoding defaults give (`decode.defaults` maps
        each setting), with transformers' defaults where the file sets none: beam size 1,
        length penalty 1.0 under "hf" normalisation, early_stopping False.

        Args:
            generation: `models.load(path).generation`.
            config: the model's config (encoder-decoder or decoder-only).
            prompt_len: a decoder-only model's prompt length as transformers counts it (the
                batch's longest prompt); needed when max_length, min_length or
                forced_bos_token_id is set, unused for an encoder-decoder.

        Raises:
            UserError: a decoder-only setting that counts the prompt without prompt_len, or
                a max_length that leaves no new token.

            encoder-decoder, num_beams 4, max_length 142, min_length 56, forced_bos 0,
            early_stopping true
            -> DecodeRequest(strategy="beam", beam_size=4, max_new_tokens=141,
                             min_new_tokens=55, forced_bos_id=0, length_penalty=1.0,
                             length_normalization="hf", early_stopping=True, eos_id=...,
                             ...)
        """
        return cls(**request_fields(generation, config, prompt_len=prompt_len))


_FIELDS = tuple(f.name for f in dataclasses.fields(DecodeRequest))


def _check_names(changes: dict) -> None:
    """Every name is a DecodeRequest field; else a UserError naming the closest one."""
    for name in changes:
        if name not in _FIELDS:
            close = difflib.get_close_matches(name, _FIELDS, n=1)
            hint = (f" (did you mean {close[0]!r}?)" if close
                    else f"; its fields: {', '.join(_FIELDS)}")
            raise UserError(f"DecodeRequest has no field {name!r}{hint}")


# ---------------------------------------------------------------------------------------------
# The checks of one field each: a concrete value of the right type, in range.

def _concrete(value, name: str):
    """`value`, refused when traced; a concrete array as a numpy array."""
    if not is_concrete(value):
        raise UserError(f"{name} is traced: a DecodeRequest holds concrete values; give a "
                        "traced value to decode.generate / decode.beam_search as a keyword "
                        "(with strategy=decode.Strategy(...) for a sampling value)")
    return np.asarray(value) if hasattr(value, "shape") else value


def _one(value, name: str):
    """A concrete scalar (a Python or numpy one); an array of several values is refused."""
    value = _concrete(value, name)
    if isinstance(value, np.ndarray):
        if value.shape != ():
            raise UserError(f"{name} must be one value, got shape {value.shape}: per-row "
                            "values are keyword arguments of decode.generate")
        value = value.item()
    return value


def _number(value, name: str, lo, hi, *, lo_open=False, hi_open=False) -> float:
    value = _one(value, name)
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise UserError(f"{name}={value!r} must be a number")
    check_in_range(np.asarray([float(value)]), name, lo, hi, lo_open=lo_open, hi_open=hi_open)
    return float(value)


def _integer(value, name: str) -> int:
    """An int >= 0."""
    value = _one(value, name)
    if not is_int(value):
        raise UserError(f"{name}={value!r} must be an int")
    check_in_range(np.asarray([value]), name, 0, np.inf)
    return int(value)


def _bool(value, name: str) -> bool:
    value = _one(value, name)
    if not isinstance(value, (bool, np.bool_)):
        raise UserError(f"{name}={value!r} must be True or False")
    return bool(value)


def _early_stopping(value) -> bool | str:
    """True, False or "never" (`decode.beam_steps.stopping_rule` refuses anything else)."""
    value = _one(value, "early_stopping")
    stopping_rule(value)
    return bool(value) if isinstance(value, np.bool_) else value


def _token_or_none(value, name: str) -> int | None:
    if value is None:
        return None
    value = _one(value, name)
    if not is_int(value) or value < 0:
        raise UserError(f"{name}={value!r} must be None or a token id (an int >= 0)")
    return int(value)


def _token_ids(value, name: str) -> tuple[int, ...]:
    """A sequence (list, tuple, set, 1-D array) of token ids as a tuple, in its order."""
    if value is None:
        return ()
    value = _concrete(value, name)
    if isinstance(value, np.ndarray) and value.ndim != 1:
        raise UserError(f"{name} must be a sequence of int token ids, got shape {value.shape}")
    if not isinstance(value, _ID_SEQUENCES) or not all(is_int(i) for i in value):
        raise UserError(f"{name} must be a sequence of int token ids, got {value!r}")
    ids = tuple(int(i) for i in value)
    for i in ids:
        if i < 0:
            raise UserError(f"{name}: token id {i} must be >= 0")
    return ids


def _end_ids(value) -> str | tuple[int, ...] | None:
    """"config", None, or the end ids as a non-empty tuple (one id becomes a tuple of one)."""
    if value is None or (isinstance(value, str) and value == CONFIG_EOS):
        return value
    usage = "eos_id must be None, an int or a non-empty sequence of ints (or 'config')"
    value = _concrete(value, "eos_id")
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value.item()
    if is_int(value):
        value = (value,)
    elif isinstance(value, str) or not isinstance(value, _ID_SEQUENCES):
        raise UserError(f"{usage}, got {value!r}")
    ids = _token_ids(value, "eos_id")
    if not ids:
        raise UserError(usage)
    return ids
