"""Every experiment-config value checked when the config is read, before any data is prepared.

    check_config(configs.get("default"))       # None, or a UserError naming key, value, rule

Each message has the shape `KEY=VALUE must be RULE` (or `KEY=VALUE: WHAT IS WRONG`), e.g.

    num_train_steps=-1 must be an int >= 0
    lr_decay='linear' must be one of 'rsqrt', 'cosine', 'constant'
    data_files='data/': 'data/' is a directory, not a file

`RULES` holds one rule per key of `train/configs/_base.py` (a test keeps them in step); keys
that decide together (the dataset and its files, the model and the dataset's kind) are
checked after every key has passed alone.
"""

from __future__ import annotations

import difflib
import math
import numbers
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from models.errors import UserError, is_int

SPLITS = ("train", "validation", "test")
SPM_MODEL_TYPES = ("unigram", "bpe", "char", "word")


class _Rule:
    """One key's rule: `check(value)` returns None or what the value must be."""

    def __init__(self, text: str, ok: Callable[[Any], bool]):
        self.text, self.ok = text, ok

    def __call__(self, value) -> str | None:
        return None if self.ok(value) else f"must be {self.text}"


def _is_int(v) -> bool:
    return is_int(v) and not isinstance(v, np.bool_)


def _is_number(v) -> bool:
    return (isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))
            and math.isfinite(v))


def _int(low: int, high: int | None = None) -> _Rule:
    text = f"an int >= {low}" if high is None else f"an int in [{low}, {high}]"
    return _Rule(text, lambda v: _is_int(v) and v >= low and (high is None or v <= high))


def _number(text: str, ok: Callable[[float], bool]) -> _Rule:
    return _Rule(f"a number {text}", lambda v: _is_number(v) and ok(v))


def _choice(*values: str) -> _Rule:
    return _Rule("one of " + ", ".join(map(repr, values)), lambda v: isinstance(v, str)
                 and v in values)


def _bool() -> _Rule:
    return _Rule("a bool (true or false)", lambda v: isinstance(v, (bool, np.bool_)))


def _str() -> _Rule:
    return _Rule("a string", lambda v: isinstance(v, str))


def _float_dtype(v) -> bool:
    import jax.numpy as jnp
    if not isinstance(v, str):
        return False
    try:
        return bool(jnp.issubdtype(jnp.dtype(v), jnp.floating))
    except TypeError:
        return False


def _address(v) -> bool:
    if not isinstance(v, str):
        return False
    if not v:
        return True
    host, _, port = v.rpartition(":")
    return bool(host) and port.isdigit() and 1 <= int(port) <= 65535


def _mesh_shape(v) -> bool:
    return (isinstance(v, (tuple, list)) and len(v) == 3 and all(_is_int(s) for s in v)
            and all(s >= 1 or s == -1 for s in v) and list(v).count(-1) <= 1)


def _axis_rules(v) -> bool:
    from models.axes import check_rules
    if not isinstance(v, (tuple, list)):
        return False
    try:
        check_rules(v)
    except (ValueError, TypeError):
        return False
    return True


def _model(v) -> bool:
    import models
    return isinstance(v, str) and v in models.list_configs()


def _dataset(v) -> bool:
    from train.data import available
    return isinstance(v, str) and v in available()


def _model_text() -> str:
    import models
    return "one of " + ", ".join(map(repr, models.list_configs()))


def _dataset_text() -> str:
    from train.data import available
    return "one of " + ", ".join(map(repr, available()))


class _Lazy(_Rule):
    """A rule whose text needs an import (the model presets, the dataset names)."""

    def __init__(self, text: Callable[[], str], ok: Callable[[Any], bool]):
        self._text, self.ok = text, ok

    @property
    def text(self) -> str:
        return self._text()


RULES: dict[str, _Rule] = {
    # Model.
    "model": _Lazy(_model_text, _model),
    "model_overrides": _Rule("a dict of TransformerConfig fields",
                             lambda v: isinstance(v, Mapping)),
    "init_from": _str(),
    "dtype": _Rule("a float dtype name ('float32', 'bfloat16', 'float16')", _float_dtype),
    # Data.
    "dataset": _Lazy(_dataset_text, _dataset),
    "data_files": _Rule("a string of comma-separated paths", lambda v: isinstance(v, str)),
    "data_dir": _str(),
    "reverse_translation": _bool(),
    "tokenizer": _choice("sentencepiece", "byte"),
    "vocab_size": _int(1),
    "spm_model_type": _choice(*SPM_MODEL_TYPES),
    "max_source_length": _int(2),
    "max_target_length": _int(2),
    "packing": _bool(),
    "overlong": _choice("drop", "truncate"),
    "data_workers": _int(0),
    "eval_split": _choice(*SPLITS),
    "test_split": _choice(*SPLITS),
    # Optimisation.
    "per_device_batch_size": _int(1),
    "num_train_steps": _int(0),
    "learning_rate": _number("> 0", lambda v: v > 0),
    "warmup_steps": _int(0),
    "lr_decay": _choice("rsqrt", "cosine", "constant"),
    "adam_b1": _number("in [0, 1)", lambda v: 0 <= v < 1),
    "adam_b2": _number("in [0, 1)", lambda v: 0 <= v < 1),
    "adam_eps": _number("> 0", lambda v: v > 0),
    "weight_decay": _number(">= 0", lambda v: v >= 0),
    "grad_clip_norm": _number(">= 0 (0: no clipping)", lambda v: v >= 0),
    "grad_accum_steps": _int(1),
    "label_smoothing": _number("in [0, 1)", lambda v: 0 <= v < 1),
    "z_loss": _number(">= 0", lambda v: v >= 0),
    "mlm_rate": _number("in (0, 1]", lambda v: 0 < v <= 1),
    "mlm_mask_fraction": _number("in [0, 1]", lambda v: 0 <= v <= 1),
    "mlm_random_fraction": _number("in [0, 1]", lambda v: 0 <= v <= 1),
    "parallel": _choice("pmap", "shard_map", "sharded"),
    "mesh_shape": _Rule("three sizes (data, fsdp, tensor), each >= 1 or one of them -1",
                        lambda v: _mesh_shape(v)),
    "logical_axis_rules": _Rule("pairs (logical axis, mesh axes) as in "
                                "models.axes.DEFAULT_RULES, or () for those",
                                lambda v: _axis_rules(v)),
    "seed": _int(0),
    "scheduled_sampling": _Rule("a dict of enabled, schedule, max_rate, ramp_steps, k",
                                lambda v: isinstance(v, Mapping)),
    "scheduled_sampling.enabled": _bool(),
    "scheduled_sampling.schedule": _choice("linear", "exponential", "inverse_sigmoid"),
    "scheduled_sampling.max_rate": _number("in [0, 1]", lambda v: 0 <= v <= 1),
    "scheduled_sampling.ramp_steps": _int(1),
    "scheduled_sampling.k": _number("> 0", lambda v: v > 0),
    # Loop, evaluation, checkpoints.
    "log_every_steps": _int(1),
    "eval_every_steps": _int(1),
    "checkpoint_every_steps": _int(1),
    "keep_checkpoints": _int(1),
    "num_eval_decode": _int(0),
    "num_test_decode": _int(0),
    "eval_per_device_batch_size": _int(1),
    "beam_size": _int(1),
    "length_penalty": _number(">= 0", lambda v: v >= 0),
    "max_decode_length": _int(1),
    "show_examples": _int(0),
    "metric": _choice("exact_match", "bleu", "both"),
    # Multi-host.
    "distributed": _bool(),
    "coordinator_address": _Rule("'' or host:port (port in [1, 65535])", _address),
    "num_processes": _int(1),
    "process_id": _int(0),
}
_NESTED = ("scheduled_sampling",)         # dicts whose keys have rules of their own


def _flat(config) -> dict[str, Any]:
    """`{"key": value, "scheduled_sampling.enabled": value, ...}`; model_overrides whole."""
    items = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    out = {}
    for key, value in items.items():
        out[key] = value
        if key in _NESTED and isinstance(value, Mapping):
            out.update({f"{key}.{k}": v for k, v in value.items()})
    return out


def _fail(key: str, value, problem: str, sep: str = " ") -> UserError:
    """`key=value problem`; with `sep=": "`, `key=value: problem` (a problem with a subject
    of its own, such as one of several files)."""
    return UserError(f"{key}={value!r}{sep}{problem}")


def check_config(config) -> None:
    """Checks every value of an experiment config; reads no data and builds nothing.

    Args:
        config: an `ml_collections.ConfigDict` (or a plain mapping) with the keys of
            `train.configs._base.base_config()`.

    Raises:
        UserError: naming the key, the value and the rule it breaks (the first one found).
    """
    from train.configs._base import base_config
    values = _flat(config)
    known = _flat(base_config())
    for key in values:
        if key not in known:
            near = difflib.get_close_matches(key, list(known), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise _fail(key, values[key], "is not a config key (the keys are those of "
                        f"train/configs/_base.py){hint}")
    for key, value in values.items():
        rule = RULES.get(key)
        problem = rule(value) if rule is not None else None
        if problem:
            raise _fail(key, value, problem)
    missing = [k for k in known if k not in values]
    if missing:
        raise UserError(f"the config has no key {missing[0]!r} (every config starts from "
                         "train.configs._base.base_config())")
    for check in (_check_processes, _check_schedule, _check_masking, _check_tokenizer,
                  _check_files, _check_data_dir, _check_reverse, _check_init_from,
                  _check_model):
        check(values)


def _check_masking(c: dict) -> None:
    total = c["mlm_mask_fraction"] + c["mlm_random_fraction"]
    if total > 1:
        raise _fail("mlm_mask_fraction", c["mlm_mask_fraction"],
                    f"plus mlm_random_fraction={c['mlm_random_fraction']} is {total:g}, "
                    "above 1")


def _check_processes(c: dict) -> None:
    if c["process_id"] >= c["num_processes"]:
        raise _fail("process_id", c["process_id"],
                    f"must be in [0, num_processes={c['num_processes']})")


def _check_schedule(c: dict) -> None:
    schedule, k = c["scheduled_sampling.schedule"], c["scheduled_sampling.k"]
    if schedule == "exponential" and not 0 < k < 1:
        raise _fail("scheduled_sampling.k", k, "must be in (0, 1) for the exponential schedule")
    if schedule == "inverse_sigmoid" and not k >= 1:
        raise _fail("scheduled_sampling.k", k,
                    "must be >= 1 for the inverse_sigmoid schedule")


def _check_tokenizer(c: dict) -> None:
    from train.data.tokenizer import MIN_SENTENCEPIECE_VOCAB
    if (not c["init_from"] and c["tokenizer"] == "sentencepiece"
            and c["vocab_size"] < MIN_SENTENCEPIECE_VOCAB):
        raise _fail("vocab_size", c["vocab_size"],
                    f"must be >= {MIN_SENTENCEPIECE_VOCAB} for tokenizer='sentencepiece' "
                    "(256 byte-fallback pieces and the specials); use tokenizer='byte' for "
                    "fewer ids")


def _dataset_kind(name: str) -> str:
    from train.data import builders, datasets
    if name in builders.GENERATED:
        return datasets.GENERATED_KINDS[name]
    if name in datasets.LOCAL_KINDS:
        return datasets.LOCAL_KINDS[name]
    return datasets.STANDARD[name].kind


def _check_files(c: dict) -> None:
    """data_files: required by (and only read by) the local datasets; each a file."""
    from train.data import builders
    value, dataset = c["data_files"], c["dataset"]
    files = [p for p in value.split(",") if p]
    if dataset not in builders.LOCAL:
        if files:
            raise _fail("data_files", value, f"is only read by the local datasets "
                        f"({', '.join(sorted(builders.LOCAL))}), not dataset={dataset!r}")
        return
    if not files:
        raise _fail("data_files", value, f"must name one or more files (comma-separated) for "
                    f"dataset={dataset!r}")
    for path in files:
        if os.path.isdir(path):
            raise _fail("data_files", value, f"{path!r} is a directory, not a file", ": ")
        if not os.path.isfile(path):
            raise _fail("data_files", value, f"{path!r} does not exist", ": ")
    try:
        if dataset == "local_translation":
            builders.translation_sources(files)
        else:
            builders.check_source_count(len(files))
    except ValueError as e:
        raise _fail("data_files", value, str(e), ": ") from None


def _check_data_dir(c: dict) -> None:
    path = os.path.expanduser(c["data_dir"])
    if path and os.path.exists(path) and not os.path.isdir(path):
        raise _fail("data_dir", c["data_dir"], "is a file, not a directory")


def _check_reverse(c: dict) -> None:
    if c["reverse_translation"] and _dataset_kind(c["dataset"]) != "translation":
        raise _fail("reverse_translation", True,
                    f"needs a translation dataset; {c['dataset']!r} is text")


def _check_init_from(c: dict) -> None:
    path = c["init_from"]
    if not path:
        return
    if not os.path.isdir(path):
        raise _fail("init_from", path, "does not exist" if not os.path.exists(path)
                    else "is not a directory (a model directory with config.json)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise _fail("init_from", path, "must be a model directory with config.json; it has "
                    "none")
    from models.pretrained import RUNTIME_FIELDS, read_config
    fixed = sorted(set(c["model_overrides"]) - RUNTIME_FIELDS)
    if fixed:
        raise _fail("model_overrides", dict(c["model_overrides"]),
                    f"may only set {sorted(RUNTIME_FIELDS)} when fine-tuning init_from="
                    f"{path!r}; {fixed} would change its architecture", ": ")
    try:        # its model type and every field, refused by name before any data work
        read_config(path)
    except (ValueError, FileNotFoundError) as e:
        raise UserError(f"init_from={path!r}: {e}") from None


def _check_model(c: dict) -> None:
    """The preset with its overrides builds a valid model that fits the dataset's kind."""
    if c["init_from"]:
        return
    import ml_collections

    from models.config import check_keys
    from models.tokenizer import ByteTokenizer
    from train.model_config import check_fits, model_config
    overrides = dict(c["model_overrides"])
    try:
        check_keys(overrides)
        # The tokenizer's size is known only later; the rules it enters (special ids below
        # it) hold for both of ours.
        vocab = (c["vocab_size"] if c["tokenizer"] == "sentencepiece"
                 else ByteTokenizer().vocab_size)
        cfg = model_config(ml_collections.ConfigDict(
            {k: c[k] for k in ("model", "max_source_length", "max_target_length",
                               "max_decode_length", "dtype")}
            | {"model_overrides": overrides}), vocab)
    except (ValueError, TypeError) as e:
        raise _fail("model_overrides", overrides, f"{e} (model={c['model']!r})", ": ") from None
    try:
        check_fits(cfg, c["model"], c["dataset"], _dataset_kind(c["dataset"]))
    except ValueError as e:
        raise _fail("model", c["model"], f"({e})") from None
    if cfg.architecture == "encoder_only" and c["scheduled_sampling.enabled"]:
        raise _fail("scheduled_sampling.enabled", True, f"needs a model that predicts the "
                    f"next token; {c['model']!r} is encoder-only")
