"""`llama4_text` (Llama4ForCausalLM, the text model of Llama 4 Scout and Maverick): Llama's
layers with Meta's iRoPE and a mixture of experts.

- Attention: RoPE in Meta's interleaved (complex-pair) layout (`rope_interleaved`), in the
  layers `no_rope_layers` marks 1; the others (every fourth by default) have no positions
  (our `nope_layers`) and, with `attn_temperature_tuning`, their queries scaled by
  1 + attn_scale * log(1 + floor((position + 1) / floor_scale)). The rotating layers attend
  within chunks of `attention_chunk_size` positions (`layer_types` "chunked_attention",
  our "chunked") and, with `use_qk_norm`, L2-normalise their queries and keys after the
  rotation (`qk_l2_norm`); the others attend to every earlier position.
- MLP: the layers of `moe_layers` (every `interleave_moe_layer_step`-th by default) have
  `num_local_experts` SwiGLU experts of `intermediate_size`: a router picks the top
  `num_experts_per_tok` logits, each chosen expert reads the token scaled by the sigmoid of
  its logit (`router_score="sigmoid"`, `router_scales_input`), and a shared expert of the
  same width reads every token; the other layers have a dense SwiGLU of
  `intermediate_size_mlp`.

Checkpoints hold each expert layer's experts fused: `feed_forward.experts.gate_up_proj`
[E, D, 2F] (gate in the first F columns, up in the last) and `down_proj` [E, F, D], both
already [in, out]. A mix of dense and expert layers is loaded unscanned (`scan_layers`
refuses it).

One difference from transformers, in padded batches only: transformers counts a row's left
padding in the temperature's positions (it uses the cache length, not `position_ids`);
here a token's position is its own. Rows without padding, and every position below
`floor_scale` (8192 in the published configs), are the same either way.

The published checkpoints are multimodal (`llama4`, Llama4ForConditionalGeneration): their
`text_config` is read as above and their `language_model.*` tensors are the text model's;
the vision tower and its projector (`vision_model.*`, `multi_modal_projector.*`) are
skipped with a warning naming them, and the image token ids in config.json are not read.
Such a model saves as `llama4_text` (its text model alone).

Refused by name: `attention_bias=True`, an activation other than silu, `layer_types` other
than chunked and full attention, chunked layers without `attention_chunk_size`, a config
without expert layers, and a multimodal config given as `llama4_text`.
"""

from __future__ import annotations

import numpy as np

from models.config import TransformerConfig
from models.pretrained import llama
from models.pretrained.config_map import ConfigMap, Field, SpecialIds
from models.pretrained.family import ConfigReader, Family, Inexpressible
from models.pretrained.layouts import TRANSPOSE, Layout
from models.pretrained.mapping import Rule
from models.pretrained.rope import read_rope, write_rope
from models.pretrained.rules import (
    Scope,
    embeddings,
    final_norm,
    linear,
    norm,
    self_attention,
    untied_head,
)

# Llama4TextConfig's defaults where config.json may omit a field.
FIELDS = (
    Field("vocab_size", "vocab_size", 202048), Field("hidden_size", "d_model", 5120),
    Field("num_attention_heads", "num_heads", 40),
    Field("num_key_value_heads", "num_kv_heads", 8), Field("head_dim", "head_dim", 128),
    Field("intermediate_size_mlp", "mlp_dim", 16384),
    Field("num_hidden_layers", "num_layers", 48),
    Field("max_position_embeddings", "max_len", 131072),
    Field("rms_norm_eps", "norm_eps", 1e-5),
    Field("tie_word_embeddings", "tie_embeddings", False),
    Field("attention_dropout", "attention_dropout_rate", 0.0, float),
    Field("num_local_experts", "num_experts", 16),
    Field("num_experts_per_tok", "experts_per_token", 1),
    Field("router_aux_loss_coef", "router_aux_loss_coef", 0.001, float))
FIXED = dict(architecture="decoder_only", positions="rope", norm="rmsnorm", norm_position="pre",
             activation="swiglu", use_bias=False, qkv_bias=False, scale_embeddings=False,
             dropout_rate=0.0, rope_interleaved=True, router_score="sigmoid",
             router_scales_input=True, router_renormalize=False)
# `router_jitter_noise` and `for_llm_compressor` change nothing transformers' Llama 4 computes.
MAP = ConfigMap(fields=FIELDS, fixed=FIXED, accepted=dict(attention_bias=False),
                unread=("output_router_logits", "router_jitter_noise", "for_llm_compressor"),
                ids=SpecialIds(eos=2, start=1))
DEFAULT_THETA = 500_000.0
KINDS = {"chunked_attention": "chunked", "full_attention": "full"}
THEIR_KINDS = {v: k for k, v in KINDS.items()}


def config_from_hf(hf: dict) -> TransformerConfig:
    if "text_config" in hf:
        ConfigReader(hf, "llama4_text").refuse(
            "text_config", "...", "a multimodal config is model_type llama4, whose "
            "text_config this reads")
    if hf.get("rope_theta") is None and "rope_theta" not in (hf.get("rope_parameters") or {}):
        hf = {**hf, "rope_theta": DEFAULT_THETA}
    r = ConfigReader(hf, "llama4_text")
    act = r.take("hidden_act", "silu")
    if act != "silu":
        r.refuse("hidden_act", act, "Llama 4 gates with silu (SwiGLU)")
    mapped = MAP.read(r)
    layers = mapped["num_layers"]
    experts_width = r.take("intermediate_size", 8192)
    interval = r.take("no_rope_layer_interval", 4)
    rope_flags = r.take("no_rope_layers", None) or [int((i + 1) % interval != 0)
                                                    for i in range(layers)]
    if len(rope_flags) != layers or not set(rope_flags) <= {0, 1}:
        r.refuse("no_rope_layers", rope_flags, f"0 or 1 for each of the {layers} layers")
    chunk = hf.get("attention_chunk_size", 8192)      # null: no chunked layers
    r.take("attention_chunk_size", None)
    kinds = r.take("layer_types", None) or [
        "chunked_attention" if rotates and chunk is not None else "full_attention"
        for rotates in rope_flags]
    if not isinstance(kinds, list) or len(kinds) != layers or not set(kinds) <= set(KINDS):
        r.refuse("layer_types", kinds, f"one of {tuple(KINDS)} for each of the {layers} layers")
    if "chunked_attention" in kinds and chunk is None:
        r.refuse("attention_chunk_size", None, "chunked layers need a chunk size")
    step = r.take("interleave_moe_layer_step", 1)
    moe = r.take("moe_layers", None)
    moe = list(range(step - 1, layers, step)) if moe is None else moe
    if not moe:
        r.refuse("moe_layers", moe, "a Llama 4 with expert layers (a dense one is llama)")
    nope = tuple(i for i, rotates in enumerate(rope_flags) if not rotates)
    tuning = r.take("attn_temperature_tuning", True)
    floor, scale = r.take("floor_scale", 8192), float(r.take("attn_scale", 0.1))
    ours_kinds = tuple(KINDS[k] for k in kinds)
    cfg = TransformerConfig(
        **mapped, **read_rope(r, mapped["max_len"]), expert_mlp_dim=experts_width,
        shared_expert_mlp_dim=experts_width,
        moe_layers=() if len(moe) == layers else tuple(moe), nope_layers=nope,
        layer_types=() if set(ours_kinds) == {"full"} else ours_kinds,
        attention_chunk_size=chunk if "chunked" in ours_kinds else None,
        qk_l2_norm=bool(r.take("use_qk_norm", True)),
        attn_temperature_floor=floor if tuning and nope else None,
        attn_temperature_scale=scale)
    r.finish()
    return cfg


def config_to_hf(cfg: TransformerConfig) -> dict:
    if not cfg.num_experts:
        raise Inexpressible("llama4_text cannot express num_experts=0 (every Llama 4 has "
                            "expert layers)")
    if cfg.shared_expert_mlp_dim != cfg.expert_width:
        raise Inexpressible(f"llama4_text's shared expert is as wide as the experts "
                            f"(shared_expert_mlp_dim={cfg.shared_expert_mlp_dim}, "
                            f"expert width {cfg.expert_width})")
    layers = cfg.num_layers
    kinds = cfg.layer_types or (("chunked" if cfg.attention_chunk_size else "full"),) * layers
    out = MAP.write(cfg, "llama4_text", layer_types=cfg.layer_types,
                    attention_chunk_size=cfg.attention_chunk_size, nope_layers=cfg.nope_layers,
                    moe_layers=cfg.moe_layers, qk_l2_norm=cfg.qk_l2_norm,
                    attn_temperature_floor=cfg.attn_temperature_floor,
                    attn_temperature_scale=cfg.attn_temperature_scale,
                    expert_mlp_dim=cfg.expert_mlp_dim,
                    shared_expert_mlp_dim=cfg.shared_expert_mlp_dim)
    return {**out, **write_rope(cfg), "hidden_act": "silu", "attention_bias": False,
            "intermediate_size": cfg.expert_width,
            "no_rope_layers": [int(i not in cfg.nope_layers) for i in range(layers)],
            "layer_types": [THEIR_KINDS[k] for k in kinds],
            "attention_chunk_size": cfg.attention_chunk_size,
            "moe_layers": [i for i in range(layers) if cfg.layer_has_experts(i)],
            "interleave_moe_layer_step": 1, "use_qk_norm": cfg.qk_l2_norm,
            "attn_temperature_tuning": cfg.attn_temperature_floor is not None,
            "floor_scale": cfg.attn_temperature_floor or 8192,
            "attn_scale": cfg.attn_temperature_scale}


# The fused experts: gate_up [E, D, 2F], gate in the first F columns <-> our gate and up
# [E, D, F] (views, so loading copies nothing).
GATE_THEN_UP = Layout(lambda xs, cfg: np.split(xs[0], 2, axis=-1),
                      lambda ks, cfg: [np.concatenate(ks, axis=-1)])
LAYER = llama.LAYER


def _feed_forward(cfg: TransformerConfig, i: int) -> list[Rule]:
    """Layer i's MLP: the experts, their router and the shared expert, or the dense MLP."""
    at = Scope(f"model.layers.{i}.feed_forward.", f"decoder/layer_{i}/mlp/")
    if not cfg.layer_has_experts(i):
        return [r for name in ("gate", "up", "down")
                for r in linear(at, f"{name}_proj", name, bias=False)]
    shared = Scope(f"{at.theirs}shared_expert.", f"{at.ours}shared_expert/")
    return [at.rule("router.weight", "router_kernel", TRANSPOSE),
            at.rule("experts.gate_up_proj", ["gate_kernel", "up_kernel"], GATE_THEN_UP),
            at.rule("experts.down_proj", "down_kernel"),
            *(r for name in ("gate", "up", "down")
              for r in linear(shared, f"{name}_proj", name, bias=False))]


def rules(cfg: TransformerConfig) -> list[Rule]:
    return [*embeddings(cfg, tokens="model.embed_tokens"),
            *self_attention(cfg, LAYER, llama.ATTENTION),
            *(r for i in range(cfg.num_layers) for r in _feed_forward(cfg, i)),
            *norm(cfg, LAYER, "input_layernorm", "self_attention_norm"),
            *norm(cfg, LAYER, "post_attention_layernorm", "mlp_norm"),
            *final_norm(cfg, "decoder", "model.norm"), *untied_head(cfg)]


FAMILY: Family = llama.family("llama4_text", "Llama4ForCausalLM", config_from_hf,
                              config_to_hf, rules)


def multimodal_config_from_hf(hf: dict) -> TransformerConfig:
    """The text model of a multimodal config.json (its `text_config`)."""
    r = ConfigReader(hf, "llama4")
    text = r.take("text_config")
    if not isinstance(text, dict):
        r.refuse("text_config", text, "a dict of Llama4TextConfig's fields")
    for key in ("vision_config", "boi_token_index", "eoi_token_index", "image_token_index",
                "tie_word_embeddings"):
        r.take(key, None)                     # the image side's, or the text config's own
    cfg = config_from_hf({**text, "model_type": "llama4_text"})
    r.finish()
    return cfg


def multimodal_config_to_hf(cfg: TransformerConfig) -> dict:
    raise Inexpressible("llama4 (multimodal) needs a vision tower this project does not "
                        "hold: save the text model as llama4_text")


MULTIMODAL = Family(
    model_type="llama4", architectures=("Llama4ForConditionalGeneration",),
    config_from_hf=multimodal_config_from_hf, config_to_hf=multimodal_config_to_hf,
    rules=rules, renames=((r"^language_model\.", ""),),
    skipped=(r"vision_model\..*", r"multi_modal_projector\..*"),
    ignored=(r"(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq",))
