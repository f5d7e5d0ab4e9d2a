"""Low-rank adapters (Hu et al. 2021, LoRA): small trainable matrices beside frozen weights.

A targeted projection `y = x W` (W a kernel [in..., out...]) becomes

    y = x W + scale * dropout(x) A B        A [in..., r], B [r, out...], scale = alpha / r

with B zero at initialisation, so an adapted model starts equal to its base. The adapter of
a projection lives beside its kernel, `.../query/lora_a` and `.../query/lora_b` (the
cross-attention keys and values, stacked over layers: `cross_kv/key_lora_a` [L, D, r]), and
only those leaves train (`split` and `join` separate them from the base and put them back;
`merge` folds them into the kernels).

A projection is named by where it sits, `stack.block.name`:

    stack   encoder | decoder          (an encoder-only model's stack is "encoder")
    block   self_attention | cross_attention | mlp
    name    query | key | value | out  (attention)   gate | up | down  (MLP)
            query_a | query_b | kv_a | out  (latent attention's: `models.latent_attention`)

A target names the last one, two or three parts and adapts every projection it ends:
"query" (each attention's), "cross_attention.value", "decoder.mlp.down"; or a block, for
all of its projections: "mlp", "self_attention", "decoder.cross_attention".

    cfg = cfg.replace(lora=LoraConfig(rank=8, alpha=16, targets=("query", "value")))
    params = models.build(cfg).init(key, tokens)["params"]       # base leaves + adapters
    base, adapters = split(params)
    merged_cfg, merged = merge(cfg, join(base, adapters))         # the plain model, same logits
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import string

import jax
import jax.numpy as jnp

from models.errors import UserError, check_positive_int
from models.quant import is_quantized

STACKS = ("encoder", "decoder")
# Latent attention's projections (`models.latent_attention`) are self-attention's too: its
# low-rank query pair and the latent's projection (kv_b, read whole, takes no adapter).
LATENT = ("query_a", "query_b", "kv_a")
BLOCKS = {"self_attention": ("query", "key", "value", "out", *LATENT),
          "cross_attention": ("query", "key", "value", "out"),
          "mlp": ("gate", "up", "down")}
NAMES = ("query", "key", "value", "out", *LATENT, "gate", "up", "down")
Site = tuple[str, str, str]           # (stack, block, name)


def _targets(value) -> tuple[str, ...]:
    if isinstance(value, str):
        value = tuple(t.strip() for t in value.split(",") if t.strip())
    if not isinstance(value, (list, tuple)) or not value:
        raise UserError(f"lora.targets={value!r} must name at least one projection, "
                         f"such as ('query', 'value')")
    for target in value:
        _parse(target)
    return tuple(dict.fromkeys(value))


def _parse(target) -> tuple[str, ...]:
    """A target's parts, checked: [[stack.]block.]name, or [stack.]block for all of a
    block's projections."""
    parts = tuple(target.split(".")) if isinstance(target, str) else ()
    named = bool(parts) and parts[-1] in NAMES
    block = parts[-2:-1] if named else parts[-1:]
    ok = (1 <= len(parts) <= 3 - (not named)
          and (parts[-1] in NAMES or parts[-1] in BLOCKS)
          and (not block or block[0] in BLOCKS and (not named or parts[-1] in BLOCKS[block[0]]))
          and (len(parts) < 2 + named or parts[0] in STACKS))
    if not ok:
        every = [*NAMES, *BLOCKS, *(f"{b}.{n}" for b, names in BLOCKS.items() for n in names)]
        close = difflib.get_close_matches(str(target), every, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UserError(f"lora target {target!r} is not a projection{hint}: "
                         f"[[encoder|decoder.]self_attention|cross_attention|mlp.]name, "
                         f"name one of {NAMES}, or a block alone for all of its projections")
    return parts


def matches(target: str, site: Site) -> bool:
    """Whether `target` ends the projection `site` ("value" ends ("decoder",
    "cross_attention", "value")), or names its block ("mlp", "decoder.self_attention")."""
    parts = _parse(target)
    if parts[-1] in BLOCKS:
        return site[:-1][-len(parts):] == parts
    return site[-len(parts):] == parts


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Which projections carry adapters, and their shape.

    Attributes:
        rank: r, the adapters' inner width.
        alpha: the scale's numerator: the update is alpha / r times A B (PEFT's lora_alpha).
        dropout: dropout on the adapters' input while training (PEFT's lora_dropout).
        targets: the adapted projections (see the module docstring).
        overrides: (target, rank, alpha) for targets whose rank or alpha differ from the
            others (an adapter loaded with PEFT's rank_pattern, or a fused projection's).
        rslora: scale by alpha / sqrt(r) instead (Kalajdzievski 2023; PEFT's use_rslora).
        per_row: each adapter leaf carries a leading row axis (after a stack's layer axis):
            row b of a batch is adapted by its own A_b, B_b. A serving engine mixes
            several adapters of one base in a step this way (`serve.adapters`).
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("query", "value")
    overrides: tuple[tuple[str, int, float], ...] = ()
    rslora: bool = False
    per_row: bool = False

    def __post_init__(self):
        set_ = _setter(self)
        set_("rank", check_positive_int(self.rank, "lora.rank"))
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not (
                self.alpha > 0 and math.isfinite(self.alpha)):
            raise UserError(f"lora.alpha={self.alpha!r} must be a number > 0")
        set_("alpha", float(self.alpha))
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not (
                0.0 <= self.dropout < 1.0):
            raise UserError(f"lora.dropout={self.dropout!r} must be in [0, 1)")
        set_("dropout", float(self.dropout))
        set_("targets", _targets(self.targets))
        overrides = []
        for entry in self.overrides:
            target, rank, alpha = entry
            if target not in self.targets:
                raise UserError(f"lora.overrides names {target!r}, which is not among the "
                                 f"targets {self.targets}")
            overrides.append((target, check_positive_int(rank, f"lora rank of {target}"),
                              float(alpha)))
        set_("overrides", tuple(overrides))
        if not isinstance(self.rslora, bool):
            raise UserError(f"lora.rslora={self.rslora!r} must be a bool")
        if not isinstance(self.per_row, bool):
            raise UserError(f"lora.per_row={self.per_row!r} must be a bool")

    @classmethod
    def from_dict(cls, fields: dict) -> LoraConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise UserError(f"unknown lora field(s) {unknown}; known: {sorted(known)}")
        fields = dict(fields)
        fields["overrides"] = tuple(tuple(o) for o in fields.get("overrides", ()))
        fields["targets"] = _targets(fields.get("targets", cls.targets))
        return cls(**fields)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "targets": list(self.targets),
                "overrides": [list(o) for o in self.overrides]}

    def rank_alpha(self, site: Site) -> tuple[int, float] | None:
        """(rank, alpha) of the adapter at `site`, or None where no target ends it. The
        most specific matching target (most parts) decides."""
        hits = sorted((t for t in self.targets if matches(t, site)),
                      key=lambda t: -len(_parse(t)))
        if not hits:
            return None
        rank, alpha = self.rank, self.alpha
        for target, r, a in self.overrides:
            if target == hits[0]:
                rank, alpha = r, a
        return rank, alpha

    def shape_of(self, site: Site) -> tuple[int, float] | None:
        """(rank, scale) of the adapter at `site`, or None where no target ends it."""
        found = self.rank_alpha(site)
        return None if found is None else (found[0], scale(*found, rslora=self.rslora))


def scale(rank: int, alpha: float, *, rslora: bool = False) -> float:
    """The update's factor for an adapter of `rank` and `alpha`: alpha / r, or alpha /
    sqrt(r) with `rslora`."""
    return alpha / (math.sqrt(rank) if rslora else rank)


def alpha_for(rank: int, scale_: float, *, rslora: bool = False) -> float:
    """The alpha that gives an adapter of `rank` the factor `scale_` (`scale`'s inverse)."""
    return scale_ * (math.sqrt(rank) if rslora else rank)


def _setter(obj):
    """A setter of a frozen dataclass's fields for its own `__post_init__`."""
    return lambda name, value: object.__setattr__(obj, name, value)


def projection_widths(cfg) -> dict[Site, tuple[int, int]]:
    """Every projection a model of `cfg` (a `TransformerConfig`) has: site -> (in, out)
    widths, flattened over heads."""
    d, q, kv, f = (cfg.d_model, cfg.num_heads * cfg.head_dim,
                   cfg.num_kv_heads * cfg.head_dim, cfg.mlp_dim)
    attention = {"query": (d, q), "key": (d, kv), "value": (d, kv), "out": (q, d)}
    if cfg.latent:
        attention = {"kv_a": (d, cfg.kv_lora_rank + cfg.rope_dim),
                     "out": (cfg.num_heads * cfg.value_dim, d)}
        attention.update({"query": (d, q)} if cfg.q_lora_rank is None else
                          {"query_a": (d, cfg.q_lora_rank), "query_b": (cfg.q_lora_rank, q)})
    mlp = {"up": (d, f), "down": (f, d)}
    if cfg.activation in ("swiglu", "geglu", "geglu_exact"):
        mlp["gate"] = (d, f)
    stacks = {"decoder_only": ("decoder",), "encoder_only": ("encoder",),
              "encoder_decoder": ("encoder", "decoder")}[cfg.architecture]
    out = {}
    for stack in stacks:
        blocks = {"self_attention": attention, "mlp": mlp}
        if stack == "decoder" and cfg.is_encoder_decoder:
            blocks["cross_attention"] = attention
        for block, names in blocks.items():
            out.update({(stack, block, name): w for name, w in names.items()})
    return out


def check_against(lora: LoraConfig, cfg) -> None:
    """Refuses targets that end no projection of `cfg`'s model, and ranks above a
    projection's width.

    Raises:
        UserError: naming the target (and the model's projections) or the rank and width.
    """
    widths = projection_widths(cfg)
    for target in lora.targets:
        if not any(matches(target, site) for site in widths):
            have = sorted({".".join(site[1:]) for site in widths})
            raise UserError(f"lora target {target!r} names no projection of this "
                             f"{cfg.architecture} model; it has {have}")
    for site, (w_in, w_out) in widths.items():
        shape = lora.shape_of(site)
        if shape is not None and shape[0] > min(w_in, w_out):
            raise UserError(f"lora rank {shape[0]} of {'.'.join(site)} is above the "
                             f"projection's width min({w_in}, {w_out}) = {min(w_in, w_out)}")


# The parameter tree: adapters beside their kernels.

ADAPTER_LEAVES = ("lora_a", "lora_b")


def is_adapter(name: str) -> bool:
    """Whether a leaf name is an adapter's ("lora_a", "lora_b", "key_lora_a", ...)."""
    return name.endswith(ADAPTER_LEAVES)


def site_of(path: tuple[str, ...]) -> Site | None:
    """The projection a module path (or an adapter leaf's path) belongs to, or None.

        ("decoder", "layer_3", "self_attention", "query")  -> decoder self_attention query
        ("decoder", "layers", "mlp", "up", "lora_b")        -> decoder mlp up
        ("cross_kv", "value_lora_a")                        -> decoder cross_attention value
    """
    if path and is_adapter(path[-1]):
        if path[0] == "cross_kv":
            return "decoder", "cross_attention", path[-1].split("_")[0]
        path = path[:-1]
    if len(path) >= 3 and path[0] in STACKS and path[-1] in BLOCKS.get(path[-2], ()):
        return path[0], path[-2], path[-1]
    return None


def split(params: dict) -> tuple[dict, dict]:
    """(base, adapters): the same nested tree cut in two, every adapter leaf in the second."""
    base, adapters = {}, {}
    for key, value in params.items():
        if isinstance(value, dict):
            b, a = split(value)
            if b:
                base[key] = b
            if a:
                adapters[key] = a
        elif is_adapter(key):
            adapters[key] = value
        else:
            base[key] = value
    return base, adapters


def join(base: dict, adapters: dict) -> dict:
    """The inverse of `split`: one tree holding both (no leaf may be in both)."""
    out = dict(base)
    for key, value in adapters.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = join(out[key], value)
        elif key in out:
            raise ValueError(f"join: {key!r} is in both trees")
        else:
            out[key] = value
    return out


def delta(a, b, kernel_ndim: int):
    """A B contracted over the rank: [batch..., in..., r] x [batch..., r, out...] ->
    [batch..., in..., out...] (a kernel's shape, `kernel_ndim` dimensions)."""
    batch = a.ndim + b.ndim - kernel_ndim - 2
    letters = iter(string.ascii_letters)
    lead = "".join(next(letters) for _ in range(batch))
    ins = "".join(next(letters) for _ in range(a.ndim - batch - 1))
    outs = "".join(next(letters) for _ in range(b.ndim - batch - 1))
    r = next(letters)
    return jnp.einsum(f"{lead}{ins}{r},{lead}{r}{outs}->{lead}{ins}{outs}",
                      a.astype(jnp.float32), b.astype(jnp.float32))


def merge(cfg, params: dict):
    """(the config without adapters, the params with each adapter folded into its kernel,
    W + scale * A B, in the kernel's dtype). The merged model computes what the adapted one
    does, up to float rounding."""
    if cfg.lora is None:
        return cfg, params
    if is_quantized(params):
        raise UserError("merging adapters into a quantized base would round the sum again: "
                        "merge into the float base (models.load(base, adapter=..., "
                        "merge=True)), then quantize")

    def fold(tree: dict, path: tuple[str, ...]) -> dict:
        out = {}
        for key, value in tree.items():
            if isinstance(value, dict):
                out[key] = fold(value, (*path, key))
            elif not is_adapter(key):
                out[key] = value
        for key in tree:
            if key.endswith("lora_a"):
                prefix = key[:-len("lora_a")]
                kernel = tree[prefix + "kernel"]
                _, scale = cfg.lora.shape_of(site_of((*path, key)))
                update = scale * delta(tree[key], tree[prefix + "lora_b"], kernel.ndim)
                out[prefix + "kernel"] = (kernel.astype(jnp.float32) + update).astype(
                    kernel.dtype)
        return out

    return cfg.replace(lora=None), jax.jit(lambda p: fold(p, ()))(params)
