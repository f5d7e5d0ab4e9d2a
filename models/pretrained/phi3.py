"""`phi3` (Phi3ForCausalLM, Phi-3 and Phi-3.5 mini): Llama's computation with the query,
key and value projections fused in one `qkv_proj` (rows q, then k, then v) and the MLP's
gate and up fused in one `gate_up_proj` (rows gate, then up), split on load and fused again
on save; head_dim D / N; a sliding window as Mistral's (`sliding_window`, null: none);
RoPE over the first `partial_rotary_factor` of each head; LongRoPE scaling for the long
variants (`rope_type` "longrope", or "su" / "yarn", which Phi3Config reads as longrope),
with `original_max_position_embeddings` at the top level (4096 when absent), as
transformers reads it. Residual and embedding dropout must be 0 (the published values).
"""

from __future__ import annotations

from models.config import TransformerConfig
from models.pretrained import llama
from models.pretrained.config_map import D_OVER_N, ConfigMap, Field, SpecialIds
from models.pretrained.family import ConfigReader, Inexpressible
from models.pretrained.mapping import Rule
from models.pretrained.rope import ORIGINAL, read_rope, write_rope
from models.pretrained.rules import (
    Attention,
    Mlp,
    embeddings,
    final_norm,
    mlp,
    norm,
    self_attention,
    untied_head,
)
from models.rope_scaling import LongRopeScaling

# Phi3Config's defaults where config.json may omit a field.
FIELDS = (
    Field("vocab_size", "vocab_size", 32064), Field("hidden_size", "d_model", 3072),
    Field("num_attention_heads", "num_heads", 32),
    Field("num_key_value_heads", "num_kv_heads", None),            # None: num_heads
    Field("intermediate_size", "mlp_dim", 8192), Field("num_hidden_layers", "num_layers", 32),
    Field("max_position_embeddings", "max_len", 4096), Field("rms_norm_eps", "norm_eps", 1e-5),
    Field("tie_word_embeddings", "tie_embeddings", False),
    Field("attention_dropout", "attention_dropout_rate", 0.0, float),
    Field("sliding_window", "sliding_window", None))
MAP = ConfigMap(
    fields=FIELDS,
    fixed={**llama.FIXED, "use_bias": False, "qkv_bias": False, "head_dim": D_OVER_N},
    accepted=dict(resid_pdrop=0.0, embd_pdrop=0.0),
    ids=SpecialIds(pad=32000, eos=32000, start=1))
ALIASES = {"su": "longrope", "yarn": "longrope"}
DEFAULT_ORIGINAL = 4096


def config_from_hf(hf: dict) -> TransformerConfig:
    r = ConfigReader(hf, "phi3")
    act = r.take("hidden_act", "silu")
    if act != "silu":
        r.refuse("hidden_act", act, "Phi-3 gates with silu (SwiGLU)")
    mapped = MAP.read(r)
    rope = read_rope(r, mapped["max_len"], partial=True, aliases=ALIASES,
                     original=DEFAULT_ORIGINAL)
    if rope["rope_scaling"] is not None and not isinstance(rope["rope_scaling"],
                                                           LongRopeScaling):
        kind = (r.hf.get("rope_parameters") or r.hf.get("rope_scaling"))
        r.refuse("rope_parameters", kind, "Phi3Config takes 'default' or 'longrope'")
    cfg = TransformerConfig(**mapped, **rope)
    r.finish()
    return cfg


def config_to_hf(cfg: TransformerConfig) -> dict:
    s = cfg.rope_scaling
    if s is not None and not isinstance(s, LongRopeScaling):
        raise Inexpressible(f"phi3 cannot express rope_scaling={s!r} (it has longrope or none)")
    return {**MAP.write(cfg, "phi3"), "hidden_act": "silu", **write_rope(cfg, partial=True),
            ORIGINAL: s.original_max_len if s is not None else cfg.max_len,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0}


LAYER = llama.LAYER
ATTENTION = Attention(qkv="self_attn.qkv_proj", o="self_attn.o_proj")
MLP = Mlp(gate_up="mlp.gate_up_proj", down="mlp.down_proj")


def rules(cfg: TransformerConfig) -> list[Rule]:
    return [*embeddings(cfg, tokens="model.embed_tokens"),
            *self_attention(cfg, LAYER, ATTENTION), *mlp(cfg, LAYER, MLP),
            *norm(cfg, LAYER, "input_layernorm", "self_attention_norm"),
            *norm(cfg, LAYER, "post_attention_layernorm", "mlp_norm"),
            *final_norm(cfg, "decoder", "model.norm"), *untied_head(cfg)]


FAMILY = llama.family("phi3", "Phi3ForCausalLM", config_from_hf, config_to_hf, rules)
