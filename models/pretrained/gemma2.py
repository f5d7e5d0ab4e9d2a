"""`gemma2` (Gemma2ForCausalLM): Gemma with a kind per layer (`layer_types`: sliding-window
and full attention, by default alternating from a sliding first layer), attention logits
soft-capped (`attn_logit_softcapping`) and scaled by `query_pre_attn_scalar ** -0.5`, the
output logits soft-capped (`final_logit_softcapping`), and four norms per layer: before and
after attention, before and after the MLP (our `sublayer_output_norm`). `gemma3_text` is
this with norms on the queries and keys and a RoPE base of its own in sliding layers.

Config fields a Gemma 2 config.json may hold at other values than we compute with are
refused by name: bidirectional attention, attention biases, an activation that is not a
gated GELU or SiLU, a sliding layer without a window.
"""

from __future__ import annotations

from models.config import TransformerConfig
from models.pretrained import gemma, llama
from models.pretrained.config_map import ConfigMap, Field, SpecialIds
from models.pretrained.family import ConfigReader, Inexpressible
from models.pretrained.mapping import Rule
from models.pretrained.rope import read_rope, write_rope
from models.pretrained.rules import embeddings, final_norm, mlp, norm, self_attention, untied_head

# Gemma2Config's defaults where config.json may omit a field.
FIELDS = (
    Field("vocab_size", "vocab_size"), Field("hidden_size", "d_model"),
    Field("num_attention_heads", "num_heads"),
    Field("num_key_value_heads", "num_kv_heads", 4), Field("head_dim", "head_dim", 256),
    Field("intermediate_size", "mlp_dim"), Field("num_hidden_layers", "num_layers"),
    Field("max_position_embeddings", "max_len", 8192), Field("rms_norm_eps", "norm_eps", 1e-6),
    Field("tie_word_embeddings", "tie_embeddings", True),
    Field("attention_dropout", "attention_dropout_rate", 0.0, float),
    Field("query_pre_attn_scalar", "query_pre_attn_scalar", 256, float))
FIXED = dict(architecture="decoder_only", positions="rope", norm="rmsnorm", norm_position="pre",
             norm_scale_offset=1.0, scale_embeddings=True, use_bias=False, qkv_bias=False,
             sublayer_output_norm=True, dropout_rate=0.0)
MAP = ConfigMap(fields=FIELDS, fixed=FIXED, accepted=dict(attention_bias=False),
                unread=("cache_implementation",),      # how transformers allocates its cache
                ids=SpecialIds(pad=0, eos=1, start=2))
# config.json's layer kinds <-> ours.
KINDS = {"sliding_attention": "sliding", "full_attention": "full"}
THEIR_KINDS = {v: k for k, v in KINDS.items()}


def common_config(r: ConfigReader, cmap: ConfigMap, *, softcaps: tuple, pattern: int,
                  rope: dict, **fields) -> TransformerConfig:
    """A Gemma 2 or 3 config by its map: the activation, the layer kinds (`layer_types`, or
    every `pattern`-th layer full and the others sliding), the window, the soft-caps
    (config.json's defaults `softcaps` for attention and output), the RoPE fields `rope`."""
    if r.take("use_bidirectional_attention", None):
        r.refuse("use_bidirectional_attention", True, "causal attention")
    act = gemma._activation(r, "hidden_activation",
                            r.take("hidden_activation", "gelu_pytorch_tanh"))
    legacy = r.take("hidden_act", None)          # not read by transformers' Gemma 2 / 3
    if legacy is not None and gemma.ACTIVATIONS.get(legacy) != act:
        r.refuse("hidden_act", legacy, f"hidden_activation={r.hf.get('hidden_activation')!r} "
                 "is the function transformers uses, and this names another")
    mapped = cmap.read(r)
    layers = mapped["num_layers"]
    kinds = r.take("layer_types", None)
    if kinds is None:
        kinds = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(layers)]
    if not isinstance(kinds, list) or len(kinds) != layers or not set(kinds) <= set(KINDS):
        r.refuse("layer_types", kinds, f"one of {tuple(KINDS)} for each of the {layers} "
                 "layers")
    window = r.take("sliding_window", None) if "sliding_window" in r.hf else 4096   # null: none
    if "sliding_attention" in kinds and window is None:
        r.refuse("sliding_window", None, "sliding layers need a window")
    attn_cap = r.take("attn_logit_softcapping", None) if "attn_logit_softcapping" in r.hf \
        else softcaps[0]
    final_cap = r.take("final_logit_softcapping", None) if "final_logit_softcapping" in r.hf \
        else softcaps[1]
    cfg = TransformerConfig(
        **mapped, activation=act, layer_types=tuple(KINDS[k] for k in kinds),
        sliding_window=window, attn_logit_softcapping=attn_cap,
        final_logit_softcapping=final_cap, **rope, **fields)
    r.finish()
    return cfg


def common_to_hf(cfg: TransformerConfig, model_type: str, cmap: ConfigMap, **fields) -> dict:
    if cfg.activation not in gemma.WRITTEN:
        raise Inexpressible(f"{model_type} cannot express activation={cfg.activation!r} (it "
                            f"has {' or '.join(map(repr, gemma.WRITTEN))})")
    if cfg.query_pre_attn_scalar is None:
        raise Inexpressible(f"{model_type} cannot express query_pre_attn_scalar=None (it "
                            "names the scale's denominator)")
    if not cfg.layer_types:
        raise Inexpressible(f"{model_type} cannot express layer_types=() (it names each "
                            "layer's kind)")
    out = cmap.write(cfg, model_type, activation=cfg.activation,
                     layer_types=cfg.layer_types, sliding_window=cfg.sliding_window,
                     attn_logit_softcapping=cfg.attn_logit_softcapping,
                     final_logit_softcapping=cfg.final_logit_softcapping, **fields)
    return {**out, "hidden_activation": gemma.WRITTEN[cfg.activation],
            "attention_bias": False, "use_bidirectional_attention": False,
            "layer_types": [THEIR_KINDS[k] for k in cfg.layer_types],
            "sliding_window": cfg.sliding_window,
            "attn_logit_softcapping": cfg.attn_logit_softcapping,
            "final_logit_softcapping": cfg.final_logit_softcapping,
            "query_pre_attn_scalar": _number(cfg.query_pre_attn_scalar)}


def _number(x: float) -> int | float:
    """An integral float as an int (config classes that type the field int)."""
    return int(x) if float(x).is_integer() else x


def config_from_hf(hf: dict) -> TransformerConfig:
    r = ConfigReader(hf, "gemma2")
    rope = read_rope(r, r.hf.get("max_position_embeddings", 8192))
    return common_config(r, MAP, softcaps=(50.0, 30.0), pattern=2, rope=rope)


def config_to_hf(cfg: TransformerConfig) -> dict:
    return {**common_to_hf(cfg, "gemma2", MAP), **write_rope(cfg)}


def rules(cfg: TransformerConfig) -> list[Rule]:
    """Gemma 2's four norms per layer: before and after attention, before and after the
    MLP."""
    return [*embeddings(cfg, tokens="model.embed_tokens"),
            *self_attention(cfg, llama.LAYER, llama.ATTENTION),
            *mlp(cfg, llama.LAYER, llama.MLP),
            *norm(cfg, llama.LAYER, "input_layernorm", "self_attention_norm"),
            *norm(cfg, llama.LAYER, "post_attention_layernorm", "self_attention_output_norm"),
            *norm(cfg, llama.LAYER, "pre_feedforward_layernorm", "mlp_norm"),
            *norm(cfg, llama.LAYER, "post_feedforward_layernorm", "mlp_output_norm"),
            *final_norm(cfg, "decoder", "model.norm"), *untied_head(cfg)]


FAMILY = llama.family("gemma2", "Gemma2ForCausalLM", config_from_hf, config_to_hf, rules)
