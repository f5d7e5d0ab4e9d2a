"""Rules for config values, and `Part`: a frozen dataclass whose fields check themselves.

A part of the run config (`train.settings`) declares each key once, as a field with its
default and its rule; making the part checks every field, then the rules between its own
fields (`Part.check`):

    @dataclasses.dataclass(frozen=True)
    class Loop(Part):
        num_train_steps: int = setting(1000, integer(0))
        log_every_steps: int = setting(50, integer(1))

    Loop(num_train_steps=-1)    # UserError: num_train_steps=-1 must be an int >= 0

Each message has the shape `KEY=VALUE must be RULE` (or `KEY=VALUE: WHAT IS WRONG`), e.g.

    num_train_steps=-1 must be an int >= 0
    lr_decay='linear' must be one of 'rsqrt', 'cosine', 'constant'
    data_files='data/': 'data/' is a directory, not a file

A part nested under a key of its own (`scheduled_sampling.*`) sets `prefix`, so its
messages name the whole key (`scheduled_sampling.k=2.0 must be ...`).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import types
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import numpy as np

from models.errors import UserError, is_int

MISSING_HINT = "every config starts from train.configs._base.base_config()"


class Rule:
    """One key's rule: `rule(value)` is None, or what the value must be."""

    def __init__(self, text: str, ok: Callable[[Any], bool]):
        self._text, self.ok = text, ok

    @property
    def text(self) -> str:
        return self._text

    def __call__(self, value) -> str | None:
        return None if self.ok(value) else f"must be {self.text}"


class Lazy(Rule):
    """A rule whose text needs an import (the model presets, the dataset names)."""

    def __init__(self, text: Callable[[], str], ok: Callable[[Any], bool]):
        self._make_text, self.ok = text, ok

    @property
    def text(self) -> str:
        return self._make_text()


def _is_int(v) -> bool:
    return is_int(v) and not isinstance(v, np.bool_)


def _is_number(v) -> bool:
    return (isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))
            and math.isfinite(v))


def integer(low: int, high: int | None = None) -> Rule:
    text = f"an int >= {low}" if high is None else f"an int in [{low}, {high}]"
    return Rule(text, lambda v: _is_int(v) and v >= low and (high is None or v <= high))


def number(text: str, ok: Callable[[float], bool]) -> Rule:
    return Rule(f"a number {text}", lambda v: _is_number(v) and ok(v))


def choice(*values: str) -> Rule:
    return Rule("one of " + ", ".join(map(repr, values)),
                lambda v: isinstance(v, str) and v in values)


def boolean() -> Rule:
    return Rule("a bool (true or false)", lambda v: isinstance(v, (bool, np.bool_)))


def string() -> Rule:
    return Rule("a string", lambda v: isinstance(v, str))


def mapping(text: str) -> Rule:
    return Rule(text, lambda v: isinstance(v, Mapping))


def _float_dtype(v) -> bool:
    import jax.numpy as jnp
    if not isinstance(v, str):
        return False
    try:
        return bool(jnp.issubdtype(jnp.dtype(v), jnp.floating))
    except TypeError:
        return False


def float_dtype() -> Rule:
    return Rule("a float dtype name ('float32', 'bfloat16', 'float16')", _float_dtype)


def _address(v) -> bool:
    if not isinstance(v, str):
        return False
    if not v:
        return True
    host, _, port = v.rpartition(":")
    return bool(host) and port.isdigit() and 1 <= int(port) <= 65535


def address() -> Rule:
    return Rule("'' or host:port (port in [1, 65535])", _address)


def _mesh_shape(v) -> bool:
    return (isinstance(v, (tuple, list)) and len(v) == 3 and all(_is_int(s) for s in v)
            and all(s >= 1 or s == -1 for s in v) and list(v).count(-1) <= 1)


def mesh_shape() -> Rule:
    return Rule("three sizes (data, fsdp, tensor), each >= 1 or one of them -1", _mesh_shape)


def _axis_rules(v) -> bool:
    from models.axes import check_rules
    if not isinstance(v, (tuple, list)):
        return False
    try:
        check_rules(v)
    except (ValueError, TypeError):
        return False
    return True


def axis_rules() -> Rule:
    return Rule("pairs (logical axis, mesh axes) as in models.axes.DEFAULT_RULES, or () for "
                "those", _axis_rules)


def _model_names() -> list[str]:
    import models
    return models.list_configs()


def _dataset_names() -> list[str]:
    from train.data import available
    return available()


def model_name() -> Rule:
    return Lazy(lambda: "one of " + ", ".join(map(repr, _model_names())),
                lambda v: isinstance(v, str) and v in _model_names())


def dataset_name() -> Rule:
    return Lazy(lambda: "one of " + ", ".join(map(repr, _dataset_names())),
                lambda v: isinstance(v, str) and v in _dataset_names())


def frozen(value):
    """`value` made immutable: lists become tuples (recursively), mappings read-only."""
    if isinstance(value, Mapping):
        return types.MappingProxyType({k: frozen(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(frozen(v) for v in value)
    return value


def setting(default, rule: Rule, *, convert: Callable | None = None):
    """A part's field: a config key with its default and its rule; `convert` turns a value
    that passed the rule into the form the part keeps (a list into a tuple, say)."""
    metadata = {"rule": rule, "convert": convert}
    if isinstance(default, (Mapping, list)):       # mutable: a fresh read-only copy each time
        return dataclasses.field(default_factory=lambda: frozen(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def fail(key: str, value, problem: str, sep: str = " ") -> UserError:
    """`key=value problem`; with `sep=": "`, `key=value: problem` (a problem with a subject
    of its own, such as one of several files)."""
    if isinstance(value, Mapping):
        value = dict(value)
    return UserError(f"{key}={value!r}{sep}{problem}")


@dataclasses.dataclass(frozen=True)
class Part:
    """A frozen group of config keys that checks itself when made (see the module
    docstring). Subclasses are frozen dataclasses whose fields are `setting`s, or parts of
    their own (nested keys, `prefix` "name.")."""

    prefix: ClassVar[str] = ""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            rule = f.metadata.get("rule")
            problem = rule(value) if rule is not None else None
            if problem:
                raise fail(self.prefix + f.name, value, problem)
            convert = f.metadata.get("convert")
            if convert is not None:
                object.__setattr__(self, f.name, convert(value))
        self.check()

    def check(self) -> None:
        """The rules between this part's own fields (none by default).

        Raises:
            UserError: naming the key, its value and the rule it breaks.
        """

    @classmethod
    def nested(cls) -> dict[str, type[Part]]:
        """{field name: part class} of the fields that are parts of their own."""
        return {f.name: f.metadata["part"] for f in dataclasses.fields(cls)
                if "part" in f.metadata}

    @classmethod
    def key_rules(cls) -> dict[str, Rule]:
        """{key: rule} of every key this part reads, nested parts' keys included."""
        out = {}
        for f in dataclasses.fields(cls):
            out[cls.prefix + f.name] = f.metadata["rule"]
            if "part" in f.metadata:
                out.update(f.metadata["part"].key_rules())
        return out

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """{field name: default}, a nested part's as a dict of its own."""
        out = {}
        for f in dataclasses.fields(cls):
            part = f.metadata.get("part")
            if part is not None:
                out[f.name] = part.defaults()
            else:
                out[f.name] = (f.default if f.default is not dataclasses.MISSING
                               else f.default_factory())
        return out

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]):
        """The part made from a config's values (`{key: value}`, nested parts as mappings).

        Raises:
            UserError: a missing key, or a value that breaks its rule (named).
        """
        kwargs = {}
        for f in dataclasses.fields(cls):
            key = cls.prefix + f.name
            if f.name not in values:
                raise UserError(f"the config has no key {key!r} ({MISSING_HINT})")
            value = values[f.name]
            part = f.metadata.get("part")
            if part is not None:
                problem = f.metadata["rule"](value)
                if problem:
                    raise fail(key, value, problem)
                value = part.from_mapping(value)
            kwargs[f.name] = value
        return cls(**kwargs)


def subpart(part: type[Part], text: str):
    """A field holding a part of its own (keys `part.prefix + name`), its rule `text`
    when the config gives something other than a mapping."""
    rule = Rule(text, lambda v: isinstance(v, (Mapping, part)))
    return dataclasses.field(default_factory=part, metadata={"rule": rule, "part": part})
