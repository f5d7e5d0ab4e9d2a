"""`gpt2`: learned positions, pre-norm LayerNorm, tanh GELU, a fused q/k/v projection stored
as GPT-2's `Conv1D` ([in, out], not torch's [out, in]), a tied head by default."""

from __future__ import annotations

from models.config import TransformerConfig
from models.pretrained.config_map import D_OVER_N, MULTI_HEAD, ConfigMap, Field, SpecialIds
from models.pretrained.family import ConfigReader, Family, Inexpressible
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

ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu": "gelu_exact",
               "relu": "relu"}

MAP = ConfigMap(
    fields=(Field("vocab_size", "vocab_size"), Field("n_embd", "d_model"),
            Field("n_head", "num_heads"), Field("n_layer", "num_layers"),
            Field("n_inner", "mlp_dim", None),                    # None: 4 * d_model
            Field("n_positions", "max_len"), Field("layer_norm_epsilon", "norm_eps", 1e-5),
            Field("tie_word_embeddings", "tie_embeddings", True),
            Field("resid_pdrop", "dropout_rate", 0.1, float),    # embd_pdrop must equal it
            Field("attn_pdrop", "attention_dropout_rate", 0.1, float)),
    fixed=dict(architecture="decoder_only", positions="learned", norm="layernorm",
               norm_position="pre", use_bias=True, qkv_bias=False, scale_embeddings=False,
               sliding_window=None, num_kv_heads=MULTI_HEAD, head_dim=D_OVER_N),
    accepted=dict(scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
                  add_cross_attention=False),
    # Numerics of mixed precision only, and the double-heads model's head.
    unread=("reorder_and_upcast_attn", "summary_type", "summary_use_proj",
            "summary_activation", "summary_proj_to_labels", "summary_first_dropout"),
    ids=SpecialIds(start="eos"))


def config_from_hf(hf: dict) -> TransformerConfig:
    r = ConfigReader(hf, "gpt2")
    act = r.take("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        r.refuse("activation_function", act, f"supported: {sorted(ACTIVATIONS)}")
    resid, embd = r.take("resid_pdrop", 0.1), r.take("embd_pdrop", 0.1)
    if resid != embd:
        r.refuse("embd_pdrop", embd, f"one dropout rate for embeddings and residuals: "
                 f"resid_pdrop={resid}")
    fields = MAP.read(r)
    r.expect("n_ctx", fields["max_len"])         # the original GPT-2 config's name for it
    fields["mlp_dim"] = fields["mlp_dim"] or 4 * fields["d_model"]
    cfg = TransformerConfig(**fields, activation=ACTIVATIONS[act])
    r.finish()
    return cfg


def config_to_hf(cfg: TransformerConfig) -> dict:
    hf = MAP.write(cfg, "gpt2")
    hf_act = {"gelu": "gelu_new", "gelu_exact": "gelu", "relu": "relu"}
    if cfg.activation not in hf_act:
        raise Inexpressible(f"gpt2 cannot express activation={cfg.activation!r}")
    return {**hf, "activation_function": hf_act[cfg.activation],
            "embd_pdrop": cfg.dropout_rate}


LAYER = Scope.layers("transformer.h.{i}", "decoder")
ATTENTION = Attention(qkv="attn.c_attn", o="attn.c_proj")
MLP = Mlp(up="mlp.c_fc", down="mlp.c_proj")


def rules(cfg: TransformerConfig) -> list[Rule]:
    """GPT-2's weights are `Conv1D`s ([in, out]); its head is an `nn.Linear`."""
    return [*embeddings(cfg, tokens="transformer.wte", positions="transformer.wpe"),
            *norm(cfg, LAYER, "ln_1", "self_attention_norm"),
            *self_attention(cfg, LAYER, ATTENTION, conv1d=True),
            *norm(cfg, LAYER, "ln_2", "mlp_norm"), *mlp(cfg, LAYER, MLP, conv1d=True),
            *final_norm(cfg, "decoder", "transformer.ln_f"), *untied_head(cfg)]


FAMILY = Family(
    model_type="gpt2", architectures=("GPT2LMHeadModel",), config_from_hf=config_from_hf,
    config_to_hf=config_to_hf, rules=rules, prefix="transformer.",
    # Causal-mask buffers that files saved while transformers kept them persistent hold.
    ignored=(r"(transformer\.)?h\.\d+\.(attn|crossattention)\.(bias|masked_bias)",))
