"""`t5`: being written (issue 15)."""

from __future__ import annotations

from models.config import TransformerConfig
from models.pretrained.family import Family, Inexpressible


def config_from_hf(hf: dict) -> TransformerConfig:
    raise ValueError("t5 checkpoints are not supported yet")


def config_to_hf(cfg: TransformerConfig) -> dict:
    raise Inexpressible("t5 is not written yet")


FAMILY = Family(model_type="t5", architectures=(), config_from_hf=config_from_hf,
                config_to_hf=config_to_hf, rules=lambda cfg: [])
MT5_FAMILY = Family(model_type="mt5", architectures=(), config_from_hf=config_from_hf,
                    config_to_hf=config_to_hf, rules=lambda cfg: [])
