"""LoRA adapters in and out of PEFT's directory layout: `adapter_config.json` and
`adapter_model.safetensors`, with the tensor names PEFT gives the family's modules
(`peft_map`), so that `peft.PeftModel.from_pretrained(transformers_model, dir)` loads what
`write` writes and `read` loads what PEFT saves:

    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight    [r, D]
    base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight    [N*H, r]

The project's own model type writes the same layout under its own module names
("base_model.model.decoder.layer_0.self_attention.query.lora_A.weight").

Reading derives the `LoraConfig` from the tensors present (targets fully qualified,
"decoder.self_attention.query"; overrides where rank or alpha differ from the most common),
honouring `rank_pattern`, `alpha_pattern` and `use_rslora`; and refuses by name what this
project would compute differently from PEFT (`check_fields`), tensors of modules the base
does not have or PEFT would not select, tensors that are not LoRA's A and B, shapes another
base gave, an adapter on only some layers of a stack, and tensors holding NaN or Inf (as the
base's are refused, with the same `allow_non_finite` escape).
"""

from __future__ import annotations

import collections
import json
import os

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from models import atomic
from models.config import TransformerConfig
from models.errors import UserError, is_int
from models.lora import LoraConfig, alpha_for, scale, split
from models.pretrained import peft_checks
from models.pretrained.convert import ParamTree, check_finite, leaf_at, non_finite_counts
from models.pretrained.family import Family
from models.pretrained.files import read_json, write_json
from models.pretrained.mapping import expected_shape, our_slot, parameter_shapes
from models.pretrained.peft_map import (
    FusedBlocks,
    Module,
    module_universe,
    modules,
    off_blocks_zero,
    pattern_key,
    pattern_value,
    target_modules,
    to_ours,
    to_theirs,
)

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."            # PEFT's wrappers around the transformers model
A, B = ".lora_A.weight", ".lora_B.weight"
# safetensors metadata: {module name pattern: [[rank, alpha] of each part]} for the fused
# modules we write with a block of lora_B per part (PEFT ignores the metadata).
BLOCKS = "zoo_fused_blocks"
TASKS = {"decoder_only": "CAUSAL_LM", "encoder_decoder": "SEQ_2_SEQ_LM",
         "encoder_only": "FEATURE_EXTRACTION"}


def _number(x: float):
    """JSON's number for an alpha: an int where it is one (as PEFT writes them)."""
    return int(x) if float(x).is_integer() else float(x)


# Writing.

def write(path: str, family: Family, cfg: TransformerConfig, params: dict, *,
          base_name_or_path: str = "") -> None:
    """Writes the adapters of `params` (a joined tree or the adapters alone) for
    `cfg.lora` as a PEFT adapter directory for `family`'s checkpoints, whole or not at all.

    Raises:
        UserError: `cfg.lora` None, an adapter leaf missing or misshapen, or the parts of a
            fused module (GPT-2's c_attn) adapted at different scales.
    """
    lora = cfg.lora
    if lora is None:
        raise UserError("config.lora is None: there are no adapters to save")
    adapters = split(params)[1]
    shapes = parameter_shapes(cfg)
    tensors, ranks, listed = {}, {}, {}
    for module in modules(family, cfg):
        found = [lora.rank_alpha(s) for s in module.sites]
        if all(f is None for f in found):
            continue
        copies = [[_flat(adapters, cfg, shapes, part, i) if f else None
                   for part, f in zip(module.parts, found, strict=True)]
                  for i, _ in module.names(cfg)]
        rank, alpha, blocks = _fused_shape(module, lora, found, copies)
        for (_, name), flat in zip(module.names(cfg), copies, strict=True):
            a_RI, b_OR = to_theirs(module, flat, blocks)
            tensors[PREFIX + name + A], tensors[PREFIX + name + B] = a_RI, b_OR
        ranks[module.name] = ([n for _, n in module.names(cfg)], rank, alpha)
        if blocks is not None:
            listed[module.name] = [[r, a] for r, a in zip(blocks.ranks, blocks.alphas,
                                                          strict=True)]
    hf = _config_json(family, cfg, ranks, base_name_or_path)
    with atomic.replaced_dir(path) as tmp:
        write_json(os.path.join(tmp, CONFIG), hf)
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
                  os.path.join(tmp, WEIGHTS),
                  metadata={"format": "pt", BLOCKS: json.dumps(listed, sort_keys=True)})


def _flat(adapters: dict, cfg: TransformerConfig, shapes: dict, part, i: int):
    """Layer i's (A [in, r], B [r, out]) of a part, flattened over heads, on the host."""
    out = []
    for which in ("a", "b"):
        path = part.leaf(which, i)
        slot, index = our_slot(path, cfg)
        leaf = leaf_at(adapters, slot, path)
        array = np.asarray(leaf if index is None else leaf[index])
        want = expected_shape(path, shapes)
        if array.shape != want:
            raise UserError(f"adapter {path} has shape {array.shape}; config.lora gives "
                             f"{want}")
        out.append(array)
    a, b = out
    return a.reshape(-1, a.shape[-1]), b.reshape(b.shape[0], -1)


def _fused_shape(module: Module, lora: LoraConfig, found, copies):
    """(rank, alpha, blocks) of a module's adapter. One part: its own. Fused parts must
    share a scale; they share one lora_A (rank r) when all are adapted at one rank with
    equal A in every layer, else each has its block (rank the sum, alpha keeping the
    scale)."""
    if len(found) == 1:
        return (*found[0], None)
    scales = {scale(*f, rslora=lora.rslora) for f in found if f}
    if len(scales) > 1:
        named = ", ".join(f"{'.'.join(p.site)} {scale(*f, rslora=lora.rslora):g}"
                          for p, f in zip(module.parts, found, strict=True) if f)
        raise UserError(f"{module.name} holds several projections in one weight, adapted "
                         f"at different scales ({named}); PEFT gives it one scale: give them "
                         f"one alpha / rank")
    ranks = [f[0] if f else 0 for f in found]
    if 0 not in ranks and len(set(ranks)) == 1 and all(
            all(np.array_equal(flat[0][0], ab[0]) for ab in flat) for flat in copies):
        return (*found[0], None)
    rank = sum(ranks)
    alpha = alpha_for(rank, scales.pop(), rslora=lora.rslora)
    return rank, alpha, FusedBlocks(tuple(ranks), tuple(f[1] if f else None for f in found))


def _config_json(family: Family, cfg: TransformerConfig, ranks: dict,
                 base_name_or_path: str) -> dict:
    """adapter_config.json: PEFT's LoraConfig fields, rank_pattern and alpha_pattern for the
    modules whose rank or alpha differ from the most common (the config's own first)."""
    lora = cfg.lora
    pairs = collections.Counter((r, a) for _, r, a in ranks.values())
    rank, alpha = ((lora.rank, lora.alpha) if (lora.rank, lora.alpha) in pairs
                   else pairs.most_common(1)[0][0])
    adapted = {n for names, _, _ in ranks.values() for n in names}
    rank_pattern, alpha_pattern = {}, {}
    for pattern, (names, r, a) in ranks.items():
        if (r, a) != (rank, alpha):
            key = pattern_key(names, pattern, adapted)
            if r != rank:
                rank_pattern[key] = r
            if a != alpha:
                alpha_pattern[key] = _number(a)
    groups = {pattern: names for pattern, (names, _, _) in ranks.items()}
    return {
        "peft_type": "LORA", "task_type": TASKS[cfg.architecture],
        "base_model_name_or_path": base_name_or_path or None, "revision": None,
        "inference_mode": True, "r": rank, "lora_alpha": _number(alpha),
        "lora_dropout": lora.dropout, "use_rslora": lora.rslora,
        "target_modules": target_modules(groups, module_universe(family, cfg)),
        "exclude_modules": None, "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern,
        "fan_in_fan_out": any(m.transposed for m in modules(family, cfg)), "bias": "none",
        "lora_bias": False, "use_dora": False, "modules_to_save": None,
        "init_lora_weights": True, "layers_to_transform": None, "layers_pattern": None,
        "auto_mapping": None}


# Reading.

def named_base(adapter_dir: str) -> str:
    """The base model directory an adapter directory names (its adapter_config.json's
    `base_model_name_or_path`), for loading the adapter alone.

    Raises:
        UserError: it names none, or nothing that is a directory here (a hub name: load
            that base yourself and give the adapter with it).
    """
    base = _read_config(adapter_dir).get("base_model_name_or_path")
    if not base:
        raise UserError(f"{adapter_dir} holds an adapter whose {CONFIG} names no base "
                         "(base_model_name_or_path); load it onto its base: "
                         f"models.load(BASE, adapter={adapter_dir!r})")
    if not os.path.isdir(base):
        raise UserError(f"{adapter_dir}/{CONFIG} names base_model_name_or_path={base!r}, "
                         "which is not a model directory here; load it onto a copy of that "
                         f"base: models.load(BASE, adapter={adapter_dir!r})")
    return base


def is_adapter_dir(path: str) -> bool:
    """A directory of adapters alone: adapter_config.json and no config.json."""
    return (os.path.isfile(os.path.join(path, CONFIG))
            and not os.path.exists(os.path.join(path, "config.json")))


def read(adapter_dir: str, family: Family, cfg: TransformerConfig, *, base_dir: str,
         base_hf: dict, check_base_name: bool = True,
         allow_non_finite: bool = False) -> tuple[LoraConfig, dict]:
    """(the LoraConfig, the adapter tree) of a PEFT adapter directory for the base model
    `cfg` of `family` (read from `base_dir`, whose config.json is `base_hf`). The tree has
    the model's layout (scanned or not) and `cfg.param_dtype`; `join` it with the base's
    parameters.

    Args:
        allow_non_finite: load tensors holding NaN or Inf (a warning names each one and
            its counts) instead of refusing the adapter, as `models.load` does for a base.

    Raises:
        UserError: naming the field, tensor or shape that this base cannot load exactly,
            and (unless `allow_non_finite`) every tensor holding NaN or Inf, with its
            counts.
        FileNotFoundError: naming the missing directory or file.
    """
    hf = _read_config(adapter_dir)
    fields = peft_checks.check_fields(hf, adapter_dir)
    if check_base_name:
        peft_checks.check_base(fields["base_model_name_or_path"], base_dir, base_hf)
    with safe_open(os.path.join(adapter_dir, WEIGHTS), framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata() or {}
    found = peft_checks.present_modules(tensors, family, cfg, fields, adapter_dir)
    for module, names in found.items():
        _check_shapes(module, names, tensors, fields, adapter_dir)
    check_finite(f"adapter {adapter_dir}",
                 [c for k in sorted(tensors) for c in non_finite_counts(k, tensors[k])],
                 allow=allow_non_finite)
    blocks = _read_blocks(meta, found, tensors, fields)
    shapes: dict[tuple, tuple[int, float]] = {}
    for module, names in found.items():
        _site_shapes(shapes, module, names, tensors, fields, blocks=blocks.get(module.name))
    lora = _lora_config(shapes, fields)
    lora_cfg = cfg.replace(lora=lora)
    want = parameter_shapes(lora_cfg)
    tree = ParamTree(lora_cfg, None)
    for module, names in found.items():
        for i, name in names:
            flat = to_ours(module, tensors[PREFIX + name + A], tensors[PREFIX + name + B],
                           blocks.get(module.name))
            for part, ab in zip(module.parts, flat, strict=True):
                if ab is None:
                    continue
                paths = [part.leaf("a", i), part.leaf("b", i)]
                tree.place(paths, [x.reshape(expected_shape(p, want))
                                   for x, p in zip(ab, paths, strict=True)])
    return lora, tree.params


def _read_config(adapter_dir: str) -> dict:
    if not os.path.isdir(adapter_dir):
        raise FileNotFoundError(f"adapter directory {adapter_dir!r} " + (
            "is a file, not a directory" if os.path.exists(adapter_dir) else "does not exist"))
    config = os.path.join(adapter_dir, CONFIG)
    if not os.path.exists(config):
        raise FileNotFoundError(f"no {CONFIG} in {adapter_dir}")
    if not os.path.exists(os.path.join(adapter_dir, WEIGHTS)):
        if os.path.exists(os.path.join(adapter_dir, "adapter_model.bin")):
            raise UserError(f"{adapter_dir} has its adapter only as adapter_model.bin, which "
                             "loading would have to unpickle; this project reads safetensors "
                             "only (PEFT's save_pretrained writes them by default)")
        raise FileNotFoundError(f"no {WEIGHTS} in {adapter_dir}")
    return read_json(config)


def _read_blocks(meta: dict, found: dict, tensors: dict, fields: dict) -> dict:
    """module name -> `FusedBlocks`, for the fused modules we wrote with one block per
    part (see `to_theirs`) where the file still holds them so: ranks that add up, alphas
    of the module's scale, zeros outside the blocks in every layer. Anything else loads
    as PEFT made it (every part the whole rank), which computes the same."""
    try:
        listed = json.loads(meta.get(BLOCKS, "{}"))
    except json.JSONDecodeError:
        return {}
    if not isinstance(listed, dict):
        return {}
    out = {}
    for module, names in found.items():
        blocks = _parse_blocks(listed.get(module.name), len(module.parts))
        if blocks is not None and _blocks_hold(module, names, blocks, tensors, fields):
            out[module.name] = blocks
    return out


def _parse_blocks(entry, parts: int) -> FusedBlocks | None:
    """[[rank, alpha], ...] of each part (alpha a number > 0 where rank > 0), or None
    where it is not that."""
    def ok(e):
        return (isinstance(e, list) and len(e) == 2 and is_int(e[0]) and e[0] >= 0 and (
            e[0] == 0 or (isinstance(e[1], (int, float)) and not isinstance(e[1], bool)
                          and e[1] > 0)))

    if not isinstance(entry, list) or len(entry) != parts or not all(map(ok, entry)):
        return None
    return FusedBlocks(tuple(e[0] for e in entry), tuple(e[1] for e in entry))


def _blocks_hold(module: Module, names, blocks: FusedBlocks, tensors: dict,
                 fields: dict) -> bool:
    """Whether every copy of the module is `blocks`' form: its rank their sum, each part's
    scale the module's, zeros outside the blocks."""
    rank, rslora = sum(blocks.ranks), fields["use_rslora"]
    alpha = pattern_value(fields["alpha_pattern"], names[0][1], fields["lora_alpha"])
    same_scale = all(np.isclose(scale(r, a, rslora=rslora), scale(rank, alpha, rslora=rslora),
                                rtol=1e-6, atol=0)
                     for r, a in zip(blocks.ranks, blocks.alphas, strict=True) if r)
    return same_scale and all(
        tensors[PREFIX + n + B].shape[1] == rank
        and off_blocks_zero(module, tensors[PREFIX + n + B], blocks) for _, n in names)


def _check_shapes(module: Module, names, tensors: dict, fields: dict, where: str) -> None:
    """lora_A [r, in] and lora_B [out, r] with the base's widths and the config's rank."""
    for _, name in names:
        a, b = tensors[PREFIX + name + A], tensors[PREFIX + name + B]
        r = a.shape[0] if a.ndim == 2 else -1
        for key, x, want in ((A, a, (r, module.parts[0].width_in)),
                             (B, b, (module.width_out, r))):
            if x.shape != want:
                raise UserError(f"adapter {where}: {PREFIX + name + key} has shape "
                                 f"{x.shape}, the base expects {want} (an adapter made for "
                                 f"another base?)")
        rank = pattern_value(fields["rank_pattern"], name, fields["r"])
        if rank != r:
            raise UserError(f"adapter {where}: {PREFIX + name + A} has rank {r}, but "
                             f"{CONFIG} gives {name} rank {rank}")


def _site_shapes(out: dict, module: Module, names, tensors: dict, fields: dict, *,
                 blocks: FusedBlocks | None) -> None:
    """Adds site -> (rank, alpha) of a module's parts to `out`: one for all the layers."""
    for i, name in names:
        rank = tensors[PREFIX + name + A].shape[0]
        alpha = pattern_value(fields["alpha_pattern"], name, fields["lora_alpha"])
        for k, part in enumerate(module.parts):
            r, a = (rank, alpha) if blocks is None else (blocks.ranks[k], blocks.alphas[k])
            if r == 0:
                continue
            if out.setdefault(part.site, (r, a)) != (r, a):
                raise UserError(
                    f"{CONFIG} gives {name} (layer {i}) rank {r} and alpha {a}, but other "
                    f"layers of {'.'.join(part.site)} rank {out[part.site][0]} and alpha "
                    f"{out[part.site][1]}: this project's adapters have one rank and alpha "
                    "per projection")


def _lora_config(shapes: dict, fields: dict) -> LoraConfig:
    """Targets fully qualified, in the model's order; the most common (rank, alpha) (the
    file's r and lora_alpha first) the default, overrides for the others."""
    pairs = collections.Counter(shapes.values())
    default = ((fields["r"], fields["lora_alpha"]) if (fields["r"], fields["lora_alpha"])
               in pairs else pairs.most_common(1)[0][0])
    targets = [".".join(s) for s in shapes]
    overrides = tuple((".".join(s), r, a) for s, (r, a) in shapes.items() if (r, a) != default)
    return LoraConfig(rank=default[0], alpha=default[1], dropout=fields["lora_dropout"],
                      targets=tuple(targets), overrides=overrides,
                      rslora=fields["use_rslora"])
