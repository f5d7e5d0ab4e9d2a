"""`qwen3`: Llama with an RMSNorm over each head's channels of the queries and keys (before
RoPE; `q_norm` / `k_norm`, a scale [H] each, eps `rms_norm_eps`), an explicit `head_dim`, and
no biases.

Sliding windows: Qwen3Config gives every layer a kind (`layer_types`, or derived from
`use_sliding_window`, `sliding_window` and `max_window_layers`: the layers from
max_window_layers on slide). One kind for every layer reads as `sliding_window` alone (None
for full attention); a mix reads as `TransformerConfig.layer_types` beside the window.
"""

from __future__ import annotations

from models.config import TransformerConfig
from models.pretrained import llama
from models.pretrained.family import ConfigReader
from models.pretrained.mapping import Rule
from models.pretrained.rules import norm

MAP = llama.config_map(use_bias=False, qkv_bias=False, qk_norm=True)
KINDS = ("full_attention", "sliding_attention")


# Qwen3Config's defaults for sizes that Llama's reader derives: absent, head_dim is 128 and
# num_key_value_heads 32 (null: num_attention_heads, as our default).
ABSENT = {"head_dim": 128, "num_key_value_heads": 32}


def config_from_hf(hf: dict) -> TransformerConfig:
    r = ConfigReader({**ABSENT, **hf}, "qwen3")
    if r.take("attention_bias", False):
        r.refuse("attention_bias", hf["attention_bias"], "biases on the query, key, value and "
                 "output projections without the MLP's are not expressible")
    window, kinds = _window(r)
    return llama.common_config(r, MAP, sliding_window=window, layer_types=kinds)


def _window(r: ConfigReader) -> tuple[int | None, tuple[str, ...]]:
    """Our (`sliding_window`, `layer_types`) from Qwen3Config's per-layer kinds, as
    transformers derives them: `layer_types` only for a mix of kinds."""
    window = r.take("sliding_window", None)
    if not r.take("use_sliding_window", False):
        window = None                             # transformers ignores it then
    first = r.take("max_window_layers", 28)
    layers = r.hf.get("num_hidden_layers")
    kinds = r.take("layer_types", None)
    if kinds is None and isinstance(layers, int):
        kinds = ["sliding_attention" if window is not None and i >= first else "full_attention"
                 for i in range(layers)]
    if kinds is None:
        return None, ()                           # num_hidden_layers, required, is refused
    if not isinstance(kinds, list) or len(kinds) != layers or not set(kinds) <= set(KINDS):
        r.refuse("layer_types", kinds, f"one of {KINDS} for each of the {layers} layers")
    if "sliding_attention" not in kinds:
        return None, ()
    if window is None:
        r.refuse("layer_types", kinds, "sliding layers need use_sliding_window=true and "
                 "a sliding_window")
    if set(kinds) == {"sliding_attention"}:
        return window, ()
    return window, tuple("sliding" if kind == "sliding_attention" else "full" for kind in kinds)


def config_to_hf(cfg: TransformerConfig) -> dict:
    window, sliding = cfg.sliding_window, cfg.layer_is_sliding()
    return {**llama.common_to_hf(cfg, "qwen3", MAP, layer_types=cfg.layer_types),
            "attention_bias": False, "use_sliding_window": any(sliding),
            "sliding_window": window,
            "max_window_layers": sliding.index(True) if any(sliding) else cfg.num_layers,
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding]}


def rules(cfg: TransformerConfig) -> list[Rule]:
    return [*llama.rules(cfg),
            *norm(cfg, llama.LAYER, "self_attn.q_norm", "self_attention/query_norm"),
            *norm(cfg, llama.LAYER, "self_attn.k_norm", "self_attention/key_norm")]


FAMILY = llama.family("qwen3", "Qwen3ForCausalLM", config_from_hf, config_to_hf, rules)
