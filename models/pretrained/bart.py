"""`bart`: being written (issue 15)."""

from __future__ import annotations

from models.config import TransformerConfig
from models.pretrained.family import Family, Inexpressible


def config_from_hf(hf: dict) -> TransformerConfig:
    raise ValueError("bart checkpoints are not supported yet")


def config_to_hf(cfg: TransformerConfig) -> dict:
    raise Inexpressible("bart is not written yet")


FAMILY = Family(model_type="bart", architectures=(), config_from_hf=config_from_hf,
                config_to_hf=config_to_hf, rules=lambda cfg: [])
