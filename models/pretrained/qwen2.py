"""`qwen2`: Llama with biases on the query, key and value projections only (none on the
output projection or the MLP). Per-layer sliding windows (`use_sliding_window`) are refused."""

from __future__ import annotations

from models.config import TransformerConfig
from models.pretrained import llama
from models.pretrained.family import ConfigReader

MAP = llama.config_map(use_bias=False, qkv_bias=True, sliding_window=None)


def config_from_hf(hf: dict) -> TransformerConfig:
    r = ConfigReader(hf, "qwen2")
    r.expect("use_sliding_window", False)
    r.take("sliding_window", None)            # unused without use_sliding_window
    r.take("max_window_layers", None)         # likewise
    layer_types = r.take("layer_types", None)
    if layer_types is not None and set(layer_types) != {"full_attention"}:
        r.refuse("layer_types", layer_types, "full attention in every layer")
    return llama.common_config(r, MAP)


def config_to_hf(cfg: TransformerConfig) -> dict:
    out = llama.common_to_hf(cfg, "qwen2", MAP)
    if cfg.head_dim == cfg.d_model // cfg.num_heads:
        del out["head_dim"]            # not a Qwen2Config field; read when present
    return {**out, "use_sliding_window": False,
            "layer_types": ["full_attention"] * cfg.num_layers}


FAMILY = llama.family("qwen2", "Qwen2ForCausalLM", config_from_hf, config_to_hf)
