"""Several LoRA adapters of one base, served together: each request names its own.

    table = adapters.stack(pre, {"legal": read_adapter("legal", base), "chat": ...})
    table.lora        # one LoraConfig for all: per_row, the largest rank, scale 1
    table.stacked     # the adapter tree, each leaf [lead..., 1 + N, ...]: 0 is the base

Every adapter is padded to the largest rank with zeros (A's columns, B's rows: the
product is unchanged) and its scale (alpha / r) is folded into its B, so one config
describes them all; a projection one adapter targets and another does not gets zeros in
the other. Entry 0 of the stacked axis is all zeros: a request without an adapter runs the
base. A step gathers each row's entry (`rows_of`), and the model, built with
`LoraConfig(per_row=True)`, adapts row b by its own A_b, B_b: a gathered low-rank product
per row, the base's matmuls shared by all rows.

The stacked axis sits after a leaf's leading layer axis (a scanned stack's, or the
cross-attention keys/values' [L, D, r]), where `per_row` adapters keep their row axis.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from models import lora as lora_lib
from models.errors import UserError


@dataclasses.dataclass(frozen=True)
class AdapterTable:
    """Adapters stacked for serving.

    Attributes:
        names: the adapters' names; request index i + 1 is names[i], 0 the base.
        lora: the config of the model that serves them (`per_row`, one rank, scale 1).
        stacked: the adapter tree, each leaf with the 1 + N entries at axis `lead`.
    """

    names: tuple[str, ...]
    lora: lora_lib.LoraConfig
    stacked: dict

    def index(self, name: str | None) -> int:
        """A request's entry: 0 for None (the base), else its adapter's.

        Raises:
            UserError: a name that is not one of the adapters.
        """
        if name is None:
            return 0
        if name not in self.names:
            raise UserError(f"adapter {name!r} is not one of the served adapters "
                            f"{list(self.names)}")
        return self.names.index(name) + 1


def _lead(path: tuple[str, ...]) -> int:
    """The leading layer axes of an adapter leaf: 1 in a scanned stack ("layers") and for
    the cross-attention keys/values (stacked over layers), else 0."""
    return int(path[0] == "cross_kv" or "layers" in path)


def _leaves(tree: dict, path=()) -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_leaves(value, (*path, key)))
        else:
            out[(*path, key)] = value
    return out


def _nest(flat: dict) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


def stack(pre, adapters: dict[str, tuple[lora_lib.LoraConfig, dict]]) -> AdapterTable:
    """The adapters (name -> `models.read_adapter`'s (LoraConfig, tree)) of the base `pre`
    stacked for serving.

    Raises:
        UserError: no adapters, a base that carries an adapter itself, or a bad name.
    """
    if not adapters:
        raise UserError("stack() needs at least one adapter")
    if pre.config.lora is not None:
        raise UserError("the base carries an adapter already: load it without one "
                        "(models.load(DIR)) and serve its adapters by name")
    for name in adapters:
        if not isinstance(name, str) or not name or "=" in name:
            raise UserError(f"adapter name {name!r} must be a non-empty string without '='")
    names = tuple(adapters)
    rank = max(max([cfg.rank, *(r for _, r, _ in cfg.overrides)])
               for cfg, _ in adapters.values())
    flat = [(cfg, _leaves(tree)) for cfg, tree in adapters.values()]
    paths = sorted({p for _, leaves in flat for p in leaves if p[-1].endswith("lora_a")})
    stacked = {}
    for a_path in paths:
        b_path = (*a_path[:-1], a_path[-1][:-1] + "b")
        lead = _lead(a_path)
        entries_a, entries_b = [], []
        shape_a = shape_b = None
        for cfg, leaves in flat:
            if a_path not in leaves:          # this adapter leaves the projection alone
                entries_a.append(None)
                entries_b.append(None)
                continue
            a, b = np.asarray(leaves[a_path], np.float32), np.asarray(leaves[b_path],
                                                                      np.float32)
            _, scale = cfg.shape_of(lora_lib.site_of(a_path))
            r = a.shape[-1]
            a = np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, rank - r)])
            b = np.pad(b * scale, [(0, 0)] * lead + [(0, rank - r)]
                       + [(0, 0)] * (b.ndim - lead - 1))
            shape_a, shape_b = a.shape, b.shape
            entries_a.append(a)
            entries_b.append(b)
        dtype = np.dtype(pre.config.param_dtype)
        for entries, shape, path in ((entries_a, shape_a, a_path), (entries_b, shape_b, b_path)):
            full = [np.zeros(shape, np.float32)] + [np.zeros(shape, np.float32) if e is None
                                                    else e for e in entries]
            stacked[path] = jnp.asarray(np.stack(full, axis=lead), dtype)
    targets = tuple(dict.fromkeys(t for cfg, _ in adapters.values() for t in cfg.targets))
    config = lora_lib.LoraConfig(rank=rank, alpha=float(rank), targets=targets, per_row=True)
    return AdapterTable(names, config, _nest(stacked))


def rows_of(stacked: dict, index_R) -> dict:
    """Each row's adapter (inside jit): every leaf's entries taken at `index_R`, [R] ints,
    on its stacked axis: the per-row tree a `per_row` model reads."""
    def take(path, leaf):
        keys = tuple(getattr(k, "key", k) for k in path)
        return jnp.take(leaf, index_R, axis=_lead(keys))
    return jax.tree_util.tree_map_with_path(take, stacked)
