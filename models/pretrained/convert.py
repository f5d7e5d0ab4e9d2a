"""Parameters from a checkpoint's tensors and back, by a family's rules (see `mapping`).

Reading checks the whole file against the table before converting anything:
- its keys are taken under the names the rules use (`Family.renames`);
- every tensor the rules need must be there (missing ones are named), unless a whole
  optional head is absent (`Family.optional_heads`: it is initialised, with a warning);
- every tensor there must be needed, ignorable, another head's (`Family.skipped`, with a
  warning), a tied copy or the tied head (unexpected ones are named);
- tied copies must equal the tensor read, and stored tensors the config determines must
  equal ours (both named otherwise);
- every converted array must have the shape the model expects (named with both shapes);
- every tensor read must be finite: NaN and Inf are counted per tensor and named, as an
  error unless the caller allows them (`allow_non_finite`, then as a warning).

A tensor that a rule reads and checks but no parameter holds (Whisper's encoder positions,
a function of the config) is kept as the file holds it (`read_weights`' tables), so a save
given those tables writes the file's own values back, bit for bit, instead of recomputing
them (`theirs_tensors(..., tables=)`).

Tensors are read, converted and cast one at a time on the host and each
parameter is put on the device as soon as it is whole (stacked, scanned parameters when
their rule is done), so the host holds the parameters once, plus at most one rule's arrays.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from models.config import TransformerConfig
from models.errors import UserError
from models.pretrained.family import Family
from models.pretrained.files import Weights
from models.pretrained.mapping import (
    Rule,
    expected_shape,
    initial_params,
    our_slot,
    parameter_shapes,
    stack_depth,
    whole_leaf,
)

TIED_HEAD = "lm_head.weight"


def _expanded(rules: list[Rule], cfg: TransformerConfig):
    """(rule, theirs keys, ours paths) for every layer of every rule."""
    for rule in rules:
        for i in rule.layers(cfg):
            yield (rule, [k.format(i=i) for k in rule.theirs],
                   [p.format(i=i) for p in rule.ours])


def _show(keys, limit: int = 6) -> str:
    keys = sorted(keys)
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def _key_resolver(family: Family, present: set[str], needed: set[str]):
    """Maps the rules' key names to the file's: files saved from the base model alone
    lack the family's prefix ("transformer.h.0..." is "h.0..." there)."""
    p = family.prefix
    if p and not any(k.startswith(p) for k in present) and any(
            k.startswith(p) and k[len(p):] in present for k in needed):
        return lambda k: k[len(p):] if k.startswith(p) else k
    return lambda k: k


def read_params(weights: Weights, family: Family, cfg: TransformerConfig,
                shardings=None, *, allow_non_finite: bool = False) -> dict:
    """The parameter tree of `read_weights` (its arguments, its errors)."""
    return read_weights(weights, family, cfg, shardings,
                        allow_non_finite=allow_non_finite)[0]


def read_weights(weights: Weights, family: Family, cfg: TransformerConfig,
                 shardings=None, *, allow_non_finite: bool = False) -> tuple[dict, dict]:
    """(the model's parameter tree, its tables) from `weights`. The tree's leaves are jax
    arrays of `cfg.param_dtype`, each put on its sharding as it is read when `shardings` (a
    tree like the params') is given, else on the default device. The tables are the
    tensors the rules read and check but no parameter holds, {file key: numpy array of
    `cfg.param_dtype`} as the file holds them (Whisper's encoder positions; empty for most
    families): what `theirs_tensors(..., tables=)` writes back.

    Args:
        allow_non_finite: load tensors holding NaN or Inf (with a warning naming them)
            instead of refusing the checkpoint.

    Raises:
        UserError: naming missing or unexpected tensors, a tensor whose converted shape
            differs from the model's, with both shapes, or (unless `allow_non_finite`) the
            tensors holding NaN or Inf, with their counts.
    """
    if family.renames:
        weights = _Renamed(weights, family)
    entries = list(_expanded(family.rules(cfg), cfg))
    plan = _plan(weights, family, cfg, entries)
    leaves = parameter_shapes(cfg)
    expected = {p: expected_shape(p, leaves) for _, _, ours in entries for p in ours}
    covered = {whole_leaf(p) for p in expected}
    if covered != set(leaves):                    # a bug in a rule table, not in the file
        raise AssertionError(f"{family.model_type} rules miss {_show(set(leaves) - covered)}"
                             f" or name unknown {_show(covered - set(leaves))}")
    if plan.notes:
        warnings.warn(f"{family.model_type} checkpoint {weights.directory}: "
                      + "; ".join(plan.notes), stacklevel=3)
    initial = initial_params(cfg, [p for _, theirs, ours in entries if set(theirs) <= plan.fresh
                                   for p in ours]) if plan.fresh else {}
    tree = ParamTree(cfg, shardings)
    tables = {}
    non_finite = []                       # "key: n NaN, m Inf of size" of every such tensor
    for rule, theirs, ours in entries:
        if set(theirs) <= plan.fresh:
            tree.place(ours, [initial[p] for p in ours])
            continue
        read = [weights.read(plan.source[k]) for k in theirs]
        for k, a in zip(theirs, read, strict=True):
            if not jnp.issubdtype(a.dtype, jnp.floating):      # bfloat16 included
                raise UserError(f"{family.model_type} checkpoint tensor {k} holds "
                                 f"{a.dtype}, not floating-point weights")
            non_finite += non_finite_counts(k, a)
        try:
            arrays = rule.layout.to_ours(read, cfg)
            shapes = [tuple(a.shape) for a in arrays]
        except UserError:                   # a layout's own refusal (Whisper's positions)
            raise
        except (ValueError, IndexError):    # a reshape, split or axis the tensor cannot take
            shapes = None
        if shapes != [expected[p] for p in ours]:
            # The shapes the file should hold, in its own layout (empty arrays: no data).
            want = rule.layout.to_theirs([np.empty(expected[p], np.float32) for p in ours], cfg)
            if all(a.shape == w.shape for a, w in zip(read, want, strict=True)):
                raise AssertionError(   # the file is as expected: the rule is what is wrong
                    f"{family.model_type}: the rule for {', '.join(theirs)} turns tensors of the "
                    f"expected shapes into {shapes}, not {[expected[p] for p in ours]} (a bug)")
            bad = ", ".join(f"{k} has shape {tuple(a.shape)}, the config expects "
                            f"{tuple(w.shape)}" for k, a, w in zip(theirs, read, want, strict=True))
            raise UserError(f"{family.model_type} checkpoint {weights.directory}: {bad} (for "
                             f"{', '.join(ours)})")
        tree.place(ours, arrays)
        if not ours:                        # checked by its layout, held by no parameter
            tables.update({k: np.asarray(a, cfg.param_dtype)
                           for k, a in zip(theirs, read, strict=True)})
    check_finite(f"{family.model_type} checkpoint {weights.directory}", non_finite,
                 allow=allow_non_finite)
    return tree.params, tables


def check_finite(where: str, non_finite: list[str], *, allow: bool) -> None:
    """Refuses the tensors of `where` (a checkpoint, an adapter) that hold NaN or Inf,
    each named with its counts (`non_finite_counts` of every tensor read), or with `allow`
    warns naming them (the caller of `models.load` sees the warning).

    Raises:
        UserError: unless `allow`, when `non_finite` names any tensor.
    """
    if not non_finite:
        return
    what = (f"{where} has {len(non_finite)} tensor(s) holding NaN or Inf: "
            f"{'; '.join(non_finite[:6])}"
            + (f" and {len(non_finite) - 6} more" if len(non_finite) > 6 else ""))
    if not allow:
        raise UserError(what + " (models.load(..., allow_non_finite=True) loads them)")
    warnings.warn(what, UserWarning, stacklevel=4)


def non_finite_counts(key: str, a: np.ndarray) -> list[str]:
    """[] for a finite tensor, else ["key: n NaN, m Inf of size values"]."""
    if np.isfinite(a).all():
        return []
    nan = int(np.isnan(a).sum())
    return [f"{key}: {nan} NaN, {int(a.size - nan - np.isfinite(a).sum())} Inf of {a.size} "
            "values"]


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Where each tensor the rules need comes from.

    Attributes:
        source: a rule's key -> the file's key it is read from (its own, or a tied copy's).
        fresh: the rules' keys of optional heads the file lacks: newly initialised.
        notes: what the warning says (heads initialised, tensors skipped).
    """

    source: dict[str, str]
    fresh: set[str]
    notes: list[str]


def _plan(weights: Weights, family: Family, cfg: TransformerConfig, entries) -> _Plan:
    """Checks the file's keys against the rules: names what is missing, what the config
    does not use, and tied copies or fixed tensors that differ."""
    needed = {k for _, theirs, _ in entries for k in theirs}
    present = weights.keys()
    resolve = _key_resolver(family, present, needed)
    # Where each needed tensor is read from: its own key, or else a tied copy's.
    stored = {k: [resolve(c) for c in (k, *family.copies.get(k, ())) if resolve(c) in present]
              for k in needed}
    missing = {k for k in needed if not stored[k]}
    fresh, notes = set(), []
    for prefix, head in family.optional_heads.items():
        under = {k for k in needed if k.startswith(prefix)}
        if under and under <= missing:
            fresh |= under
            notes.append(f"it has no {resolve(prefix)}* tensors: {head} is newly initialised "
                         "(train it before use)")
    missing -= fresh
    fixed = {resolve(k): a for k, a in (family.fixed(cfg) if family.fixed else {}).items()}
    used = {c for keys in stored.values() for c in keys} | set(fixed)
    extra = {k for k in present - used if not family.is_ignored(k)
             and not (k == resolve(TIED_HEAD) and cfg.tie_embeddings)}
    skipped = {k for k in extra if family.is_skipped(k, cfg)}
    extra -= skipped
    if missing:        # what it holds instead names a variant (quantized experts, say)
        instead = f"; it holds {len(extra)} the config does not use: {_show(extra)}" \
            if extra else ""
        raise UserError(f"{family.model_type} checkpoint {weights.directory} lacks "
                         f"{len(missing)} tensor(s) the config needs: {_show(missing)}"
                         f"{instead}")
    _check_copies(weights, family, stored)
    _check_fixed(weights, family, {k: a for k, a in fixed.items() if k in present})
    if extra:
        raise UserError(f"{family.model_type} checkpoint {weights.directory} has "
                         f"{len(extra)} tensor(s) the config does not use: {_show(extra)}")
    if skipped:
        notes.append(f"{_show(skipped)}, weights of parts this model does not have (another "
                     "head, a vision tower), are skipped")
    return _Plan({k: keys[0] for k, keys in stored.items() if keys}, fresh, notes)


class ParamTree:
    """The parameter tree being read: a whole leaf is placed at once, a layer's slice is
    held until every layer of its leaf is there. A leaf goes onto its sharding (each
    device gets only its part) or the default device."""

    def __init__(self, cfg: TransformerConfig, shardings):
        self.cfg, self.shardings = cfg, shardings
        self.params: dict = {}
        self._stacks: dict[tuple, dict[int, np.ndarray]] = {}

    def place(self, ours: list[str], arrays) -> None:
        """One rule's converted arrays, for its parameter paths `ours`."""
        for path, array in zip(ours, arrays, strict=True):
            slot, index = our_slot(path, self.cfg)
            array = np.asarray(array, self.cfg.param_dtype)
            if index is None:
                self._put(slot, array)
            else:
                self._stacks.setdefault(slot, {})[index] = array
        whole = [s for s, layers in self._stacks.items() if len(layers) == _depth(s, self.cfg)]
        for slot in whole:
            layers = self._stacks.pop(slot)
            self._put(slot, np.stack([layers[i] for i in range(len(layers))]))

    def _put(self, slot: tuple[str, ...], array: np.ndarray) -> None:
        where = None if self.shardings is None else leaf_at(self.shardings, slot, "/".join(slot))
        _put(self.params, slot, jax.device_put(array, where))


class _Renamed:
    """`weights` with its keys under the names the rules use (`Family.renames`)."""

    def __init__(self, weights: Weights, family: Family):
        self.directory, self._weights, self._names = weights.directory, weights, {}
        for key in sorted(weights.keys()):
            new = family.rename(key)
            if new in self._names:
                raise UserError(f"{family.model_type} checkpoint {weights.directory} holds "
                                 f"both {self._names[new]} and {key}, two names of {new}")
            self._names[new] = key

    def keys(self) -> set[str]:
        return set(self._names)

    def read(self, key: str) -> np.ndarray:
        return self._weights.read(self._names[key])


def _check_copies(weights: Weights, family: Family, stored: dict[str, list[str]]) -> None:
    """Tied copies in the file (`Family.copies`) equal the tensor read, bit for bit."""
    for keys in stored.values():
        if len(keys) < 2:
            continue
        first = weights.read(keys[0])
        for other in keys[1:]:
            a = weights.read(other)
            if a.shape != first.shape or a.dtype != first.dtype or not np.array_equal(a, first):
                raise UserError(
                    f"{family.model_type} checkpoint {weights.directory}: {other} and "
                    f"{keys[0]} differ, but the config ties them (transformers would use them "
                    "as separate weights, which this model type cannot express)")


def _check_fixed(weights: Weights, family: Family, fixed: dict[str, np.ndarray]) -> None:
    """Stored copies of tensors the config determines (`Family.fixed`) equal ours, rounded
    to the file's dtype (within one unit in its last place)."""
    for key, want in fixed.items():
        got = weights.read(key)
        rounded = np.asarray(want).astype(got.dtype)
        tol = 2 * float(jnp.finfo(got.dtype).eps) if jnp.issubdtype(got.dtype, jnp.floating) else 0
        if got.shape != want.shape or not np.allclose(
                got.astype(np.float64), rounded.astype(np.float64), rtol=0, atol=tol):
            raise UserError(
                f"{family.model_type} checkpoint {weights.directory}: {key} (shape "
                f"{got.shape}) is not the table the config determines (shape {want.shape}); "
                "this project regenerates it and cannot load a different one")


def theirs_tensors(family: Family, cfg: TransformerConfig, params,
                   tables: dict | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """(file key, array) of every tensor the family's file holds, from our parameters
    (converted on the host, one rule at a time).

    Args:
        tables: tensors no parameter holds, as a load read them (`read_weights`): written
            as given (cast to `cfg.param_dtype`) instead of computed from the config, once
            the rule that reads them accepts them for `cfg`.

    Raises:
        UserError: naming a table the family does not write from a table, or one that
            its rule refuses for `cfg`, as loading refuses it.
    """
    tables = dict(tables or {})
    entries = list(_expanded(family.rules(cfg), cfg))
    known = {k for _, theirs, ours in entries if not ours for k in theirs}
    if set(tables) - known:
        raise UserError(f"tables= holds {_show(set(tables) - known)}, but {family.model_type}"
                        f" writes only {_show(known) if known else 'no tensor'} from a table "
                        "(everything else from the parameters)")
    for rule, theirs, ours in entries:
        if not ours and tables.keys() >= set(theirs):
            kept = [np.asarray(tables[k]) for k in theirs]
            rule.layout.to_ours(kept, cfg)            # refused as loading would refuse it
            yield from ((k, a.astype(cfg.param_dtype)) for k, a in zip(theirs, kept,
                                                                        strict=True))
            continue
        arrays = []
        for path in ours:
            slot, index = our_slot(path, cfg)
            leaf = leaf_at(params, slot, path)
            arrays.append(np.asarray(leaf if index is None else leaf[index]))  # one layer
        yield from zip(theirs, rule.layout.to_theirs(arrays, cfg), strict=True)


def _depth(slot: tuple[str, ...], cfg: TransformerConfig) -> int:
    """The layers stacked in a leaf: the encoder's (or the encoder-only stack's), or the
    decoder's (its own stack and the cross-attention projections)."""
    return stack_depth(cfg, "encoder" if slot[0] == "encoder" else "decoder")


def _put(tree: dict, slot: tuple[str, ...], value) -> None:
    for key in slot[:-1]:
        tree = tree.setdefault(key, {})
    tree[slot[-1]] = value


def leaf_at(tree, slot: tuple[str, ...], path: str):
    try:
        for key in slot:
            tree = tree[key]
    except (KeyError, TypeError):
        raise UserError(f"params have no {path!r} (looked for {'/'.join(slot)})") from None
    return tree

