"""`mistral`: Llama with a sliding-window causal mask (`sliding_window`; null means none)."""

from __future__ import annotations

from models.config import TransformerConfig
from models.pretrained import llama
from models.pretrained.config_map import Field
from models.pretrained.family import ConfigReader

MAP = llama.config_map(Field("sliding_window", "sliding_window", None),
                       use_bias=False, qkv_bias=False)


def config_from_hf(hf: dict) -> TransformerConfig:
    r = ConfigReader(hf, "mistral")
    if r.take("layer_types", None) is not None:
        r.refuse("layer_types", hf["layer_types"], "one attention kind for every layer")
    return llama.common_config(r, MAP)


def config_to_hf(cfg: TransformerConfig) -> dict:
    return llama.common_to_hf(cfg, "mistral", MAP)


FAMILY = llama.family("mistral", "MistralForCausalLM", config_from_hf, config_to_hf)
