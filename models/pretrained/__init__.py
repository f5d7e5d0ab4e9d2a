"""Models in and out of the one on-disk form: a Hugging Face layout directory.

    pre = models.load("path/to/dir")          # config.json + safetensors + tokenizer files
    pre.model, pre.config, pre.params, pre.tokenizer, pre.generation, pre.tables
    models.save("out", pre.config, pre.params, pre.tokenizer)
    models.save("out", pre.config, pre.params, pre.tokenizer, generation=pre.generation,
                tables=pre.tables)                  # the directory again, bit for bit

    pre = models.load("base", adapter="adapter")    # a PEFT LoRA adapter: config.lora set
    pre = models.load("base", adapter="adapter", merge=True)     # folded into the weights
    models.save_adapter("adapter", pre.config, pre.params, base_name_or_path="base")

Each `model_type` is one small module here (its config map and weight map as tables, read
in both directions), found through `FAMILIES`. A config that a Hugging Face class expresses
is saved as that class (transformers loads it with the same logits); any other config is
saved under the project's own type (`zoo`), which `load` reads too.

How to add a model type (llama.py is a whole one; mistral.py and qwen2.py are variants of
it, bart.py / marian.py and bert.py / roberta.py share their layers the same way):

1. Its weight map, `rules(cfg) -> list[Rule]`: the Hugging Face name of each part, given to
   the builders of `rules`, which know our parameters, their layouts and which of them a
   config has (biases, token types, an untied head):

       LAYER = Scope.layers("model.layers.{i}", "decoder")       # keys model.layers.3.*
       def rules(cfg):
           return [*embeddings(cfg, tokens="model.embed_tokens"),
                   *self_attention(cfg, LAYER, Attention.apart("self_attn.{}_proj")),
                   *mlp(cfg, LAYER, Mlp(gate="mlp.gate_proj", up="mlp.up_proj",
                                        down="mlp.down_proj")),
                   *norm(cfg, LAYER, "input_layernorm", "self_attention_norm"),
                   *norm(cfg, LAYER, "post_attention_layernorm", "mlp_norm"),
                   *final_norm(cfg, "decoder", "model.norm"), *untied_head(cfg)]

   Fused projections are `Attention(qkv=..., o=...)` and `Mlp(gate_up=..., down=...)`;
   GPT-2's transposed weights `conv1d=True`; an encoder-decoder adds `cross_attention`.
2. Its config map (`config_map`): a `ConfigMap` of the config.json keys that hold
   TransformerConfig fields, the fields the type always has, the keys it accepts at one
   value, and its `SpecialIds` (its config class's defaults); then
   `config_from_hf(hf)` = `ConfigReader`, `MAP.read(r)`, what the table cannot say,
   `r.finish()` (every key taken, or refused by name), and `config_to_hf(cfg)` =
   `MAP.write(cfg, type)` plus the same (raising `Inexpressible` for a config the class
   cannot express).
3. `FAMILY = Family(...)` with its key prefix, buffers to ignore, tied copies, and what a
   file may lack or hold besides (see `family.Family`); then a line in `FAMILIES` below and
   its place in `SAVE_ORDER`.
4. A case in tests/pretrained_helpers.py (a tiny random transformers model), which the
   parity, cache, generation and round-trip tests run, and its refused config values.

What the layers cannot compute yet (another norm, positions, attention variant) is a
TransformerConfig field and a thin layer variant first; a family only maps to it.
"""

from __future__ import annotations

import dataclasses
import os

import flax.linen as nn
import jax

from models import atomic, axes, lora
from models.config import TransformerConfig
from models.errors import UserError
from models.pretrained import (
    bart,
    bert,
    deepseek_v3,
    gemma,
    gemma2,
    gemma3,
    gpt2,
    gpt_oss,
    llama,
    llama4,
    m2m_100,
    marian,
    mbart,
    mistral,
    mixtral,
    modernbert,
    peft,
    pegasus,
    phi3,
    qwen2,
    qwen3,
    qwen3_moe,
    qwen3_next,
    roberta,
    t5,
    t5gemma,
    whisper,
    zoo,
)
from models.pretrained.convert import read_weights, theirs_tensors
from models.pretrained.family import Family, Inexpressible
from models.pretrained.files import (
    Weights,
    read_json,
    write_json,
    write_weights,
)
from models.pretrained.generation import (
    GenerationDefaults,
    generation_defaults,
    with_generation,
    write_generation,
)
from models.quant import DEFAULT_GROUP, check_scheme, is_quantized
from models.quant_sites import quantize_params
from models.tokenizer import Tokenizer, load_tokenizer
from models.transformer import build

FAMILIES: dict[str, Family] = {
    f.model_type: f for f in (gpt2.FAMILY, llama.FAMILY, mistral.FAMILY, qwen2.FAMILY,
                              qwen3.FAMILY, gemma.FAMILY, gemma2.FAMILY, gemma3.FAMILY,
                              phi3.FAMILY, mixtral.FAMILY,
                              qwen3_moe.FAMILY, gpt_oss.FAMILY, llama4.FAMILY,
                              deepseek_v3.FAMILY, qwen3_next.FAMILY,
                              llama4.MULTIMODAL, bart.FAMILY,
                              marian.FAMILY, m2m_100.FAMILY, mbart.FAMILY, pegasus.FAMILY,
                              t5gemma.FAMILY, t5.FAMILY, t5.MT5_FAMILY, bert.FAMILY, roberta.FAMILY,
                              modernbert.FAMILY,
                              whisper.FAMILY, zoo.FAMILY)}
# Tried in this order when saving a config without a model_type; the first that expresses
# it wins (the project's own type expresses everything).
SAVE_ORDER = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2",
              "gemma3_text", "phi3", "mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3",
              "llama4_text", "qwen3_next", "bart", "marian", "m2m_100", "mbart", "pegasus",
              "t5gemma", "t5", "whisper", "bert", "roberta", "modernbert", zoo.MODEL_TYPE)
# Written last by `save`; `load` checks the files against it when it is there.
MANIFEST = "zoo_integrity.json"
# Fields a loaded config may be given: how to run it, not what it computes.
RUNTIME_FIELDS = frozenset({"dtype", "param_dtype", "scan_layers", "remat", "remat_policy",
                            "attention_impl", "attention_block", "dropout_rate",
                            "attention_dropout_rate", "mlp_dropout_rate", "moe_dispatch",
                            "router_aux_loss_coef", "router_z_loss_coef",
                            "linear_chunk_size"})


@dataclasses.dataclass(frozen=True)
class Pretrained:
    """A model directory, loaded.

    Attributes:
        model: the flax module (`models.build(config)`).
        config: its `TransformerConfig`.
        params: the parameter tree (jax arrays of `config.param_dtype`).
        tokenizer: the directory's tokenizer, or None when it has no tokenizer files.
        generation: the decoding defaults the directory gives.
        model_type: config.json's model_type (kept when saving it again).
        tables: the file's tensors that the config determines and no parameter holds,
            {file key: numpy array of `param_dtype`} exactly as read (Whisper's encoder
            positions, which the model computes; empty for most types): `save(...,
            tables=pre.tables)` writes them back instead of recomputing them.
    """

    model: nn.Module
    config: TransformerConfig
    params: dict
    tokenizer: Tokenizer | None
    generation: GenerationDefaults
    model_type: str
    tables: dict = dataclasses.field(default_factory=dict)


def family_of(hf: dict, path: str) -> Family:
    model_type = hf.get("model_type")
    if "auto_map" in hf:
        raise UserError(f"{path} has auto_map={hf['auto_map']!r}: it asks to run code from "
                         "the directory, which this project never does")
    if model_type not in FAMILIES:
        raise UserError(f"{path}: model_type {model_type!r} is not supported; supported: "
                         f"{', '.join(sorted(FAMILIES))}")
    return FAMILIES[model_type]


def read_config(path: str, **runtime) -> tuple[Family, TransformerConfig, dict]:
    """A model directory's model type, its `TransformerConfig` (with the `runtime` fields
    of `load` applied) and config.json as read. No weights are read, except where the
    family settles part of the config from them (`Family.config_from_weights`: T5's tied
    or untied head)."""
    unknown = set(runtime) - RUNTIME_FIELDS
    if unknown:
        raise UserError(f"a loaded model takes only {sorted(RUNTIME_FIELDS)} as overrides, "
                         f"not {sorted(unknown)}")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model directory {path!r} " + (
            "is a file, not a directory" if os.path.exists(path) else "does not exist"))
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"no config.json in {path}")
    hf = read_json(config_path)
    family = family_of(hf, path)
    cfg = family.config_from_hf(hf)
    if family.config_from_weights is not None:
        with Weights(path) as weights:
            cfg = family.config_from_weights(cfg, weights)
    return family, (cfg.replace(**runtime) if runtime else cfg), hf


def load(path: str, *, adapter: str | None = None, merge: bool = False,
         check_base_name: bool = True, mesh=None, rules=None, allow_non_finite: bool = False,
         quantize: str | None = None, quantize_group: int = DEFAULT_GROUP,
         **runtime) -> Pretrained:
    """Reads a model directory: config.json, safetensors weights (sharded or not, any
    float dtype, cast to `param_dtype`), the tokenizer files if any, and
    generation_config.json if any; and a LoRA adapter for it if asked. Reads JSON and
    safetensors only (no pickle, no code).

    Args:
        path: the directory (as `save_pretrained` or `models.save` writes it); or a
            directory of LoRA adapters alone, loaded onto the base directory that its
            adapter_config.json names (`base_model_name_or_path`).
        adapter: a PEFT LoRA adapter directory for this base (as PEFT's `save_pretrained`
            or `models.save_adapter` writes it): the config gets its `lora`
            (`models.lora.LoraConfig`) and the params its adapters beside the kernels
            (`models.lora.join`).
        merge: fold the adapter into the kernels (`models.lora.merge`): the plain model,
            `config.lora` None.
        check_base_name: refuse an adapter whose `base_model_name_or_path` names another
            base (see `models.pretrained.peft_checks.check_base`).
        mesh: a (data, fsdp, tensor) `jax.sharding.Mesh`: each array is put onto its
            shards as it is read (by its logical axes and `rules`, default
            `models.axes.DEFAULT_RULES`), so no device holds the whole model.
        allow_non_finite: load weights (the base's and the adapter's) holding NaN or Inf
            (a warning names each such tensor and its counts) instead of refusing them.
        quantize: "int8" or "int4": every attention, MLP and expert projection kernel
            quantized as it is loaded (`models.quantize`; an adapter stays in float, over
            the quantized base, or is merged first with `merge`).
        quantize_group: int4's group of inputs per scale.
        runtime: how to run the model, not what it computes: `dtype` (compute),
            `param_dtype` (default float32), `scan_layers`, `remat`, dropout rates.

    Raises:
        UserError: naming the field, value or tensor that cannot be loaded exactly, and
            every tensor holding NaN or Inf (unless `allow_non_finite`).

    Warns:
        UserWarning: naming an end or start id outside the vocabulary (never produced,
            so dropped from the config, as transformers runs it).
        FileNotFoundError: naming what is missing.
    """
    if os.path.isdir(path) and peft.is_adapter_dir(path):
        if adapter is not None:
            raise UserError(f"{path} is itself an adapter directory: give its base as the "
                             f"path and one adapter (adapter={adapter!r} too)")
        return load(peft.named_base(path), adapter=path, merge=merge, check_base_name=False,
                    mesh=mesh, rules=rules, allow_non_finite=allow_non_finite,
                    quantize=quantize, quantize_group=quantize_group, **runtime)
    if quantize is not None:
        check_scheme(quantize)
    family, cfg, hf = read_config(path, **runtime)
    if os.path.exists(os.path.join(path, MANIFEST)):
        wrong = atomic.check_manifest(path, MANIFEST)
        if wrong:
            raise UserError(f"{path} has changed since it was saved: {wrong}")
    if merge and adapter is None:
        raise UserError("merge=True needs an adapter to merge (adapter=DIR)")
    adapted, adapters = None, {}
    if adapter is not None:
        adapted, adapters = peft.read(adapter, family, cfg, base_dir=path, base_hf=hf,
                                      check_base_name=check_base_name,
                                      allow_non_finite=allow_non_finite)
    shardings = None
    if mesh is not None:
        shardings = axes.param_shardings(build(cfg.replace(lora=adapted)), mesh,
                                         rules or axes.DEFAULT_RULES)
        adapters = jax.device_put(adapters, lora.split(shardings)[1])
    with Weights(path) as weights:
        params, tables = read_weights(weights, family, cfg, shardings,
                                      allow_non_finite=allow_non_finite)
    params = lora.join(params, adapters)
    cfg, generation = with_generation(path, hf, cfg)     # an encoder-decoder's start id
    cfg = cfg.replace(lora=adapted)
    if merge:
        cfg, params = lora.merge(cfg, params)
    if quantize is not None:
        params = quantize_params(params, cfg, quantize, group=quantize_group)
    return Pretrained(model=build(cfg), config=cfg, params=params,
                      tokenizer=load_tokenizer(path, missing_ok=True),
                      generation=generation, model_type=family.model_type, tables=tables)


def save(path: str, config: TransformerConfig, params, tokenizer: Tokenizer | None = None, *,
         model_type: str | None = None, generation: GenerationDefaults | None = None,
         tables: dict | None = None, max_shard_bytes: int = 2 << 30) -> str:
    """Writes a model directory that `load` (and, for a Hugging Face model type,
    transformers) reads back to the same tensors. Written to a temporary directory, then
    renamed into place: a crash leaves the old directory or the new one. The last file
    written is `zoo_integrity.json`, the size and sha256 of every other file, which `load`
    checks (transformers ignores it).

    Args:
        model_type: the type to write as (default: the first in `SAVE_ORDER` that
            expresses `config`; the project's own type expresses every config).
        generation: decoding defaults for generation_config.json.
        tables: the tables a load kept (`Pretrained.tables`): written as the file held
            them, so a load then save is bit for bit (default: computed from the config,
            within the float rounding `load` accepts).
        max_shard_bytes: larger weights are split into shards with an index.

    Returns:
        The model_type written.

    Raises:
        UserError: `config.lora` set (fold the adapters in with `models.lora.merge`, or
            save them alone with `models.save_adapter`); a table the type does not take
            from `tables`, or one `load` would refuse for `config` (named).
    """
    if is_quantized(params):
        raise UserError("models.save writes float weights, but these params are quantized "
                        "(models.quantize): save the float params and quantize them as they "
                        "are loaded (models.load(path, quantize=...))")
    if config.lora is not None:
        raise UserError("models.save writes a plain model, but config.lora is set: merge "
                         "the adapters into the weights first (models.lora.merge(config, "
                         "params)), or save them alone as a PEFT adapter "
                         "(models.save_adapter)")
    family = _family_for(config, model_type)
    # A Hugging Face config's "dtype" is the weights' (ours keeps its compute dtype there).
    # A family whose class follows the config (BERT's masked-LM or classifier) names it.
    fields = family.config_to_hf(config)
    hf = {"dtype": config.param_dtype.name, **fields, "model_type": family.model_type,
          "architectures": fields.get("architectures", list(family.architectures))}
    with atomic.replaced_dir(path) as tmp:
        write_json(os.path.join(tmp, "config.json"), hf)
        write_weights(tmp, theirs_tensors(family, config, params, tables), max_shard_bytes)
        write_generation(tmp, generation)
        if tokenizer is not None:
            tokenizer.save(tmp)
        atomic.write_manifest(tmp, MANIFEST)
    return family.model_type


def save_adapter(path: str, config: TransformerConfig, params, *,
                 model_type: str | None = None, base_name_or_path: str = "") -> str:
    """Writes the LoRA adapters of `params` (a joined tree or the adapters alone) for
    `config.lora` as a PEFT adapter directory (adapter_config.json and
    adapter_model.safetensors), whole or not at all: PEFT's `PeftModel.from_pretrained`
    loads it onto the transformers model of the base, and `load(base, adapter=path)` onto
    ours.

    Args:
        model_type: the base's type, whose module names the tensors take (default: the
            type `save` would write the base as).
        base_name_or_path: the base, as adapter_config.json's `base_model_name_or_path`
            (which `load` checks).

    Returns:
        The model_type whose names were written.

    Raises:
        UserError: `config.lora` None, an adapter missing from `params`, or fused
            projections adapted at different scales (see `models.pretrained.peft.write`).
    """
    family = _family_for(config.replace(lora=None), model_type)
    peft.write(path, family, config, params, base_name_or_path=base_name_or_path)
    return family.model_type


def read_adapter(adapter: str, base: str, *, check_base_name: bool = True,
                 allow_non_finite: bool = False, **runtime) -> tuple[lora.LoraConfig, dict]:
    """(the `LoraConfig`, the adapter tree) of a PEFT adapter directory for the base model
    directory `base` (`runtime` and `allow_non_finite` as in `load`); `models.lora.join`
    the tree with the base's parameters. `load(base, adapter=adapter)` is this plus the
    base."""
    family, cfg, hf = read_config(base, **runtime)
    return peft.read(adapter, family, cfg, base_dir=base, base_hf=hf,
                     check_base_name=check_base_name, allow_non_finite=allow_non_finite)


def _family_for(config: TransformerConfig, model_type: str | None) -> Family:
    if model_type is not None:
        if model_type not in FAMILIES:
            raise UserError(f"model_type {model_type!r} is not one of {sorted(FAMILIES)}")
        return FAMILIES[model_type]
    for name in SAVE_ORDER:
        try:
            FAMILIES[name].config_to_hf(config)
        except Inexpressible:
            continue
        return FAMILIES[name]
    raise AssertionError("the project's own model type expresses every config")


__all__ = ["FAMILIES", "GenerationDefaults", "Pretrained", "generation_defaults", "load",
           "read_adapter", "read_config", "save", "save_adapter"]
