"""`llama` (Llama 2 and 3): rotate-half RoPE (optionally Llama 3 scaled), RMSNorm, SwiGLU,
grouped-query attention, an explicit head_dim, a tied or untied head. `mistral` and `qwen2`
(their own modules) are this with a sliding window, or with q/k/v biases.

The stored q/k weights are already in the layout rotate-half RoPE expects (Hugging Face
permuted them when converting Meta's checkpoints), so they load as they are.
"""

from __future__ import annotations

from models.config import TransformerConfig
from models.pretrained.config_map import ConfigMap, Field, SpecialIds
from models.pretrained.family import ConfigReader, Family
from models.pretrained.mapping import Rule
from models.pretrained.rope import read_rope, write_rope
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

FIELDS = (
    Field("vocab_size", "vocab_size"), Field("hidden_size", "d_model"),
    Field("num_attention_heads", "num_heads"),
    Field("num_key_value_heads", "num_kv_heads", None),            # None: num_heads
    Field("head_dim", "head_dim", None),                           # None: d_model / heads
    Field("intermediate_size", "mlp_dim"), Field("num_hidden_layers", "num_layers"),
    Field("max_position_embeddings", "max_len"), Field("rms_norm_eps", "norm_eps", 1e-6),
    Field("tie_word_embeddings", "tie_embeddings", False),
    Field("attention_dropout", "attention_dropout_rate", 0.0, float))
FIXED = dict(architecture="decoder_only", positions="rope", norm="rmsnorm", norm_position="pre",
             activation="swiglu", scale_embeddings=False, dropout_rate=0.0)


def config_map(*fields: Field, **fixed) -> ConfigMap:
    """The map of a Llama-like family: the shared fields plus its own `fields` and `fixed`
    values (checked first when writing). The RoPE settings and hidden_act are read and
    written by `common_config` and `common_to_hf`."""
    return ConfigMap(fields=FIELDS + fields, fixed={**fixed, **FIXED},
                     unread=("pretraining_tp",),         # a way of splitting the same matmuls
                     ids=SpecialIds(start="eos"))


MAP = config_map(qkv_bias=False, sliding_window=None)


def common_config(r: ConfigReader, cmap: ConfigMap, **fields) -> TransformerConfig:
    """A Llama-like family's config by its map; `fields` are those it reads itself."""
    act = r.take("hidden_act", "silu")
    if act != "silu":
        r.refuse("hidden_act", act, "Llama-style models gate with silu (SwiGLU)")
    mapped = cmap.read(r)
    cfg = TransformerConfig(**mapped, **read_rope(r, mapped["max_len"]), **fields)
    r.finish()
    return cfg


def common_to_hf(cfg: TransformerConfig, model_type: str, cmap: ConfigMap, **required
                 ) -> dict:
    """A Llama-like family's config.json; `required`: values of our fields the family
    writes itself (beyond its map)."""
    return {**cmap.write(cfg, model_type, **required), "hidden_act": "silu", **write_rope(cfg)}


def config_from_hf(hf: dict) -> TransformerConfig:
    r = ConfigReader(hf, "llama")
    attention_bias, mlp_bias = r.take("attention_bias", False), r.take("mlp_bias", False)
    if attention_bias != mlp_bias:
        r.refuse("mlp_bias", mlp_bias, f"biases on the attention and the MLP together "
                 f"(attention_bias={attention_bias})")
    return common_config(r, MAP, use_bias=bool(attention_bias))


def config_to_hf(cfg: TransformerConfig) -> dict:
    return {**common_to_hf(cfg, "llama", MAP), "attention_bias": cfg.use_bias,
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


def family(model_type: str, architecture: str, config_from_hf, config_to_hf,
           weight_rules=rules) -> Family:
    return Family(model_type=model_type, architectures=(architecture,),
                  config_from_hf=config_from_hf, config_to_hf=config_to_hf, rules=weight_rules,
                  prefix="model.",
                  ignored=(r"(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq",))


FAMILY = family("llama", "LlamaForCausalLM", config_from_hf, config_to_hf)
