"""The project's own `model_type`, for configs no Hugging Face class expresses (the default
`transformer-tiny`, say): config.json holds every `TransformerConfig` field, and the weights
are our parameters under their own '.'-joined paths (unscanned: one tensor per layer)."""

from __future__ import annotations

import dataclasses

from models.config import TransformerConfig, check_keys
from models.pretrained.family import Family
from models.pretrained.mapping import Rule, parameter_shapes

MODEL_TYPE = "jax_transformer_zoo"
_BOOKKEEPING = ("model_type", "architectures", "transformers_version")


def config_from_hf(hf: dict) -> TransformerConfig:
    fields = {k: v for k, v in hf.items() if k not in _BOOKKEEPING}
    check_keys(fields)
    return TransformerConfig(**fields)


def config_to_hf(cfg: TransformerConfig) -> dict:
    out = dataclasses.asdict(cfg)
    out["dtype"], out["param_dtype"] = cfg.dtype.name, cfg.param_dtype.name
    return out


def rules(cfg: TransformerConfig) -> list[Rule]:
    return [Rule(path.replace("/", "."), path) for path in parameter_shapes(cfg)]


FAMILY = Family(model_type=MODEL_TYPE, architectures=("JaxTransformerZoo",),
                config_from_hf=config_from_hf, config_to_hf=config_to_hf, rules=rules)
