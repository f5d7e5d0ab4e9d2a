"""RoPE scalings besides Llama 3's (`models.config.Llama3RopeScaling`): frozen dataclasses,
one per kind, given to `TransformerConfig.rope_scaling` as objects or as dicts with a
`kind` key (a dict without one is Llama 3's, as before).

    linear    every frequency / factor
    dynamic   NTK-aware: the base grows with the sequence past `original_max_len`; within
              it (the only lengths a config with max_len <= original_max_len sees) the
              frequencies are the unscaled ones
    yarn      frequencies ramped between interpolated (/ factor) and extrapolated by
              wavelength, and cos/sin multiplied by an attention factor
    longrope  per-frequency factors (short ones for a sequence up to `original_max_len`,
              long ones beyond), and cos/sin multiplied by an attention factor

The arithmetic is in `models.rope`; these only hold and check the values.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

from models.errors import UserError, is_int


def _number(name: str, value, *, positive: bool = True) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise UserError(f"TransformerConfig.rope_scaling.{name}={value!r} must be a number")
    if positive and not value > 0:
        raise UserError(f"TransformerConfig.rope_scaling.{name}={value!r} must be > 0")
    return float(value)


def _length(name: str, value) -> int:
    if not is_int(value) or value < 1:
        raise UserError(f"TransformerConfig.rope_scaling.{name}={value!r} must be a positive "
                         "int")
    return int(value)


def _optional(name: str, value) -> float | None:
    return None if value is None else _number(name, value)


def _set(obj, **values) -> None:
    for name, value in values.items():
        object.__setattr__(obj, name, value)


@dataclasses.dataclass(frozen=True)
class LinearRopeScaling:
    """Position interpolation: every frequency divided by `factor`."""

    factor: float

    kind = "linear"

    def __post_init__(self):
        _set(self, factor=_number("factor", self.factor))


@dataclasses.dataclass(frozen=True)
class DynamicRopeScaling:
    """Dynamic NTK scaling. transformers recomputes the base when a call's sequence grows
    past `original_max_len` (config.json's max_position_embeddings), from the longest
    sequence the module has seen so far (state kept between calls) and over the whole
    batch; no pure function of one call computes that. Up to `original_max_len` it leaves
    the frequencies unscaled, so this project computes it exactly for configs whose
    `max_len` stays within `original_max_len` (checked by TransformerConfig) and refuses
    longer ones."""

    factor: float
    original_max_len: int

    kind = "dynamic"

    def __post_init__(self):
        _set(self, factor=_number("factor", self.factor),
             original_max_len=_length("original_max_len", self.original_max_len))


@dataclasses.dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN: frequencies whose wavelength is long against `original_max_len` are divided
    by `factor`, short ones kept, a linear ramp between (by dimension, between the
    correction dims of `beta_fast` and `beta_slow` rotations, floored and ceiled when
    `truncate`); cos and sin are multiplied by `attention_factor` (None: 0.1 ln(factor) + 1,
    or the ratio of that with `mscale` and `mscale_all_dim` when both are given)."""

    factor: float
    original_max_len: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    kind = "yarn"

    def __post_init__(self):
        if not isinstance(self.truncate, bool):
            raise UserError(f"TransformerConfig.rope_scaling.truncate={self.truncate!r} must "
                             "be a bool")
        _set(self, factor=_number("factor", self.factor),
             original_max_len=_length("original_max_len", self.original_max_len),
             beta_fast=_number("beta_fast", self.beta_fast),
             beta_slow=_number("beta_slow", self.beta_slow),
             attention_factor=_optional("attention_factor", self.attention_factor),
             mscale=_optional("mscale", self.mscale),
             mscale_all_dim=_optional("mscale_all_dim", self.mscale_all_dim))

    def scale(self) -> float:
        """The factor on cos and sin."""
        if self.attention_factor is not None:
            return self.attention_factor

        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return float(mscale(self.factor, self.mscale) / mscale(self.factor,
                                                                   self.mscale_all_dim))
        return mscale(self.factor)


@dataclasses.dataclass(frozen=True)
class LongRopeScaling:
    """LongRoPE (Phi-3's long-context variants): frequency i divided by `short_factor[i]`
    for a sequence of at most `original_max_len` tokens, by `long_factor[i]` for a longer
    one (each H/2 long, H the rotary dims); cos and sin multiplied by `attention_factor`
    (None: sqrt(1 + ln(factor) / ln(original_max_len)), 1 when factor <= 1).

    Which factors a call uses (as transformers decides, from the sequence length seen):
    row b uses the long ones when its largest position in the call plus one exceeds
    `original_max_len`. transformers takes that maximum over the whole batch; here each row
    decides alone, so a row's logits never depend on the other rows (the same for a batch
    of one, or rows on the same side of `original_max_len`). Keys already cached keep the
    factors they were rotated with, as in transformers' cache. In a ragged prefill the
    row's length is the width written (its padding slots included).

    Phi3ForCausalLM's `generate` differs once: when a sequence first grows past
    `original_max_len` it drops its cache and runs the whole sequence again, so every key
    (of every layer) is then computed with the long factors. Here the cache is kept, as
    transformers' own cached forward keeps it: greedy decoding that crosses
    `original_max_len` can differ from Phi-3's `generate` after the crossing (prompts
    already past it, or sequences that stay within it, decode the same)."""

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_len: int
    factor: float = 1.0
    attention_factor: float | None = None

    kind = "longrope"

    def __post_init__(self):
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or not value:
                raise UserError(f"TransformerConfig.rope_scaling.{name}={value!r} must be a "
                                 "non-empty list of numbers")
            _set(self, **{name: tuple(_number(f"{name}[{i}]", v) for i, v in
                                      enumerate(value))})
        if len(self.short_factor) != len(self.long_factor):
            raise UserError(f"TransformerConfig.rope_scaling: short_factor has "
                             f"{len(self.short_factor)} values, long_factor "
                             f"{len(self.long_factor)}")
        _set(self, original_max_len=_length("original_max_len", self.original_max_len),
             factor=_number("factor", self.factor),
             attention_factor=_optional("attention_factor", self.attention_factor))

    def scale(self) -> float:
        if self.attention_factor is not None:
            return self.attention_factor
        if self.factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_len))


SCALINGS = {c.kind: c for c in (LinearRopeScaling, DynamicRopeScaling, YarnRopeScaling,
                                LongRopeScaling)}


def scaling_from_dict(value: dict, llama3: type):
    """A scaling from its dict: `kind` names the class (absent: `llama3`, the Llama 3
    class, whose dicts have never had one); unknown keys are named."""
    value = dict(value)
    kind = value.pop("kind", "llama3")
    cls = llama3 if kind == "llama3" else SCALINGS.get(kind)
    if cls is None:
        raise UserError(f"TransformerConfig.rope_scaling kind={kind!r} is not one of "
                         f"{['llama3', *SCALINGS]}")
    known = {f.name for f in dataclasses.fields(cls)}
    if set(value) - known:
        raise UserError(f"TransformerConfig.rope_scaling has unknown keys "
                         f"{sorted(set(value) - known)}; known: {sorted(known)}")
    try:
        return cls(**value)
    except TypeError as e:
        raise UserError(f"TransformerConfig.rope_scaling ({kind}): {e}") from None


def scaling_to_dict(scaling) -> dict:
    """The inverse of `scaling_from_dict` (JSON-ready: tuples as lists)."""
    out = {k: list(v) if isinstance(v, tuple) else v
           for k, v in dataclasses.asdict(scaling).items()}
    kind = getattr(scaling, "kind", "llama3")
    return out if kind == "llama3" else {"kind": kind, **out}
