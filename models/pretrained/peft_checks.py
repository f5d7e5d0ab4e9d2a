"""What a PEFT adapter directory must be for this project to compute what PEFT computes:
its adapter_config.json fields (`check_fields`), the base it was made for (`check_base`),
and its tensors' names (`present_modules`)."""

from __future__ import annotations

import collections
import os

from models.config import TransformerConfig
from models.errors import UserError, is_int
from models.pretrained.family import Family
from models.pretrained.peft_map import Module, module_universe, modules, selects

CONFIG = "adapter_config.json"
PREFIX = "base_model.model."
LORA_TENSORS = (".lora_A.weight", ".lora_B.weight")
ALL_LINEAR = "all-linear"

# Fields read, with their defaults (PEFT's LoraConfig's).
READ = {"peft_type": None, "r": 8, "lora_alpha": 8, "lora_dropout": 0.0, "use_rslora": False,
        "rank_pattern": {}, "alpha_pattern": {}, "target_modules": None,
        "exclude_modules": None, "base_model_name_or_path": None}
# Fields that must be off (null, false or empty): each changes what the adapter computes,
# or what it adapts, in a way this project does not.
OFF = {"use_dora": "DoRA's magnitude vectors",
       "modules_to_save": "whole modules trained beside the adapters",
       "layers_to_transform": "adapters on some layers only",
       "layers_pattern": "adapters on some layers only",
       "lora_bias": "a bias on lora_B", "target_parameters": "adapters on parameters",
       "trainable_token_indices": "trained embedding rows",
       "layer_replication": "replicated layers", "alora_invocation_tokens": "activated LoRA",
       "use_qalora": "QALoRA's pooled inputs", "megatron_config": "Megatron layers",
       "arrow_config": "Arrow routing", "use_bdlora": "block-diagonal LoRA"}
# Fields that do not change what a loaded adapter computes: bookkeeping, initialisation
# (the tensors are read), the task's wrapper, and `fan_in_fan_out` (how PEFT merges into a
# transposed weight; the tensors are the same).
HARMLESS = {"task_type", "auto_mapping", "peft_version", "revision", "inference_mode",
            "init_lora_weights", "fan_in_fan_out", "megatron_core", "loftq_config",
            "eva_config", "corda_config", "lora_ga_config", "qalora_group_size",
            "runtime_config", "ensure_weight_tying", "bias"}
# Initialisations that also change the base's weights (the adapter then needs that changed
# base, unless PEFT converted it when saving, which writes init_lora_weights true).
BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


def _is_off(value) -> bool:
    return value is None or value is False or (
        isinstance(value, (str, list, dict, tuple)) and not value)


def check_fields(hf: dict, where: str) -> dict:
    """The fields of adapter_config.json that `read` uses, checked.

    Raises:
        UserError: naming a field whose value this project cannot compute (another PEFT
            method, DoRA, biases, modules to save, some layers only, ...) or does not know.
    """
    def refuse(key, why):
        raise UserError(f"{where}/{CONFIG}: {key}={hf[key]!r} is not supported ({why})")

    if hf.get("peft_type") != "LORA":
        raise UserError(f"{where}/{CONFIG}: peft_type={hf.get('peft_type')!r} is not "
                         "supported (only LoRA adapters, peft_type 'LORA')")
    if hf.get("bias", "none") != "none":
        refuse("bias", "trained biases of the base; only bias 'none'")
    for key, what in OFF.items():
        if not _is_off(hf.get(key)):
            refuse(key, f"{what}; this project loads plain LoRA adapters")
    init = hf.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(BASE_CHANGING_INITS):
        refuse("init_lora_weights", "an initialisation that changed the base's weights; "
               "save it from PEFT with path_initial_model_for_weight_conversion")
    unknown = sorted(k for k in set(hf) - set(READ) - set(OFF) - HARMLESS
                     if not _is_off(hf[k]))
    if unknown:
        shown = ", ".join(f"{k}={hf[k]!r}" for k in unknown)
        raise UserError(f"{where}/{CONFIG} has field(s) this project does not know, so it "
                         f"cannot tell whether they change the computation: {shown}")
    fields = {k: hf[k] if hf.get(k) is not None else d for k, d in READ.items()}
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(fields[key], dict):
            refuse(key, "a dict of module name patterns")
    if not isinstance(fields["use_rslora"], bool):
        refuse("use_rslora", "true or false")
    if not is_int(fields["r"]) or fields["r"] < 1:
        refuse("r", "a positive int")
    alpha = fields["lora_alpha"]
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        refuse("lora_alpha", "a number > 0")
    if fields["target_modules"] == ALL_LINEAR:      # every linear layer but the head
        fields["target_modules"] = None
    return fields


def check_base(name: str | None, base_dir: str, base_hf: dict) -> None:
    """The adapter's `base_model_name_or_path` names the base being loaded: empty, the
    base's path, or a name whose last part is the base directory's or its config's
    `_name_or_path`'s.

    Raises:
        UserError: naming both, and how to load it anyway.
    """
    if not name:
        return
    last = os.path.basename(os.path.normpath(str(name)))
    own = {os.path.basename(os.path.normpath(base_dir))}
    if base_hf.get("_name_or_path"):
        own.add(os.path.basename(os.path.normpath(str(base_hf["_name_or_path"]))))
    if os.path.abspath(str(name)) == os.path.abspath(base_dir) or last in own:
        return
    raise UserError(f"the adapter was made for base_model_name_or_path={name!r}, not for "
                     f"{base_dir!r}; pass check_base_name=False to load it onto this base "
                     "anyway (its shapes are still checked)")


def present_modules(tensors: dict, family: Family, cfg: TransformerConfig, fields: dict,
                    where: str) -> dict[Module, list[tuple[int, str]]]:
    """The modules the adapter's tensors adapt, each with every copy's (layer, name as the
    file has it).

    Raises:
        UserError: naming a key that is not LoRA's A or B, a module the base does not have
            or that cannot carry an adapter here, a module PEFT's target_modules does not
            select, an A without its B, or a projection adapted in only some layers.
    """
    names = _module_names(tensors, where)
    known = {name: (m, i) for m in modules(family, cfg) for i, name in m.names(cfg)}
    rename = _prefixer(family, names, known)
    universe = module_universe(family, cfg)
    for file_name, kinds in sorted(names.items()):
        name = rename(file_name)
        if name not in known:
            adaptable = sorted({m.name.rsplit(".", 1)[-1] for m, _ in known.values()})
            what = ("a module of the base that cannot carry an adapter here" if name in
                    universe else "no module of this base (an adapter made for another base?)")
            raise UserError(f"adapter {where}: {PREFIX}{file_name}{kinds[0]} names "
                             f"{what}; adaptable modules end with {adaptable}")
    for file_name, kinds in sorted(names.items()):
        if len(kinds) != 2:
            other = next(t for t in LORA_TENSORS if t != kinds[0])
            raise UserError(f"adapter {where} has {PREFIX}{file_name}{kinds[0]} without its "
                             f"{other}")
        if not _selected(fields, file_name):
            raise UserError(f"adapter {where}: {file_name} is not selected by {CONFIG}'s "
                             f"target_modules={fields['target_modules']!r}, so PEFT would not "
                             "load its tensors")
    found: dict[Module, list[tuple[int, str]]] = collections.defaultdict(list)
    inverse = {rename(n): n for n in names}
    for name, (module, i) in known.items():
        if name in inverse:
            found[module].append((i, inverse[name]))
    _check_whole_stacks(found, known, cfg, where)
    return dict(found)


def _module_names(tensors: dict, where: str) -> dict[str, list[str]]:
    """module name -> the LoRA tensors of it the file holds (".lora_A.weight", ...)."""
    out: dict[str, list[str]] = collections.defaultdict(list)
    for key in tensors:
        kind = next((t for t in LORA_TENSORS if key.endswith(t)), None)
        if not key.startswith(PREFIX) or kind is None:
            raise UserError(f"adapter {where} holds {key!r}, which is not a LoRA A or B "
                             f"matrix ({PREFIX}<module>.lora_A.weight / .lora_B.weight); "
                             "embedding adapters, DoRA magnitudes and trained modules are "
                             "not supported")
        out[key[len(PREFIX):-len(kind)]].append(kind)
    if not out:
        raise UserError(f"adapter {where} holds no tensors")
    return out


def _prefixer(family: Family, names, known):
    """Names as the rules have them: an adapter made on the base model alone (GPT-2's
    `GPT2Model`) lacks the family's prefix ("h.0.attn.c_attn")."""
    p = family.prefix
    if p and not any(n.startswith(p) for n in names) and any(p + n in known for n in names):
        return lambda n: p + n
    return lambda n: n


def _selected(fields: dict, name: str) -> bool:
    """Whether PEFT would adapt module `name` (target_modules less exclude_modules)."""
    exclude = fields["exclude_modules"]
    if exclude and selects(exclude, name):
        return False
    return fields["target_modules"] is None or selects(fields["target_modules"], name)


def _check_whole_stacks(found: dict, known: dict, cfg: TransformerConfig, where: str) -> None:
    """Each projection is adapted in every layer of its stack, or in none."""
    copies = collections.defaultdict(set)
    for module, _ in known.values():
        copies[module.sites].add(module)
    for sites, group in copies.items():
        have = {(m, i) for m in group if m in found for i, _ in found[m]}
        every = {(m, i) for m in group for i, _ in m.names(cfg)}
        if have and have != every:
            missing = sorted(m.name.format(i=i) for m, i in every - have)
            raise UserError(
                f"adapter {where} adapts {'/'.join('.'.join(s) for s in sites)} in "
                f"{len(have)} of its {len(every)} layers (not {', '.join(missing[:4])}); "
                "this project's adapters cover every layer of a stack")

