"""`gpt_oss` (GptOssForCausalLM, gpt-oss-20b and gpt-oss-120b): grouped-query attention with
biases on every projection and a learned sink logit per query head (`attention_sinks`),
alternating sliding-window and full layers (`layer_types`, a sliding first layer by
default), YaRN RoPE, and a mixture of experts in every layer: a biased router picks
`num_experts_per_tok` of `num_local_experts` experts (softmax over the chosen logits, which
is our softmax-then-renormalise), each a biased gated MLP with GPT-OSS's clamped SwiGLU
(`activation="clamped_swiglu"`, `swiglu_alpha`, `swiglu_limit`).

Checkpoints hold the experts fused, as transformers' `GptOssExperts` keeps them: one
`mlp.experts.gate_up_proj` [E, D, 2F] whose even columns are the gate and odd ones the up
projection (and its bias [E, 2F]), `down_proj` [E, F, D] (and [E, D]); they split into our
`gate_kernel` / `up_kernel` [E, D, F] on load and interleave again on save. The published
checkpoints store the experts in MXFP4 (`*_blocks` and `*_scales` tensors, with a
`quantization_config`): those are refused by name; a checkpoint dequantized to bfloat16 or
float32 (what transformers' `Mxfp4Config(dequantize=True)` saves) loads.

`hidden_act` is accepted with any value: transformers' GPT-OSS experts do not read it.
Refused by name: `attention_bias=False` (the experts' biases come with the attention's
here), a sliding layer without a window.
"""

from __future__ import annotations

import numpy as np

from models.config import TransformerConfig
from models.pretrained import gemma2, llama, mixtral
from models.pretrained.config_map import ConfigMap, Field, SpecialIds
from models.pretrained.family import ConfigReader
from models.pretrained.layouts import TRANSPOSE, Layout
from models.pretrained.mapping import Rule
from models.pretrained.rope import read_rope, write_rope
from models.pretrained.rules import embeddings, final_norm, norm, self_attention, untied_head

# GptOssConfig's defaults where config.json may omit a field.
FIELDS = (
    Field("vocab_size", "vocab_size", 201088), Field("hidden_size", "d_model", 2880),
    Field("num_attention_heads", "num_heads", 64),
    Field("num_key_value_heads", "num_kv_heads", 8), Field("head_dim", "head_dim", 64),
    Field("intermediate_size", "mlp_dim", 2880), Field("num_hidden_layers", "num_layers", 36),
    Field("max_position_embeddings", "max_len", 131072),
    Field("rms_norm_eps", "norm_eps", 1e-5),
    Field("tie_word_embeddings", "tie_embeddings", False),
    Field("attention_dropout", "attention_dropout_rate", 0.0, float),
    Field("num_local_experts", "num_experts", 128),
    Field("num_experts_per_tok", "experts_per_token", 4),
    Field("router_aux_loss_coef", "router_aux_loss_coef", 0.001, float),
    Field("swiglu_alpha", "swiglu_alpha", 1.702, float),
    Field("swiglu_limit", "swiglu_limit", 7.0, float))
FIXED = dict(architecture="decoder_only", positions="rope", norm="rmsnorm", norm_position="pre",
             activation="clamped_swiglu", use_bias=True, qkv_bias=False, attention_sinks=True,
             router_renormalize=True, expert_mlp_dim=None, scale_embeddings=False,
             dropout_rate=0.0)
# `initial_context_length` (the published files' name for YaRN's original length, which
# transformers reads from rope_scaling) and `hidden_act` change nothing transformers computes.
MAP = ConfigMap(fields=FIELDS, fixed=FIXED, accepted=dict(attention_bias=True),
                unread=("hidden_act", "output_router_logits", "initial_context_length"),
                ids=SpecialIds(start="eos"))
# GptOssConfig's RoPE when config.json names none.
DEFAULT_ROPE = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}
DEFAULT_WINDOW = 128


def config_from_hf(hf: dict) -> TransformerConfig:
    if hf.get("rope_parameters") is None and hf.get("rope_scaling") is None:
        hf = {**hf, "rope_parameters": {**DEFAULT_ROPE, **(
            {"rope_theta": hf["rope_theta"]} if hf.get("rope_theta") is not None else {})}}
        hf.pop("rope_theta", None)
    elif hf.get("rope_theta") is None and "rope_theta" not in (hf.get("rope_parameters") or {}):
        hf = {**hf, "rope_theta": DEFAULT_ROPE["rope_theta"]}
    r = ConfigReader(hf, "gpt_oss")
    legacy = r.take("experts_per_token", None)     # the published files' second name for it
    if legacy is not None and legacy != r.hf.get("num_experts_per_tok", legacy):
        r.refuse("experts_per_token", legacy,
                 f"it differs from num_experts_per_tok={r.hf['num_experts_per_tok']}")
    if r.hf.get("quantization_config") is not None:
        r.refuse("quantization_config", r.hf["quantization_config"].get("quant_method"),
                 "unquantized weights (load a checkpoint dequantized to bfloat16 or float32)")
    mapped = MAP.read(r)
    layers = mapped["num_layers"]
    kinds = r.take("layer_types", None)
    if kinds is None:
        kinds = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if not isinstance(kinds, list) or len(kinds) != layers or not set(kinds) <= set(gemma2.KINDS):
        r.refuse("layer_types", kinds, f"one of {tuple(gemma2.KINDS)} for each of the {layers} "
                 "layers")
    window = r.take("sliding_window", None) if "sliding_window" in r.hf else DEFAULT_WINDOW
    if "sliding_attention" in kinds and window is None:
        r.refuse("sliding_window", None, "sliding layers need a window")
    cfg = TransformerConfig(**mapped, **read_rope(r, mapped["max_len"]),
                            layer_types=tuple(gemma2.KINDS[k] for k in kinds),
                            sliding_window=window)
    r.finish()
    return cfg


def config_to_hf(cfg: TransformerConfig) -> dict:
    mixtral.require_experts(cfg, "gpt_oss")
    out = MAP.write(cfg, "gpt_oss", layer_types=cfg.layer_types,
                    sliding_window=cfg.sliding_window)
    kinds = cfg.layer_types or ("full",) * cfg.num_layers
    return {**out, **write_rope(cfg), "attention_bias": True, "hidden_act": "silu",
            "layer_types": [gemma2.THEIR_KINDS[k] for k in kinds],
            "sliding_window": cfg.sliding_window}


def _interleave(xs, cfg):
    """gate [..., F] and up [..., F] -> [..., 2F], gate in the even columns."""
    return [np.stack(xs, axis=-1).reshape(*xs[0].shape[:-1], -1)]


# The fused experts: gate_up [E, D, 2F] (bias [E, 2F]), gate in the even columns <-> our
# gate and up [E, D, F] ([E, F]); strided views, so loading copies nothing.
INTERLEAVED_GATE_UP = Layout(lambda xs, cfg: [xs[0][..., 0::2], xs[0][..., 1::2]], _interleave)
LAYER = llama.LAYER


def rules(cfg: TransformerConfig) -> list[Rule]:
    experts = "mlp.experts"
    return [*embeddings(cfg, tokens="model.embed_tokens"),
            *self_attention(cfg, LAYER, llama.ATTENTION),
            LAYER.rule("self_attn.sinks", "self_attention/sinks"),
            LAYER.rule("mlp.router.weight", "mlp/router_kernel", TRANSPOSE),
            LAYER.rule("mlp.router.bias", "mlp/router_bias"),
            LAYER.rule(f"{experts}.gate_up_proj", ["mlp/gate_kernel", "mlp/up_kernel"],
                       INTERLEAVED_GATE_UP),
            LAYER.rule(f"{experts}.gate_up_proj_bias", ["mlp/gate_bias", "mlp/up_bias"],
                       INTERLEAVED_GATE_UP),
            LAYER.rule(f"{experts}.down_proj", "mlp/down_kernel"),
            LAYER.rule(f"{experts}.down_proj_bias", "mlp/down_bias"),
            *norm(cfg, LAYER, "input_layernorm", "self_attention_norm"),
            *norm(cfg, LAYER, "post_attention_layernorm", "mlp_norm"),
            *final_norm(cfg, "decoder", "model.norm"), *untied_head(cfg)]


FAMILY = llama.family("gpt_oss", "GptOssForCausalLM", config_from_hf, config_to_hf, rules)
