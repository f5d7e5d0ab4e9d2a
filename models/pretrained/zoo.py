"""The project's own `model_type`, for configs no Hugging Face class expresses (the default
`transformer-tiny`, say): config.json holds every `TransformerConfig` field, and the weights
are our parameters under their own '.'-joined paths (unscanned: one tensor per layer)."""

from __future__ import annotations

from models.config import TransformerConfig
from models.pretrained.family import Family
from models.pretrained.mapping import Rule, parameter_shapes

MODEL_TYPE = "jax_transformer_zoo"
_BOOKKEEPING = ("model_type", "architectures", "transformers_version")


def config_from_hf(hf: dict) -> TransformerConfig:
    return TransformerConfig.from_dict({k: v for k, v in hf.items() if k not in _BOOKKEEPING})


def config_to_hf(cfg: TransformerConfig) -> dict:
    return cfg.to_dict()


def rules(cfg: TransformerConfig) -> list[Rule]:
    return [Rule(path.replace("/", "."), path) for path in parameter_shapes(cfg)]


FAMILY = Family(model_type=MODEL_TYPE, architectures=("JaxTransformerZoo",),
                config_from_hf=config_from_hf, config_to_hf=config_to_hf, rules=rules)
