"""The checks across a `models.TransformerConfig`'s fields: every combination a model
cannot compute is refused here, naming the fields and their values (each field's own type
and range are checked in `models.config` as it is set)."""

from __future__ import annotations

from models.errors import UserError
from models.lora import check_against, matches
from models.rope_scaling import DynamicRopeScaling, LongRopeScaling


def validate(cfg) -> None:
    """Refuses a `TransformerConfig` whose fields contradict each other."""
    if cfg.num_heads % cfg.num_kv_heads:
        raise UserError(
            f"TransformerConfig.num_heads={cfg.num_heads} is not divisible by "
            f"num_kv_heads={cfg.num_kv_heads}")
    if cfg.audio is not None and (cfg.architecture != "encoder_decoder"
                                  or cfg.share_embeddings):
        raise UserError(
            f"TransformerConfig.audio needs architecture='encoder_decoder' (not "
            f"{cfg.architecture!r}) and share_embeddings=False (not {cfg.share_embeddings}):"
            " the encoder reads audio features, the decoder alone has a token table")
    if cfg.positions == "rope" and cfg.head_dim % 2:
        raise UserError(
            f"TransformerConfig.head_dim={cfg.head_dim} must be even for rope positions")
    if cfg.remat_policy != "full" and not cfg.remat:
        raise UserError(f"TransformerConfig.remat_policy={cfg.remat_policy!r} chooses "
                        "what remat keeps, and needs remat=True")
    if cfg.rope_theta <= 0:
        raise UserError(f"TransformerConfig.rope_theta={cfg.rope_theta} must be > 0")
    if not cfg.norm_eps > 0:
        raise UserError(f"TransformerConfig.norm_eps={cfg.norm_eps} must be > 0")
    for name in ("dropout_rate", "attention_dropout_rate", "mlp_dropout_rate"):
        rate = getattr(cfg, name)
        if not 0.0 <= rate < 1.0:
            raise UserError(f"TransformerConfig.{name}={rate} must be in [0, 1)")
    for name in ("num_token_types", "num_labels"):
        if getattr(cfg, name) < 0:
            raise UserError(f"TransformerConfig.{name}={getattr(cfg, name)} must be >= 0")
        if getattr(cfg, name) and cfg.architecture != "encoder_only":
            raise UserError(f"TransformerConfig.{name}={getattr(cfg, name)} needs "
                             f"architecture='encoder_only', not {cfg.architecture!r}")
    if cfg.label_names and len(cfg.label_names) != cfg.num_labels:
        raise UserError(f"TransformerConfig.label_names has {len(cfg.label_names)} "
                         f"names {list(cfg.label_names)[:8]}, but num_labels="
                         f"{cfg.num_labels}")
    if cfg.position_offset < 0:
        raise UserError(
            f"TransformerConfig.position_offset={cfg.position_offset} must be >= 0")
    if cfg.position_offset and cfg.positions not in ("learned", "sinusoidal"):
        raise UserError(f"TransformerConfig.position_offset={cfg.position_offset} needs "
                         f"positions='learned' or 'sinusoidal', not {cfg.positions!r}")
    fewest = 2 if cfg.architecture == "decoder_only" else 4
    if cfg.positions == "relative" and cfg.relative_buckets < fewest:
        # An encoder halves the buckets per direction, and each half keeps half its
        # buckets for exact distances: at least 1 of each.
        raise UserError(
            f"TransformerConfig.relative_buckets={cfg.relative_buckets} is too few "
            f"(at least {fewest} with a bidirectional stack)")
    if cfg.positions == "relative" and (
            cfg.relative_max_distance <= cfg.relative_buckets // 2):
        raise UserError(
            f"TransformerConfig.relative_max_distance={cfg.relative_max_distance} must "
            f"exceed relative_buckets // 2 = {cfg.relative_buckets // 2} (the exact "
            "buckets end there; the logarithmic ones reach up to the max distance)")
    if cfg.norm_scale_offset and cfg.norm != "rmsnorm":
        raise UserError(f"TransformerConfig.norm_scale_offset={cfg.norm_scale_offset} "
                        f"needs norm='rmsnorm', not {cfg.norm!r}")
    if cfg.qk_norm and cfg.is_encoder_decoder:
        raise UserError("TransformerConfig.qk_norm=True normalises self-attention's "
                        "queries and keys; an encoder-decoder's cross-attention has no "
                        "such norms")
    if cfg.rope_scaling is not None and cfg.positions != "rope":
        raise UserError(f"TransformerConfig.rope_scaling={cfg.rope_scaling} needs "
                         f"positions='rope', not {cfg.positions!r}")
    _check_latent_attention(cfg)
    _check_linear_attention(cfg)
    _check_rope(cfg)
    _check_attention_variants(cfg)
    _check_moe(cfg)
    if cfg.lora is not None:
        check_against(cfg.lora, cfg)
    if cfg.is_encoder_decoder and cfg.bos_id is None:
        raise UserError("TransformerConfig.bos_id=None: an encoder-decoder needs the "
                         "decoder's start token")
    for name in ("pad_id", "eos_id", "bos_id"):
        value = getattr(cfg, name)
        if value is not None and not 0 <= value < cfg.vocab_size:
            raise UserError(
                f"TransformerConfig.{name}={value!r} must be an int in "
                f"[0, vocab_size={cfg.vocab_size})")

def _check_rope(cfg) -> None:
    f, s = cfg.partial_rotary_factor, cfg.rope_scaling
    if f != 1.0 and cfg.positions != "rope":
        raise UserError(f"TransformerConfig.partial_rotary_factor={f} needs "
                         f"positions='rope', not {cfg.positions!r}")
    if cfg.positions == "rope" and (not 0.0 < f <= 1.0 or cfg.rope_dim < 2
                                     or cfg.rope_dim % 2):
        raise UserError(f"TransformerConfig.partial_rotary_factor={f} must be in (0, 1] "
                         f"and rotate an even number of channels (int(head_dim={cfg.head_dim}"
                         f" * {f}) = {int(cfg.head_dim * f)})")
    if isinstance(s, DynamicRopeScaling) and cfg.max_len > s.original_max_len:
        raise UserError(
            f"TransformerConfig.max_len={cfg.max_len} exceeds the dynamic RoPE scaling's "
            f"original_max_len={s.original_max_len}: past it transformers rescales from "
            "the longest sequence each module has seen over the whole batch (state kept "
            "between calls), which no call here can compute; within it the frequencies "
            "are unscaled")
    if isinstance(s, LongRopeScaling) and len(s.short_factor) != cfg.rope_dim // 2:
        raise UserError(f"TransformerConfig.rope_scaling: longrope has "
                         f"{len(s.short_factor)} factors for {cfg.rope_dim // 2} rotary "
                         "frequencies")

def _check_attention_variants(cfg) -> None:
    """Per-layer kinds, soft-capping, output norms, the query scale."""
    if cfg.layer_types:
        if cfg.is_encoder_decoder and cfg.num_encoder_layers != cfg.num_decoder_layers:
            raise UserError(f"TransformerConfig.layer_types names each layer of both stacks, "
                            f"which needs num_encoder_layers={cfg.num_encoder_layers} equal "
                            f"to num_decoder_layers={cfg.num_decoder_layers}")
        depth = (("num_decoder_layers", cfg.num_decoder_layers) if cfg.is_encoder_decoder
                 else ("num_layers", cfg.num_layers))
        if len(cfg.layer_types) != depth[1]:
            raise UserError(f"TransformerConfig.layer_types has {len(cfg.layer_types)} "
                            f"kinds for {depth[0]}={depth[1]}")
        if "sliding" in cfg.layer_types and cfg.sliding_window is None:
            raise UserError("TransformerConfig.layer_types has 'sliding' layers but "
                            "sliding_window=None")
        if "chunked" in cfg.layer_types and cfg.attention_chunk_size is None:
            raise UserError("TransformerConfig.layer_types has 'chunked' layers but "
                            "attention_chunk_size=None")
    _check_llama4_attention(cfg)
    _check_encoder_heads(cfg)
    for name in ("rope_local_theta", "attn_logit_softcapping", "final_logit_softcapping",
                 "query_pre_attn_scalar"):
        value = getattr(cfg, name)
        if value is not None and not value > 0:
            raise UserError(f"TransformerConfig.{name}={value} must be > 0 (or None)")
    if cfg.rope_local_theta is not None and cfg.positions != "rope":
        raise UserError(f"TransformerConfig.rope_local_theta={cfg.rope_local_theta} "
                        f"needs positions='rope', not {cfg.positions!r}")
    if cfg.final_logit_softcapping is not None and cfg.architecture == "encoder_only":
        raise UserError("TransformerConfig.final_logit_softcapping caps a decoder's "
                        "logits; an encoder_only model's heads have none")
    if cfg.attention_sinks and cfg.architecture != "decoder_only":
        raise UserError("TransformerConfig.attention_sinks=True (GPT-OSS's sinks, on causal "
                        f"self-attention) needs architecture='decoder_only', not "
                        f"{cfg.architecture!r}")
    if cfg.attention_sinks and cfg.attention_impl == "cudnn":
        raise UserError("TransformerConfig.attention_sinks=True: attention_impl='cudnn' "
                        "cannot add the sinks (it returns no log-sum-exp); use 'auto', "
                        "'xla' or 'chunked'")
    for name in ("swiglu_alpha", "swiglu_limit"):
        if not getattr(cfg, name) > 0:
            raise UserError(f"TransformerConfig.{name}={getattr(cfg, name)} must be > 0")
    if cfg.sublayer_output_norm and cfg.norm_position != "pre":
        raise UserError("TransformerConfig.sublayer_output_norm=True needs "
                        f"norm_position='pre', not {cfg.norm_position!r}")
    if cfg.query_pre_attn_scalar is not None and not cfg.scale_attention:
        raise UserError(f"TransformerConfig.query_pre_attn_scalar="
                        f"{cfg.query_pre_attn_scalar} scales the attention, and needs "
                        "scale_attention=True")


def _check_encoder_heads(cfg) -> None:
    """ModernBERT's parts: the unnormed first attention, the classifier's pooling and
    head, LayerNorms without bias."""
    if not cfg.first_attention_norm and (cfg.norm_position != "pre" or cfg.scan_layers
                                         or cfg.is_encoder_decoder):
        raise UserError("TransformerConfig.first_attention_norm=False (the first layer's "
                        "attention without a norm) needs norm_position='pre', one stack and "
                        f"scan_layers=False (not {cfg.norm_position!r}, {cfg.architecture!r},"
                        f" {cfg.scan_layers}): a scan runs one layer's program for all")
    for name, default in (("classifier_pooling", "first"), ("classifier_head", "pooler"),
                          ("head_bias", True)):
        if getattr(cfg, name) != default and cfg.architecture != "encoder_only":
            raise UserError(f"TransformerConfig.{name}={getattr(cfg, name)!r} shapes an "
                            "encoder's classifier, and needs architecture='encoder_only'")
    if not cfg.norm_bias and cfg.norm != "layernorm":
        raise UserError(f"TransformerConfig.norm_bias=False takes the LayerNorm's bias away;"
                        f" norm={cfg.norm!r} has none")


def _check_llama4_attention(cfg) -> None:
    """Chunked local attention, NoPE layers, their temperature, interleaved RoPE and the
    L2 query/key norm."""
    for name in ("attention_chunk_size", "qk_l2_norm", "nope_layers"):
        if getattr(cfg, name) and cfg.architecture != "decoder_only":
            raise UserError(f"TransformerConfig.{name}={getattr(cfg, name)} needs "
                            f"architecture='decoder_only', not {cfg.architecture!r}")
    if cfg.attention_chunk_size is not None and cfg.attention_impl == "cudnn":
        raise UserError(f"TransformerConfig.attention_chunk_size={cfg.attention_chunk_size}:"
                        " attention_impl='cudnn' has no chunked mask; use 'auto', 'xla' or "
                        "'chunked'")
    for name in ("rope_interleaved", "nope_layers"):
        if getattr(cfg, name) and cfg.positions != "rope":
            raise UserError(f"TransformerConfig.{name}={getattr(cfg, name)} needs "
                            f"positions='rope', not {cfg.positions!r}")
    for name in ("nope_layers", "moe_layers"):
        beyond = [i for i in getattr(cfg, name) if i >= cfg.num_layers]
        if beyond:
            raise UserError(f"TransformerConfig.{name} names layers {beyond}, beyond "
                            f"num_layers={cfg.num_layers}")
    if cfg.attn_temperature_floor is not None and not cfg.nope_layers:
        raise UserError(f"TransformerConfig.attn_temperature_floor="
                        f"{cfg.attn_temperature_floor} tunes the nope_layers' queries, and "
                        "there are none")


def _check_latent_attention(cfg) -> None:
    """Multi-head latent attention (`kv_lora_rank`; `models.latent_attention`)."""
    fields = ("q_lora_rank", "qk_rope_head_dim", "v_head_dim")
    if cfg.kv_lora_rank is None:
        for name in fields:
            if getattr(cfg, name) is not None:
                raise UserError(f"TransformerConfig.{name}={getattr(cfg, name)} shapes latent "
                                "attention, and needs kv_lora_rank")
        return
    needs = dict(architecture="decoder_only", positions="rope", num_kv_heads=cfg.num_heads,
                 qk_norm=False, qk_l2_norm=False, attention_sinks=False,
                 attention_output_gate=False, nope_layers=(),
                 attn_logit_softcapping=None, sliding_window=None, layer_types=(),
                 attention_chunk_size=None)
    got = {name: getattr(cfg, name) for name in needs}
    if isinstance(cfg.rope_scaling, LongRopeScaling):
        needs["rope_scaling"], got["rope_scaling"] = "not LongRoPE", "LongRoPE"
    for name, value in needs.items():
        if got[name] != value:
            raise UserError(f"TransformerConfig.kv_lora_rank={cfg.kv_lora_rank} (latent "
                            f"attention) needs {name}={value!r}, not {got[name]!r}")
    if cfg.qk_rope_head_dim is None or cfg.qk_rope_head_dim % 2:
        raise UserError(f"TransformerConfig.kv_lora_rank={cfg.kv_lora_rank} needs an even "
                        f"qk_rope_head_dim (the rotated part of each query and key), not "
                        f"{cfg.qk_rope_head_dim}")
    if cfg.qk_rope_head_dim >= cfg.head_dim:
        raise UserError(f"TransformerConfig.qk_rope_head_dim={cfg.qk_rope_head_dim} must be "
                        f"below head_dim={cfg.head_dim} (the query and key width: the "
                        "unrotated part, then the rotated one)")


LINEAR_SHAPE = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                "linear_value_head_dim")


def _check_linear_attention(cfg) -> None:
    """Qwen3-Next's parts: the Gated DeltaNet ("linear") layers and gated attention."""
    if cfg.attention_output_gate and cfg.is_encoder_decoder:
        raise UserError("TransformerConfig.attention_output_gate=True gates self-attention's "
                        "output; an encoder-decoder's cross-attention has no gate")
    if cfg.shared_expert_gate and not cfg.shared_expert_mlp_dim:
        raise UserError("TransformerConfig.shared_expert_gate=True scales the shared expert, "
                        "and needs shared_expert_mlp_dim (there is no shared expert)")
    if cfg.lora is not None and (cfg.has_linear_layers or cfg.attention_output_gate):
        raise UserError("TransformerConfig.lora: adapters on a model with 'linear' layers or "
                        "attention_output_gate are not supported yet (set lora=None)")
    if not cfg.has_linear_layers:
        for name in LINEAR_SHAPE:
            if getattr(cfg, name) is not None:
                raise UserError(f"TransformerConfig.{name}={getattr(cfg, name)} shapes the "
                                "linear-attention layers, and layer_types has no 'linear' "
                                "layer")
        return
    missing = [name for name in LINEAR_SHAPE if getattr(cfg, name) is None]
    if missing:
        raise UserError(f"TransformerConfig.layer_types has 'linear' layers, which need "
                        f"{', '.join(missing)} (None)")
    if cfg.architecture != "decoder_only":
        raise UserError(f"TransformerConfig.layer_types has 'linear' layers, which need "
                        f"architecture='decoder_only', not {cfg.architecture!r}")
    keys, values = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if values % keys:
        raise UserError(f"TransformerConfig.linear_num_value_heads={values} is not a multiple "
                        f"of linear_num_key_heads={keys} (each key head serves a group of "
                        "value heads)")
    if cfg.scan_layers:
        raise UserError("TransformerConfig.scan_layers=True runs one layer's program for every "
                        "layer, but layer_types has 'linear' layers (Gated DeltaNet, other "
                        "parameters than attention's): use scan_layers=False")


def _check_moe(cfg) -> None:
    """The mixture-of-experts MLP's fields (`models.moe`)."""
    for name in ("num_experts", "router_aux_loss_coef", "router_z_loss_coef"):
        if getattr(cfg, name) < 0:
            raise UserError(f"TransformerConfig.{name}={getattr(cfg, name)} must be >= 0")
    if cfg.mlp_chunks > 1 and cfg.num_experts:
        raise UserError(f"TransformerConfig.mlp_chunks={cfg.mlp_chunks} slices the dense MLP "
                        f"over the sequence; the experts (num_experts={cfg.num_experts}) route "
                        "every token at once: use mlp_chunks=1")
    if cfg.experts_per_token < 1:
        raise UserError(f"TransformerConfig.experts_per_token={cfg.experts_per_token} must "
                        "be >= 1")
    defaults = dict(router_score="softmax", router_scales_input=False,
                    shared_expert_mlp_dim=None, shared_expert_gate=False, moe_layers=(),
                    router_groups=1, router_top_groups=1, router_score_bias=False,
                    routed_scaling=1.0)
    if not cfg.num_experts:
        for name, default in defaults.items():
            if getattr(cfg, name) != default:
                raise UserError(f"TransformerConfig.{name}={getattr(cfg, name)!r} shapes the "
                                "mixture of experts, and needs num_experts > 0")
        return
    if cfg.moe_layers and cfg.scan_layers and len(cfg.moe_layers) < cfg.num_layers:
        raise UserError(f"TransformerConfig.scan_layers=True runs one layer's program for "
                        f"every layer, but moe_layers={list(cfg.moe_layers)} mixes dense and "
                        "expert MLPs (different parameters): use scan_layers=False")
    if cfg.num_experts % cfg.router_groups:
        raise UserError(f"TransformerConfig.router_groups={cfg.router_groups} does not divide "
                        f"num_experts={cfg.num_experts}")
    if cfg.router_top_groups > cfg.router_groups:
        raise UserError(f"TransformerConfig.router_top_groups={cfg.router_top_groups} exceeds "
                        f"router_groups={cfg.router_groups}")
    if cfg.router_groups > 1 and (cfg.num_experts // cfg.router_groups < 2
                                  or cfg.router_score != "sigmoid"):
        raise UserError(f"TransformerConfig.router_groups={cfg.router_groups}: a group is "
                        "scored by its two best experts' sigmoid scores, so it needs at least "
                        f"2 experts a group (num_experts={cfg.num_experts}) and "
                        f"router_score='sigmoid' (not {cfg.router_score!r})")
    kept = cfg.router_top_groups * (cfg.num_experts // cfg.router_groups)
    if cfg.router_groups > 1 and cfg.experts_per_token > kept:
        raise UserError(f"TransformerConfig.experts_per_token={cfg.experts_per_token} exceeds "
                        f"the {kept} experts of router_top_groups={cfg.router_top_groups} "
                        f"groups of {cfg.num_experts // cfg.router_groups}")
    if cfg.router_score_bias and cfg.router_score != "sigmoid":
        raise UserError("TransformerConfig.router_score_bias=True biases the sigmoid scores' "
                        f"choice, and needs router_score='sigmoid', not {cfg.router_score!r}")
    if not cfg.routed_scaling > 0:
        raise UserError(f"TransformerConfig.routed_scaling={cfg.routed_scaling} must be > 0")
    if cfg.experts_per_token > cfg.num_experts:
        raise UserError(f"TransformerConfig.experts_per_token={cfg.experts_per_token} "
                        f"exceeds num_experts={cfg.num_experts}")
    if cfg.architecture != "decoder_only":
        raise UserError(f"TransformerConfig.num_experts={cfg.num_experts} needs "
                        f"architecture='decoder_only', not {cfg.architecture!r}")
    if cfg.activation not in ("swiglu", "clamped_swiglu"):
        raise UserError(f"TransformerConfig.num_experts={cfg.num_experts}: the experts are "
                        "gated MLPs, so activation must be 'swiglu' or 'clamped_swiglu', not "
                        f"{cfg.activation!r}")
    if cfg.lora is not None:
        sites = [("decoder", "mlp", name) for name in ("gate", "up", "down")]
        for target in cfg.lora.targets:
            if any(matches(target, site) for site in sites):
                raise UserError(f"lora target {target!r} names the MLP, whose projections "
                                f"are experts with num_experts={cfg.num_experts}; experts "
                                "take no adapters (target the attention projections)")


def label_names(value) -> tuple[str, ...]:
    """A tuple of distinct, non-empty strings (a list or tuple given), or a UserError."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise UserError(f"TransformerConfig.label_names={value!r} must be a list of strings")
    for name in value:
        if not isinstance(name, str) or not name:
            raise UserError(f"TransformerConfig.label_names has {name!r}; each name must be "
                             "a non-empty string")
    repeated = sorted({n for n in value if list(value).count(n) > 1})
    if repeated:
        raise UserError(f"TransformerConfig.label_names names {repeated} more than once")
    return tuple(value)
