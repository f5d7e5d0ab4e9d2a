"""`gpt2`: learned positions, pre-norm LayerNorm, tanh GELU, a fused q/k/v projection stored
as GPT-2's `Conv1D` ([in, out], not torch's [out, in]), a tied head by default."""

from __future__ import annotations

from models.config import TransformerConfig
from models.pretrained.family import (
    ConfigReader,
    Family,
    Inexpressible,
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

ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu": "gelu_exact",
               "relu": "relu"}


def config_from_hf(hf: dict) -> TransformerConfig:
    r = ConfigReader(hf, "gpt2")
    d = r.take("n_embd")
    act = r.take("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        r.refuse("activation_function", act, f"supported: {sorted(ACTIVATIONS)}")
    resid, embd = r.take("resid_pdrop", 0.1), r.take("embd_pdrop", 0.1)
    if resid != embd:
        r.refuse("embd_pdrop", embd, f"one dropout rate for embeddings and residuals: "
                 f"resid_pdrop={resid}")
    r.expect("scale_attn_weights", True)
    r.expect("scale_attn_by_inverse_layer_idx", False)
    r.expect("add_cross_attention", False)
    r.take("reorder_and_upcast_attn", False)     # numerics of mixed precision only
    n_positions = r.take("n_positions")
    r.expect("n_ctx", n_positions)               # an old spelling of the same number
    for key in ("summary_type", "summary_use_proj", "summary_activation",
                "summary_proj_to_labels", "summary_first_dropout"):
        r.take(key, None)                        # the double-heads model's head only
    cfg = TransformerConfig(
        architecture="decoder_only", vocab_size=r.take("vocab_size"), d_model=d,
        num_heads=r.take("n_head"), mlp_dim=r.take("n_inner", None) or 4 * d,
        num_layers=r.take("n_layer"), max_len=n_positions, positions="learned",
        norm="layernorm", norm_position="pre", norm_eps=r.take("layer_norm_epsilon", 1e-5),
        activation=ACTIVATIONS[act], use_bias=True,
        tie_embeddings=r.take("tie_word_embeddings", True), scale_embeddings=False,
        dropout_rate=float(resid), attention_dropout_rate=float(r.take("attn_pdrop", 0.1)),
        **special_ids(r))
    r.finish()
    return cfg


def config_to_hf(cfg: TransformerConfig) -> dict:
    require(cfg, "gpt2", architecture="decoder_only", positions="learned", norm="layernorm",
            norm_position="pre", use_bias=True, qkv_bias=False, scale_embeddings=False,
            sliding_window=None, num_kv_heads=cfg.num_heads, head_dim=cfg.d_model // cfg.num_heads)
    hf_act = {"gelu": "gelu_new", "gelu_exact": "gelu", "relu": "relu"}
    if cfg.activation not in hf_act:
        raise Inexpressible(f"gpt2 cannot express activation={cfg.activation!r}")
    act = hf_act[cfg.activation]
    return {
        "vocab_size": cfg.vocab_size, "n_embd": cfg.d_model, "n_head": cfg.num_heads,
        "n_layer": cfg.num_layers, "n_inner": cfg.mlp_dim, "n_positions": cfg.max_len,
        "activation_function": act, "layer_norm_epsilon": cfg.norm_eps,
        "resid_pdrop": cfg.dropout_rate, "embd_pdrop": cfg.dropout_rate,
        "attn_pdrop": cfg.attention_dropout_rate, "tie_word_embeddings": cfg.tie_embeddings,
        **hf_special_ids(cfg),
    }


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
    # Causal-mask buffers that old checkpoints stored.
    ignored=(r"(transformer\.)?h\.\d+\.(attn|crossattention)\.(bias|masked_bias)",))
