"""`deepseek_v3` (DeepseekV3ForCausalLM: DeepSeek-V3, R1 and their kin): multi-head latent
attention and a mixture of shared and routed experts.

- Attention (`models.latent_attention`): queries through a low-rank `q_a_proj` with its
  RMSNorm and `q_b_proj` (or one `q_proj` when `q_lora_rank` is null); keys and values from
  one compressed latent (`kv_a_proj_with_mqa` -> the latent, normed by `kv_a_layernorm`,
  and one rotated key part every head shares; `kv_b_proj` expands the latent to each head's
  unrotated key and value). RoPE covers `qk_rope_head_dim` channels, in DeepSeek's
  interleaved pairs (`rope_interleave`); YaRN's `mscale_all_dim` also scales the logits
  (mscale^2, carried in `query_pre_attn_scalar`). The cache holds the latent and the
  rotated key: `kv_lora_rank + qk_rope_head_dim` numbers per token and layer.
- MLP: the first `first_k_dense_replace` layers dense SwiGLU of `intermediate_size`; the
  others `n_routed_experts` experts of `moe_intermediate_size` chosen by sigmoid scores
  plus the selection bias `e_score_correction_bias` among the best `topk_group` of
  `n_group` groups, weighted by their (renormalised, `norm_topk_prob`) scores times
  `routed_scaling_factor`, plus `n_shared_experts` shared experts as one SwiGLU of
  `n_shared_experts * moe_intermediate_size`.

Checkpoints hold each expert apart (`mlp.experts.{e}.gate_proj`, ...), as the published
files and transformers' `save_pretrained` do. The published files' multi-token-prediction
module (`num_nextn_predict_layers`: layers past the last, with `enorm`, `hnorm`, `eh_proj`
and `shared_head` beside a decoder layer's tensors) is not part of the causal LM
transformers builds: its tensors are skipped with a warning naming them.

Refused by name: FP8 checkpoints (`quantization_config`), `attention_bias=True`,
`num_key_value_heads` other than `num_attention_heads`, an activation other than silu,
`scoring_func` other than sigmoid, `topk_method` other than noaux_tc, `moe_layer_freq`
other than 1, and a config without expert layers.
"""

from __future__ import annotations

import math

from models.config import TransformerConfig
from models.pretrained import mixtral
from models.pretrained.config_map import ConfigMap, Field, SpecialIds
from models.pretrained.family import ConfigReader, Family, Inexpressible
from models.pretrained.layouts import one
from models.pretrained.mapping import Rule
from models.pretrained.rope import read_rope, write_rope
from models.pretrained.rules import Scope, embeddings, final_norm, linear, norm, untied_head
from models.rope_scaling import YarnRopeScaling

# DeepseekV3Config's defaults where config.json may omit a field.
FIELDS = (
    Field("vocab_size", "vocab_size", 129280), Field("hidden_size", "d_model", 7168),
    Field("num_attention_heads", "num_heads", 128),
    Field("intermediate_size", "mlp_dim", 18432),
    Field("moe_intermediate_size", "expert_mlp_dim", 2048),
    Field("num_hidden_layers", "num_layers", 61),
    Field("max_position_embeddings", "max_len", 4096),
    Field("rms_norm_eps", "norm_eps", 1e-6),
    Field("tie_word_embeddings", "tie_embeddings", False),
    Field("attention_dropout", "attention_dropout_rate", 0.0, float),
    Field("n_routed_experts", "num_experts", 256),
    Field("num_experts_per_tok", "experts_per_token", 8),
    Field("norm_topk_prob", "router_renormalize", True),
    Field("routed_scaling_factor", "routed_scaling", 2.5, float),
    Field("n_group", "router_groups", 8), Field("topk_group", "router_top_groups", 4),
    Field("kv_lora_rank", "kv_lora_rank", 512),
    Field("qk_rope_head_dim", "qk_rope_head_dim", 64), Field("v_head_dim", "v_head_dim", 128),
    Field("rope_interleave", "rope_interleaved", True))
FIXED = dict(architecture="decoder_only", positions="rope", norm="rmsnorm", norm_position="pre",
             activation="swiglu", use_bias=False, qkv_bias=False, scale_embeddings=False,
             dropout_rate=0.0, router_score="sigmoid", router_score_bias=True)
# Training-time settings of DeepSeek's own code (the balancing loss, expert placement) and
# the MTP module's count: nothing transformers' causal LM computes.
MAP = ConfigMap(fields=FIELDS, fixed=FIXED, accepted=dict(attention_bias=False),
                unread=("output_router_logits", "aux_loss_alpha", "seq_aux", "ep_size",
                        "num_nextn_predict_layers", "num_mtp_layers", "pretraining_tp"),
                ids=SpecialIds(eos=1, start=0))
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def config_from_hf(hf: dict) -> TransformerConfig:
    if hf.get("rope_parameters") is None and hf.get("rope_scaling") is None \
            and hf.get("rope_theta") is None:
        hf = {**hf, "rope_parameters": DEFAULT_ROPE}
    r = ConfigReader(hf, "deepseek_v3")
    if r.hf.get("quantization_config") is not None:
        r.refuse("quantization_config", r.hf["quantization_config"].get("quant_method"),
                 "unquantized weights (load a checkpoint dequantized to bfloat16 or float32)")
    for key, want in (("hidden_act", "silu"), ("scoring_func", "sigmoid"),
                      ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
        got = r.take(key, want)
        if got != want:
            r.refuse(key, got, f"{want!r}, the one DeepSeek-V3 computes")
    mapped = MAP.read(r)
    heads = mapped["num_heads"]
    kv_heads = r.take("num_key_value_heads", heads)
    if kv_heads != heads:
        r.refuse("num_key_value_heads", kv_heads, f"num_attention_heads={heads} (latent "
                 "attention expands the latent to every head)")
    nope = r.take("qk_nope_head_dim", 128)
    rope_dim = mapped["qk_rope_head_dim"]
    for key, value in (("head_dim", rope_dim), ("qk_head_dim", nope + rope_dim)):
        got = r.take(key, value)                     # derived by transformers; must agree
        if got != value:
            r.refuse(key, got, f"{value}, what transformers derives from the head widths")
    layers = mapped["num_layers"]
    dense = r.take("first_k_dense_replace", 3)
    if not 0 <= dense < layers:
        r.refuse("first_k_dense_replace", dense, f"at least one expert layer of {layers}")
    shared = r.take("n_shared_experts", 1)
    q_lora = r.hf.get("q_lora_rank", 1536)             # null: one full-rank q_proj
    r.take("q_lora_rank", None)
    rope = read_rope(r, mapped["max_len"])
    head_dim = nope + rope_dim
    cfg = TransformerConfig(
        **mapped, **rope, head_dim=head_dim, num_kv_heads=heads, q_lora_rank=q_lora,
        shared_expert_mlp_dim=shared * mapped["expert_mlp_dim"] if shared else None,
        moe_layers=tuple(range(dense, layers)) if dense else (),
        query_pre_attn_scalar=logit_scalar(head_dim, rope["rope_scaling"]))
    r.finish()
    return cfg


def logit_scalar(head_dim: int, scaling) -> float | None:
    """`query_pre_attn_scalar` for DeepSeek's logit scale head_dim^-1/2 * mscale^2, where
    YaRN's `mscale_all_dim` gives mscale = 0.1 mscale_all_dim ln(factor) + 1 (None: no
    YaRN mscale, the plain head_dim^-1/2)."""
    if not isinstance(scaling, YarnRopeScaling) or not scaling.mscale_all_dim \
            or scaling.factor <= 1:
        return None
    m = 0.1 * scaling.mscale_all_dim * math.log(scaling.factor) + 1.0
    return float(head_dim / m ** 4)


def config_to_hf(cfg: TransformerConfig) -> dict:
    mixtral.require_experts(cfg, "deepseek_v3")
    if not cfg.latent:
        raise Inexpressible("deepseek_v3 needs latent attention (kv_lora_rank)")
    dense = cfg.moe_layers[0] if cfg.moe_layers else 0
    if cfg.moe_layers and cfg.moe_layers != tuple(range(dense, cfg.num_layers)):
        raise Inexpressible(f"deepseek_v3's expert layers follow its first dense ones: "
                            f"moe_layers={list(cfg.moe_layers)} is not a final run")
    shared = cfg.shared_expert_mlp_dim or 0
    if shared % cfg.expert_width:
        raise Inexpressible(f"deepseek_v3's shared experts are a whole number of experts: "
                            f"shared_expert_mlp_dim={shared}, expert width {cfg.expert_width}")
    out = MAP.write(cfg, "deepseek_v3", moe_layers=cfg.moe_layers, head_dim=cfg.head_dim,
                    q_lora_rank=cfg.q_lora_rank,
                    num_kv_heads=cfg.num_heads,
                    query_pre_attn_scalar=logit_scalar(cfg.head_dim, cfg.rope_scaling),
                    shared_expert_mlp_dim=cfg.shared_expert_mlp_dim)
    return {**out, **write_rope(cfg), "hidden_act": "silu", "attention_bias": False,
            "num_key_value_heads": cfg.num_heads,
            "qk_nope_head_dim": cfg.head_dim - cfg.rope_dim,
            "first_k_dense_replace": dense, "n_shared_experts": shared // cfg.expert_width,
            "q_lora_rank": cfg.q_lora_rank}


# [heads * X, in] `nn.Linear` <-> a kernel [in, N, X]; [out, N * X] <-> [N, X, out].
TO_HEADS = one(lambda x, cfg: x.T.reshape(x.shape[1], cfg.num_heads, -1),
               lambda k, cfg: k.reshape(k.shape[0], -1).T)
FROM_HEADS = one(lambda x, cfg: x.T.reshape(cfg.num_heads, -1, x.shape[0]),
                 lambda k, cfg: k.reshape(-1, k.shape[-1]).T)


def _layer(cfg: TransformerConfig, i: int) -> list[Rule]:
    """Layer i: latent attention, its norms, and the dense MLP or the experts."""
    at = Scope(f"model.layers.{i}.", f"decoder/layer_{i}/")
    attn = Scope(f"{at.theirs}self_attn.", f"{at.ours}self_attention/")
    if cfg.q_lora_rank is None:
        queries = [attn.rule("q_proj.weight", "query/kernel", TO_HEADS)]
    else:
        queries = [*linear(attn, "q_a_proj", "query_a", bias=False),
                   *norm(cfg, attn, "q_a_layernorm", "query_a_norm"),
                   attn.rule("q_b_proj.weight", "query_b/kernel", TO_HEADS)]
    table = [*queries, *linear(attn, "kv_a_proj_with_mqa", "kv_a", bias=False),
             *norm(cfg, attn, "kv_a_layernorm", "kv_a_norm"),
             attn.rule("kv_b_proj.weight", "kv_b_kernel", TO_HEADS),
             attn.rule("o_proj.weight", "out/kernel", FROM_HEADS),
             *norm(cfg, at, "input_layernorm", "self_attention_norm"),
             *norm(cfg, at, "post_attention_layernorm", "mlp_norm")]
    mlp = Scope(f"{at.theirs}mlp.", f"{at.ours}mlp/")
    if not cfg.layer_has_experts(i):
        return table + [r for name in ("gate", "up", "down")
                        for r in linear(mlp, f"{name}_proj", name, bias=False)]
    shared = Scope(f"{mlp.theirs}shared_experts.", f"{mlp.ours}shared_expert/")
    return table + [
        *mixtral.experts(cfg, at, router="mlp.gate", pattern="mlp.experts.{e}.{name}",
                         gate="gate_proj", up="up_proj", down="down_proj"),
        mlp.rule("gate.e_score_correction_bias", "router_score_bias"),
        *(r for name in ("gate", "up", "down")
          for r in linear(shared, f"{name}_proj", name, bias=False))]


def rules(cfg: TransformerConfig) -> list[Rule]:
    return [*embeddings(cfg, tokens="model.embed_tokens"),
            *(r for i in range(cfg.num_layers) for r in _layer(cfg, i)),
            *final_norm(cfg, "decoder", "model.norm"), *untied_head(cfg)]


FAMILY: Family = Family(
    model_type="deepseek_v3", architectures=("DeepseekV3ForCausalLM",),
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, rules=rules, prefix="model.",
    ignored=(r"(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq",),
    skipped_layers=r"model\.layers\.(\d+)\..*")
