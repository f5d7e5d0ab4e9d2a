"""`gemma` (GemmaForCausalLM, Gemma 1): Llama's layout with a gated tanh-GELU MLP (GeGLU),
RMSNorms that multiply by (1 + weight) in float32 (`norm_scale_offset` 1; the weight is
stored and saved as it is), embeddings multiplied by sqrt(D) rounded to the compute dtype
(`scale_embeddings`), an explicit head_dim (256 in the published models), multi-query
attention (2B) and a tied head.

The MLP's activation: transformers v5 reads `hidden_act` ("gelu", the original releases'
value, means the tanh form there); v4 preferred `hidden_activation` when given. A config
whose two fields name different functions is refused, since the versions compute different
models from it; tanh GELU (gelu, gelu_pytorch_tanh, gelu_new) gives GeGLU and silu SwiGLU.
"""

from __future__ import annotations

from models.config import TransformerConfig
from models.pretrained import llama
from models.pretrained.config_map import ConfigMap, Field, SpecialIds
from models.pretrained.family import ConfigReader, Inexpressible
from models.pretrained.rope import read_rope, write_rope

# GemmaConfig's defaults where config.json may omit a field.
FIELDS = (
    Field("vocab_size", "vocab_size"), Field("hidden_size", "d_model"),
    Field("num_attention_heads", "num_heads"),
    Field("num_key_value_heads", "num_kv_heads", 16), Field("head_dim", "head_dim", 256),
    Field("intermediate_size", "mlp_dim"), Field("num_hidden_layers", "num_layers"),
    Field("max_position_embeddings", "max_len", 8192), Field("rms_norm_eps", "norm_eps", 1e-6),
    Field("tie_word_embeddings", "tie_embeddings", True),
    Field("attention_dropout", "attention_dropout_rate", 0.0, float))
MAP = ConfigMap(
    fields=FIELDS,
    fixed=dict(architecture="decoder_only", positions="rope", norm="rmsnorm",
               norm_position="pre", norm_scale_offset=1.0, scale_embeddings=True,
               use_bias=False, qkv_bias=False, sliding_window=None, dropout_rate=0.0),
    accepted=dict(attention_bias=False),
    ids=SpecialIds(pad=0, eos=1, start=2))
# hidden_act values -> our gated activation.
ACTIVATIONS = {"gelu": "geglu", "gelu_pytorch_tanh": "geglu", "gelu_new": "geglu",
               "silu": "swiglu", "swish": "swiglu"}
WRITTEN = {"geglu": "gelu_pytorch_tanh", "swiglu": "silu"}


def config_from_hf(hf: dict) -> TransformerConfig:
    r = ConfigReader(hf, "gemma")
    if r.take("use_bidirectional_attention", None):
        r.refuse("use_bidirectional_attention", True, "causal attention")
    act = _activation(r, "hidden_act", r.take("hidden_act", "gelu_pytorch_tanh"))
    v4 = r.take("hidden_activation", None)
    if v4 is not None and _activation(r, "hidden_activation", v4) != act:
        r.refuse("hidden_activation", v4, f"hidden_act={hf.get('hidden_act')!r} names another "
                 "function, and transformers v4 and v5 differ on which one the MLP uses")
    mapped = MAP.read(r)
    cfg = TransformerConfig(**mapped, activation=act, **read_rope(r, mapped["max_len"]))
    r.finish()
    return cfg


def _activation(r: ConfigReader, key: str, value) -> str:
    if value not in ACTIVATIONS:
        r.refuse(key, value, f"a gated MLP of {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[value]


def config_to_hf(cfg: TransformerConfig) -> dict:
    if cfg.activation not in WRITTEN:
        raise Inexpressible(f"gemma cannot express activation={cfg.activation!r} (it has "
                            f"{' or '.join(map(repr, WRITTEN))})")
    return {**MAP.write(cfg, "gemma", activation=cfg.activation),
            "hidden_act": WRITTEN[cfg.activation], "attention_bias": False, **write_rope(cfg)}


FAMILY = llama.family("gemma", "GemmaForCausalLM", config_from_hf, config_to_hf)
