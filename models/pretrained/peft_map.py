"""The modules of a checkpoint that carry LoRA adapters, derived from a family's weight map,
and their adapter tensors in PEFT's layout.

A rule of `Family.rules` that reads one tensor, "<module>.weight", into kernels of adaptable
projections (`models.lora.site_of`) makes an adaptable module; the rule's `{i}` and stack
carry over, and its kernels, in order, are the module's parts (the rows of its weight):

    llama   model.layers.{i}.self_attn.q_proj             decoder self_attention query
    gpt2    transformer.h.{i}.attn.c_attn                 query, key, value (fused)
    t5      decoder.block.{i}.layer.1.EncDecAttention.k   cross_kv/key_kernel[{i}]
    zoo     decoder.layer_0.self_attention.query          (the project's own names)

PEFT stores module M's adapter as `M.lora_A.weight` [r, in] and `M.lora_B.weight` [out, r],
torch `nn.Linear` layouts whatever the base weight's own (GPT-2's `Conv1D` too: its
`fan_in_fan_out` only matters when merging). Ours are A [in..., r] and B [r, out...], and
the flattened orders agree (heads major, head_dim minor, as the base layouts flatten them):

    lora_A.weight = A.reshape(-1, r).T        lora_B.weight = B.reshape(r, -1).T

A fused module's B is the parts' B stacked by rows (`FusedBlocks` says how our separate
adapters share one).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

import numpy as np

from models.config import TransformerConfig
from models.lora import Site, projection_widths, site_of
from models.pretrained.family import Family
from models.pretrained.mapping import Rule, expected_shape, parameter_shapes, stack_depth

KERNEL = "kernel"


@dataclasses.dataclass(frozen=True)
class Part:
    """One projection of a module's weight.

    Attributes:
        site: the projection (stack, block, name).
        kernel: its kernel's unscanned path, with `{i}`: "decoder/layer_{i}/mlp/up/kernel",
            "cross_kv/key_kernel[{i}]".
        width_in, width_out: its input and output widths, flattened over heads.
    """

    site: Site
    kernel: str
    width_in: int
    width_out: int

    def leaf(self, which: str, i: int) -> str:
        """The unscanned path of layer i's adapter leaf, `which` "a" or "b":
        ".../query/lora_a", "cross_kv/key_lora_b[3]"."""
        path = self.kernel.format(i=i)
        head, index = (path.split("[") + [""])[:2]
        leaf = head[:-len(KERNEL)] + f"lora_{which}"
        return f"{leaf}[{index}" if index else leaf


@dataclasses.dataclass(frozen=True)
class Module:
    """A checkpoint module that can carry an adapter: its name (with `{i}` for each layer of
    `stack`), its parts in the order of its weight's rows, and whether the base stores its
    weight [in, out] (GPT-2's `Conv1D`, PEFT's `fan_in_fan_out`) rather than [out, in]."""

    name: str
    stack: str | None
    parts: tuple[Part, ...]
    transposed: bool = False

    def names(self, cfg: TransformerConfig) -> list[tuple[int, str]]:
        """(layer, name) of each copy of the module."""
        layers = range(1) if self.stack is None else range(stack_depth(cfg, self.stack))
        return [(i, self.name.format(i=i)) for i in layers]

    @property
    def sites(self) -> tuple[Site, ...]:
        return tuple(p.site for p in self.parts)

    @property
    def width_out(self) -> int:
        return sum(p.width_out for p in self.parts)


def kernel_site(path: str) -> Site | None:
    """The projection a kernel path belongs to, or None: "decoder/layer_{i}/mlp/up/kernel"
    -> (decoder, mlp, up); "cross_kv/value_kernel[{i}]" -> (decoder, cross_attention,
    value); "head/kernel" -> None."""
    parts = path.split("[")[0].split("/")
    if not parts[-1].endswith(KERNEL):
        return None
    return site_of((*parts[:-1], parts[-1][:-len(KERNEL)] + "lora_a"))


def modules(family: Family, cfg: TransformerConfig) -> list[Module]:
    """Every module of `family`'s checkpoints of `cfg` that can carry an adapter, from its
    rules (`cfg.lora` is ignored)."""
    cfg = cfg.replace(lora=None)
    widths, shapes = projection_widths(cfg), parameter_shapes(cfg)
    out = []
    for rule in family.rules(cfg):
        sites = [kernel_site(p) for p in rule.ours]
        if len(rule.theirs) != 1 or not sites or None in sites:   # no sites: a table rule
            continue
        name = rule.theirs[0].rsplit(".", 1)[0]
        kernels, stack = list(rule.ours), rule.stack
        if rule.stack is None and kernels[0].startswith("cross_kv/") and "[" not in kernels[0]:
            # A whole kernel stacked over layers (the project's own files): one module per
            # layer, named where the layer's cross-attention is.
            name, stack = f"decoder.layer_{{i}}.cross_attention.{sites[0][2]}", "decoder"
            kernels = [f"{k}[{{i}}]" for k in kernels]
        parts = tuple(Part(s, k, *widths[s]) for s, k in zip(sites, kernels, strict=True))
        out.append(Module(name, stack, parts, _transposed(rule, parts, cfg, shapes)))
    return out


def _transposed(rule: Rule, parts: tuple[Part, ...], cfg: TransformerConfig,
                shapes: dict) -> bool:
    """Whether the rule stores the weight [in, out]: its layout run on empty kernels."""
    kernels = [np.empty(expected_shape(p.format(i=0), shapes), np.float32) for p in rule.ours]
    stored = rule.layout.to_theirs(kernels, cfg)[0].shape
    width_in, width_out = parts[0].width_in, sum(p.width_out for p in parts)
    return stored == (width_in, width_out) != (width_out, width_in)


def module_universe(family: Family, cfg: TransformerConfig) -> set[str]:
    """Every module name of the base model that its weight map implies (each key's
    modules and their parents): what PEFT's `target_modules` could select."""
    cfg = cfg.replace(lora=None)
    names = set()
    for rule in family.rules(cfg):
        layers = range(1) if rule.stack is None else range(stack_depth(cfg, rule.stack))
        for key in rule.theirs:
            parts = key.split(".")[:-1]
            for i in layers:
                names.update(".".join(parts[:n]).format(i=i) for n in range(1, len(parts) + 1))
    return names


# Tensors, one copy of a module at a time. Flat: A [in, r] and B [r, out] (ours, heads
# flattened); theirs: lora_A [r, in] and lora_B [out, r].

@dataclasses.dataclass(frozen=True)
class FusedBlocks:
    """How the parts of a fused module share its adapter of rank sum(ranks): part p holds
    columns [sum(ranks[:p]), sum(ranks[:p + 1])) of lora_B in its own rows (zeros in the
    others' rows) and the same rows of lora_A, with its own alpha (the module's alpha
    gives the same scale at the whole rank). A part of rank 0 has no adapter. Without
    blocks (a fused adapter made by PEFT), every part has the whole rank: lora_A whole
    and its own rows of lora_B."""

    ranks: tuple[int, ...]
    alphas: tuple[float | None, ...]

    def columns(self) -> list[slice]:
        edges = np.cumsum((0, *self.ranks))
        return [slice(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:], strict=True)]


def row_slices(module: Module) -> list[slice]:
    """Each part's rows of the module's output."""
    edges = np.cumsum((0, *(p.width_out for p in module.parts)))
    return [slice(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:], strict=True)]


def to_theirs(module: Module, flat: list[tuple[np.ndarray, np.ndarray] | None],
              blocks: FusedBlocks | None) -> tuple[np.ndarray, np.ndarray]:
    """(lora_A [R, in], lora_B [out, R]) of one copy of `module` from each part's flat
    (A, B), None for a part without one. `blocks` None: one part, or every part sharing
    one A (the first part's)."""
    if blocks is None:
        a_Ir = next(ab for ab in flat if ab is not None)[0]
        b_rO = np.concatenate([ab[1] for ab in flat], axis=1)
        return a_Ir.T, b_rO.T
    a_RI = np.concatenate([ab[0].T for ab in flat if ab is not None], axis=0)
    b_OR = np.zeros((module.width_out, a_RI.shape[0]), a_RI.dtype)
    for ab, rows, cols in zip(flat, row_slices(module), blocks.columns(), strict=True):
        if ab is not None:
            b_OR[rows, cols] = ab[1].T
    return a_RI, b_OR


def to_ours(module: Module, a_RI: np.ndarray, b_OR: np.ndarray,
            blocks: FusedBlocks | None) -> list[tuple[np.ndarray, np.ndarray] | None]:
    """Each part's flat (A [in, r], B [r, out]) from one copy's lora_A and lora_B (views),
    None for a part of rank 0; the inverse of `to_theirs`."""
    rows = row_slices(module)
    if blocks is None:
        return [(a_RI.T, b_OR[r].T) for r in rows]
    return [(a_RI[c].T, b_OR[r, c].T) if c.stop > c.start else None
            for r, c in zip(rows, blocks.columns(), strict=True)]


def off_blocks_zero(module: Module, b_OR: np.ndarray, blocks: FusedBlocks) -> bool:
    """Whether lora_B is zero outside the parts' blocks (as `to_theirs` writes it)."""
    mask = np.ones(b_OR.shape, bool)
    for rows, cols in zip(row_slices(module), blocks.columns(), strict=True):
        mask[rows, cols] = False
    return not np.any(b_OR[mask])


# PEFT's names: `target_modules` (a list of name suffixes, or a regex matched whole) and the
# keys of `rank_pattern` / `alpha_pattern` (regexes matched against a name's end).

def selects(target_modules, name: str) -> bool:
    """Whether PEFT's `target_modules` (a regex string, or names) selects module `name`."""
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, name) is not None
    return any(name == t or name.endswith(f".{t}") for t in target_modules)


def pattern_value(patterns: dict, name: str, default):
    """PEFT's value for module `name` from `rank_pattern` or `alpha_pattern`: the first
    key that matches the name's end, else `default`."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def _suffix(names: list[str], among: Iterable[str], allowed: set[str]) -> str | None:
    """The shortest dotted suffix common to `names` whose matches in `among` (a name equal
    to it, or ending with "." and it) are all in `allowed`, or None."""
    split = [n.split(".") for n in names]
    for n in range(1, min(map(len, split)) + 1):
        tails = {".".join(s[-n:]) for s in split}
        if len(tails) == 1:
            tail = tails.pop()
            hits = {m for m in among if m == tail or m.endswith("." + tail)}
            if hits <= allowed:
                return tail
    return None


def _alternation(patterns: Iterable[str]) -> str:
    """One regex of module names with `{i}` for any layer."""
    escaped = sorted({re.escape(p).replace(re.escape("{i}"), r"\d+") for p in patterns})
    return escaped[0] if len(escaped) == 1 else "(?:" + "|".join(escaped) + ")"


def target_modules(groups: dict[str, list[str]], universe: set[str]) -> list[str] | str:
    """PEFT's `target_modules` selecting exactly the adapted modules: `groups` maps a name
    pattern (with `{i}`) to its copies' names. Name suffixes when each group has one that
    selects nothing else of `universe`; else one regex."""
    adapted = {n for names in groups.values() for n in names}
    tails = [_suffix(names, universe, adapted) for names in groups.values()]
    if None not in tails:
        return sorted(set(tails))
    return _alternation(groups)


def pattern_key(names: list[str], pattern: str, adapted: set[str]) -> str:
    """A `rank_pattern` key for the modules `names` (copies of `pattern`) that matches no
    other adapted module."""
    tail = _suffix(names, adapted, set(names))
    return re.escape(tail) if tail is not None else _alternation([pattern])
