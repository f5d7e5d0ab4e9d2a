"""`llama` (Llama 2 and 3): rotate-half RoPE (optionally Llama 3 scaled), RMSNorm, SwiGLU,
grouped-query attention, an explicit head_dim, a tied or untied head. `mistral` and `qwen2`
(their own modules) are this with a sliding window, or with q/k/v biases.

The stored q/k weights are already in the layout rotate-half RoPE expects (Hugging Face
permuted them when converting Meta's checkpoints), so they load as they are.
"""

from __future__ import annotations

from models.config import Llama3RopeScaling, TransformerConfig
from models.pretrained.family import (
    ConfigReader,
    Family,
    hf_special_ids,
    require,
    special_ids,
)
from models.pretrained.mapping import Rule
from models.pretrained.rules import (
    Attention,
    Mlp,
    Scope,
    embeddings,
    final_norm,
    mlp,
    norm,
    self_attention,
    untied_head,
)


def read_rope(r: ConfigReader, max_len: int) -> dict:
    """`rope_theta` and `rope_scaling` fields from either spelling of the RoPE settings:
    transformers v5's `rope_parameters` dict, or v4's top-level `rope_theta` plus a
    `rope_scaling` dict (its kind under `rope_type`, or the older `type`)."""
    v5, v4 = r.take("rope_parameters", None), r.take("rope_scaling", None)
    params = v5 if v5 is not None else v4 if v4 is not None else {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        r.refuse("rope_parameters", params, "one set of RoPE settings for every layer")
    params = dict(params)
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    theta = _one_value(r, "rope_theta", params.pop("rope_theta", None), 10_000.0)
    partial = _one_value(r, "partial_rotary_factor", params.pop("partial_rotary_factor", None),
                         1.0)
    if partial != 1.0:
        r.refuse("partial_rotary_factor", partial, "RoPE over the whole head")
    scaling = None
    if kind == "llama3":
        try:
            scaling = Llama3RopeScaling(
                factor=params.pop("factor"), low_freq_factor=params.pop("low_freq_factor"),
                high_freq_factor=params.pop("high_freq_factor"),
                original_max_len=params.pop("original_max_position_embeddings", max_len))
        except KeyError as e:
            r.refuse("rope_parameters", v5 or v4, f"llama3 RoPE scaling needs {e}")
    elif kind != "default":
        r.refuse("rope_type", kind, "supported: 'default', 'llama3'")
    if params:
        r.refuse("rope_parameters", params, f"unknown for rope_type {kind!r}")
    return {"rope_theta": float(theta), "rope_scaling": scaling}


def _one_value(r: ConfigReader, key: str, nested, default):
    """A RoPE setting given inside the RoPE dict, at the top level, or both (equal)."""
    top = r.take(key, None)
    if nested is not None and top is not None and nested != top:
        r.refuse(key, top, f"the RoPE settings say {nested!r}")
    return next(v for v in (nested, top, default) if v is not None)


def write_rope(cfg: TransformerConfig) -> dict:
    params = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        params.update(rope_type="llama3", factor=s.factor, low_freq_factor=s.low_freq_factor,
                      high_freq_factor=s.high_freq_factor,
                      original_max_position_embeddings=s.original_max_len)
    return {"rope_parameters": params}


def common_config(r: ConfigReader, **fields) -> TransformerConfig:
    """The fields the Llama-like families share; `fields` are the family's own."""
    act = r.take("hidden_act", "silu")
    if act != "silu":
        r.refuse("hidden_act", act, "Llama-style models gate with silu (SwiGLU)")
    r.take("pretraining_tp", 1)              # a way of splitting the same matmuls
    heads = r.take("num_attention_heads")
    max_len = r.take("max_position_embeddings")
    cfg = TransformerConfig(
        architecture="decoder_only", vocab_size=r.take("vocab_size"),
        d_model=r.take("hidden_size"), num_heads=heads,
        num_kv_heads=r.take("num_key_value_heads", heads), head_dim=r.take("head_dim", None),
        mlp_dim=r.take("intermediate_size"), num_layers=r.take("num_hidden_layers"),
        max_len=max_len, positions="rope", **read_rope(r, max_len), norm="rmsnorm",
        norm_position="pre", norm_eps=r.take("rms_norm_eps", 1e-6), activation="swiglu",
        tie_embeddings=r.take("tie_word_embeddings", False), scale_embeddings=False,
        dropout_rate=0.0, attention_dropout_rate=float(r.take("attention_dropout", 0.0)),
        **special_ids(r), **fields)
    r.finish()
    return cfg


def common_to_hf(cfg: TransformerConfig, model_type: str) -> dict:
    require(cfg, model_type, architecture="decoder_only", positions="rope", norm="rmsnorm",
            norm_position="pre", activation="swiglu", scale_embeddings=False,
            dropout_rate=0.0)
    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.num_layers, "max_position_embeddings": cfg.max_len,
        "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": cfg.attention_dropout_rate, **write_rope(cfg),
        **hf_special_ids(cfg),
    }


def config_from_hf(hf: dict) -> TransformerConfig:
    r = ConfigReader(hf, "llama")
    attention_bias, mlp_bias = r.take("attention_bias", False), r.take("mlp_bias", False)
    if attention_bias != mlp_bias:
        r.refuse("mlp_bias", mlp_bias, f"biases on the attention and the MLP together "
                 f"(attention_bias={attention_bias})")
    return common_config(r, use_bias=bool(attention_bias))


def config_to_hf(cfg: TransformerConfig) -> dict:
    require(cfg, "llama", qkv_bias=False, sliding_window=None)
    return {**common_to_hf(cfg, "llama"), "attention_bias": cfg.use_bias,
            "mlp_bias": cfg.use_bias}


LAYER = Scope.layers("model.layers.{i}", "decoder")
ATTENTION = Attention.apart("self_attn.{}_proj")
MLP = Mlp(gate="mlp.gate_proj", up="mlp.up_proj", down="mlp.down_proj")


def rules(cfg: TransformerConfig) -> list[Rule]:
    """The weight map of every Llama-like family (biases where the config has them)."""
    return [*embeddings(cfg, tokens="model.embed_tokens"),
            *self_attention(cfg, LAYER, ATTENTION), *mlp(cfg, LAYER, MLP),
            *norm(cfg, LAYER, "input_layernorm", "self_attention_norm"),
            *norm(cfg, LAYER, "post_attention_layernorm", "mlp_norm"),
            *final_norm(cfg, "decoder", "model.norm"), *untied_head(cfg)]


def family(model_type: str, architecture: str, config_from_hf, config_to_hf) -> Family:
    return Family(model_type=model_type, architectures=(architecture,),
                  config_from_hf=config_from_hf, config_to_hf=config_to_hf, rules=rules,
                  prefix="model.",
                  ignored=(r"(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq",))


FAMILY = family("llama", "LlamaForCausalLM", config_from_hf, config_to_hf)
