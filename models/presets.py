"""The zoo's named configurations: `get_config(name, **overrides)` and `list_configs()`.

Each preset reproduces the architecture of its namesake; sizes that depend on the data
(`vocab_size`, `max_len`) are overridden by the caller or the training config.
"""

from __future__ import annotations

import math

from models.config import TransformerConfig, check_keys
from models.errors import UserError
from models.rope_scaling import YarnRopeScaling

_VASWANI = dict(
    architecture="encoder_decoder", positions="sinusoidal", norm="layernorm",
    norm_position="post", activation="relu", use_bias=True, share_embeddings=True,
    tie_embeddings=True, scale_embeddings=True, norm_eps=1e-6, vocab_size=37_000, max_len=256,
)
_GPT2 = dict(
    architecture="decoder_only", positions="learned", norm="layernorm", norm_position="pre",
    activation="gelu", use_bias=True, tie_embeddings=True, scale_embeddings=False,
    norm_eps=1e-5, vocab_size=50_257, max_len=1024,
)
_LLAMA = dict(
    architecture="decoder_only", positions="rope", norm="rmsnorm", norm_position="pre",
    activation="swiglu", use_bias=False, tie_embeddings=False, scale_embeddings=False,
    norm_eps=1e-5, rope_theta=10_000.0,
)
_GPT_OSS = dict(
    _LLAMA, vocab_size=201_088, d_model=2880, num_heads=64, num_kv_heads=8, head_dim=64,
    mlp_dim=2880, max_len=131_072, activation="clamped_swiglu", use_bias=True,
    attention_sinks=True, experts_per_token=4, sliding_window=128, rope_theta=150_000.0,
    rope_scaling=YarnRopeScaling(factor=32.0, original_max_len=4096, beta_fast=32.0,
                                 beta_slow=1.0, truncate=False),
    router_aux_loss_coef=0.9,
)
# Llama 4's text model (Meta, 2025): iRoPE (interleaved RoPE in chunked local layers of
# 8,192 positions with L2 q/k norms; every fourth layer global, without positions, its
# queries temperature-tuned), top-1 sigmoid-routed experts that read the token scaled by
# the router, and a shared expert.
_LLAMA4 = dict(
    _LLAMA, vocab_size=202_048, d_model=5120, num_heads=40, num_kv_heads=8, head_dim=128,
    mlp_dim=16_384, expert_mlp_dim=8192, shared_expert_mlp_dim=8192, num_layers=48,
    rope_theta=500_000.0, rope_interleaved=True, qk_l2_norm=True,
    layer_types=("chunked", "chunked", "chunked", "full") * 12, attention_chunk_size=8192,
    nope_layers=tuple(range(3, 48, 4)), attn_temperature_floor=8192,
    attn_temperature_scale=0.1, experts_per_token=1, router_score="sigmoid",
    router_scales_input=True, router_renormalize=False, router_aux_loss_coef=0.001,
)
# DeepSeek-V3 (DeepSeek-AI, 2024): multi-head latent attention (the cache holds a 512-wide
# latent and a 64-wide rotated key per token and layer), 3 dense layers then 58 of 256
# sigmoid-routed experts (8 of the best 4 of 8 groups, a selection bias, x2.5) and one
# shared expert; YaRN x40 of 4,096, whose mscale also scales the logits.
_DEEPSEEK_V3 = dict(
    _LLAMA, vocab_size=129_280, d_model=7168, num_heads=128, head_dim=192, mlp_dim=18_432,
    num_layers=61, max_len=163_840, norm_eps=1e-6, kv_lora_rank=512, q_lora_rank=1536,
    qk_rope_head_dim=64, v_head_dim=128, rope_interleaved=True, num_experts=256,
    experts_per_token=8, expert_mlp_dim=2048, shared_expert_mlp_dim=2048,
    moe_layers=tuple(range(3, 61)), router_score="sigmoid", router_score_bias=True,
    router_groups=8, router_top_groups=4, routed_scaling=2.5,
    rope_scaling=YarnRopeScaling(factor=40.0, original_max_len=4096, beta_fast=32.0,
                                 beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
    query_pre_attn_scalar=192 / (0.1 * math.log(40.0) + 1.0) ** 4, pad_id=None, bos_id=0,
    eos_id=1,
)
# Qwen3-Next (Qwen team, 2025): three Gated DeltaNet layers (16 key heads and 32 value
# heads of 128, a convolution of 4) to each gated attention layer (GQA 16/2, H 256, q/k
# norms, RoPE over a quarter of each head, base 10M), RMSNorms scaled by (1 + weight), and
# 512 SwiGLU experts of 512 in every layer, top 10 renormalised, plus a shared expert of
# 512 scaled by a sigmoid gate.
_QWEN3_NEXT = dict(
    _LLAMA, vocab_size=151_936, d_model=2048, num_heads=16, num_kv_heads=2, head_dim=256,
    mlp_dim=5120, num_layers=48, max_len=262_144, norm_eps=1e-6, norm_scale_offset=1.0,
    qk_norm=True, attention_output_gate=True, partial_rotary_factor=0.25,
    rope_theta=10_000_000.0, layer_types=("linear", "linear", "linear", "full") * 12,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_width=4, num_experts=512, experts_per_token=10,
    expert_mlp_dim=512, shared_expert_mlp_dim=512, shared_expert_gate=True,
    router_aux_loss_coef=0.001,
)
_T5GEMMA = dict(
    architecture="encoder_decoder", positions="rope", norm="rmsnorm", norm_position="pre",
    norm_scale_offset=1.0, activation="geglu", use_bias=False, share_embeddings=False,
    tie_embeddings=True, scale_embeddings=True, sublayer_output_norm=True, norm_eps=1e-6,
    vocab_size=256_000, d_model=2304, num_heads=8, num_kv_heads=4, head_dim=256, mlp_dim=9216,
    num_encoder_layers=26, num_decoder_layers=26, max_len=8192, sliding_window=4096,
    layer_types=("sliding", "full") * 13, attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0, query_pre_attn_scalar=256.0, pad_id=0, eos_id=1, bos_id=2,
)
# ModernBERT (Answer.AI and LightOn, 2024): a pre-norm encoder with RoPE, a global layer
# (base 160,000) every third and local ones (64 positions either side, base 10,000) between,
# GeGLU, no biases, LayerNorms without bias, the first layer's attention unnormed.
_MODERNBERT = dict(
    architecture="encoder_only", positions="rope", norm="layernorm", norm_position="pre",
    norm_bias=False, first_attention_norm=False, activation="geglu_exact", use_bias=False,
    tie_embeddings=True, embedding_norm=True, num_token_types=0, norm_eps=1e-5,
    vocab_size=50_368, max_len=8192, rope_theta=160_000.0, rope_local_theta=10_000.0,
    sliding_window=64, classifier_head="transform", head_bias=False, pad_id=50_283, eos_id=50_282,
    bos_id=50_281,
)
_BERT = dict(
    architecture="encoder_only", positions="learned", norm="layernorm", norm_position="post",
    activation="gelu_exact", use_bias=True, tie_embeddings=True, scale_embeddings=False,
    embedding_norm=True, num_token_types=2, norm_eps=1e-12, vocab_size=30_522, max_len=512,
    dropout_rate=0.1, attention_dropout_rate=0.1, pad_id=0, eos_id=None, bos_id=None,
)
# OpenAI's Whisper (Radford et al. 2022): an audio encoder (`models.audio`) and a pre-norm
# decoder with learned positions, exact GELU, a head tied to the decoder's embedding. Its
# special ids are the project's (a checkpoint's: <|endoftext|> 50257, <|startoftranscript|>
# 50258).
_WHISPER = dict(
    architecture="encoder_decoder", positions="learned", norm="layernorm", norm_position="pre",
    activation="gelu_exact", use_bias=True, share_embeddings=False, tie_embeddings=True,
    norm_eps=1e-5, vocab_size=51_865, max_len=448,
    audio=dict(num_mel_bins=80, max_source_positions=1500),
)

_M2M100 = dict(
    architecture="encoder_decoder", positions="sinusoidal", position_offset=2, norm="layernorm",
    norm_position="pre", activation="relu", use_bias=True, share_embeddings=True,
    tie_embeddings=True, scale_embeddings=True, norm_eps=1e-5, d_model=1024, num_heads=16,
    mlp_dim=4096, num_encoder_layers=12, num_decoder_layers=12, max_len=1024, pad_id=1,
    eos_id=2, bos_id=2,
)

# mBART-50 (learned positions from 2 with a norm on the embeddings, pre-norm, exact GELU)
# and PEGASUS (Marian's sinusoids, pre-norm, ReLU): BART's layers at BART-large's widths.
_MBART = dict(_M2M100, positions="learned", embedding_norm=True, activation="gelu_exact",
              logits_bias=True)
_PEGASUS = dict(_M2M100, positions="sinusoidal_paper", position_offset=0, pad_id=0, eos_id=1,
                bos_id=0, logits_bias=True)

_PRESETS: dict[str, dict] = {
    # Tiny models for tests and the CPU demo: compile in seconds.
    "transformer-tiny": dict(
        _VASWANI, vocab_size=512, d_model=64, num_heads=4, mlp_dim=256,
        num_encoder_layers=2, num_decoder_layers=2, max_len=128, norm_position="pre"),
    "gpt-tiny": dict(
        _GPT2, vocab_size=512, d_model=64, num_heads=4, mlp_dim=256, num_layers=2, max_len=128),
    "bert-tiny": dict(                   # Turc et al. 2019's BERT-Tiny (L=2, H=128)
        _BERT, d_model=128, num_heads=2, mlp_dim=512, num_layers=2),
    "llama-tiny": dict(
        _LLAMA, vocab_size=512, d_model=64, num_heads=4, num_kv_heads=2, mlp_dim=192,
        num_layers=2, max_len=128),
    # Vaswani et al. 2017, "Attention is all you need", Table 3.
    "transformer-base": dict(
        _VASWANI, d_model=512, num_heads=8, mlp_dim=2048, num_encoder_layers=6,
        num_decoder_layers=6, dropout_rate=0.1),
    "transformer-big": dict(
        _VASWANI, d_model=1024, num_heads=16, mlp_dim=4096, num_encoder_layers=6,
        num_decoder_layers=6, dropout_rate=0.3),
    # Radford et al. 2019 (GPT-2).
    "gpt2-small": dict(_GPT2, d_model=768, num_heads=12, mlp_dim=3072, num_layers=12),
    "gpt2-medium": dict(_GPT2, d_model=1024, num_heads=16, mlp_dim=4096, num_layers=24),
    # Devlin et al. 2019 (BERT-base, 110M) and Liu et al. 2019 (RoBERTa-base: positions
    # from 2, after the pad id 1; one token type; LayerNorm eps 1e-5).
    "bert-base": dict(_BERT, d_model=768, num_heads=12, mlp_dim=3072, num_layers=12),
    "roberta-base": dict(
        _BERT, vocab_size=50_265, d_model=768, num_heads=12, mlp_dim=3072, num_layers=12,
        position_offset=2, num_token_types=1, norm_eps=1e-5, pad_id=1, bos_id=0, eos_id=2),
    # Qwen3-0.6B (Qwen team, 2025): Llama-style with an RMSNorm on each head's queries and
    # keys, head_dim 128 apart from D / N, a tied head. Its special ids are the project's.
    "qwen3-0.6b": dict(
        _LLAMA, vocab_size=151_936, d_model=1024, num_heads=16, num_kv_heads=8, head_dim=128,
        mlp_dim=3072, num_layers=28, max_len=40_960, qk_norm=True, tie_embeddings=True,
        norm_eps=1e-6, rope_theta=1_000_000.0),
    # Gemma 2B (Google, 2024): multi-query attention, head_dim 256, GeGLU, RMSNorms scaled by
    # (1 + weight), embeddings times sqrt(D), a tied head.
    "gemma-2b": dict(
        _LLAMA, vocab_size=256_000, d_model=2048, num_heads=8, num_kv_heads=1, head_dim=256,
        mlp_dim=16_384, num_layers=18, max_len=8192, activation="geglu",
        norm_scale_offset=1.0, scale_embeddings=True, tie_embeddings=True, norm_eps=1e-6),
    # Phi-3-mini (Microsoft, 2024; the 4k context model): Llama-style, multi-head attention,
    # a sliding window of 2047, an untied head; its checkpoints fuse q/k/v and gate/up.
    "phi3-mini": dict(
        _LLAMA, vocab_size=32_064, d_model=3072, num_heads=32, mlp_dim=8192, num_layers=32,
        max_len=4096, sliding_window=2047, norm_eps=1e-5),
    # Gemma 2 2B (Google, 2024): Gemma's parts plus sliding-window (4096) and full layers
    # alternating, attention logits soft-capped at 50 and scaled by 256 ** -0.5, output
    # logits soft-capped at 30, norms after attention and the MLP too.
    "gemma2-2b": dict(
        _LLAMA, vocab_size=256_000, d_model=2304, num_heads=8, num_kv_heads=4, head_dim=256,
        mlp_dim=9216, num_layers=26, max_len=8192, activation="geglu",
        norm_scale_offset=1.0, scale_embeddings=True, tie_embeddings=True, norm_eps=1e-6,
        sliding_window=4096, layer_types=("sliding", "full") * 13,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sublayer_output_norm=True,
        query_pre_attn_scalar=256.0),
    # Gemma 3 1B (Google, 2025): Gemma 2's layers with q/k norms, five sliding layers (512,
    # RoPE base 10,000) to each full one (RoPE base 1,000,000), no soft-capping.
    "gemma3-1b": dict(
        _LLAMA, vocab_size=262_144, d_model=1152, num_heads=4, num_kv_heads=1, head_dim=256,
        mlp_dim=6912, num_layers=26, max_len=32_768, activation="geglu",
        norm_scale_offset=1.0, scale_embeddings=True, tie_embeddings=True, norm_eps=1e-6,
        qk_norm=True, sliding_window=512,
        layer_types=tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(26)),
        rope_theta=1_000_000.0, rope_local_theta=10_000.0, sublayer_output_norm=True,
        query_pre_attn_scalar=256.0),
    # Mixtral 8x7B (Mistral AI, 2023): Mistral's attention (no window) with 8 SwiGLU experts
    # per layer, each token routed to 2 (softmax, top 2, renormalised); 46.7B parameters,
    # 12.9B active per token.
    "mixtral-8x7b": dict(
        _LLAMA, vocab_size=32_000, d_model=4096, num_heads=32, num_kv_heads=8, mlp_dim=14_336,
        num_layers=32, max_len=32_768, rope_theta=1_000_000.0, num_experts=8,
        experts_per_token=2, router_aux_loss_coef=0.02),
    # Qwen3-30B-A3B (Qwen team, 2025): Qwen3's attention (q/k norms, head_dim 128) with 128
    # experts of width 768 per layer, 8 per token (top 8 renormalised); 3.3B active.
    "qwen3-30b-a3b": dict(
        _LLAMA, vocab_size=151_936, d_model=2048, num_heads=32, num_kv_heads=4, head_dim=128,
        mlp_dim=6144, expert_mlp_dim=768, num_layers=48, max_len=40_960, qk_norm=True,
        norm_eps=1e-6, rope_theta=1_000_000.0, num_experts=128, experts_per_token=8,
        router_aux_loss_coef=0.001),
    # A tiny mixture of experts for tests and the CPU demo: 4 experts, top 2.
    "mixtral-tiny": dict(
        _LLAMA, vocab_size=512, d_model=64, num_heads=4, num_kv_heads=2, mlp_dim=128,
        num_layers=2, max_len=128, num_experts=4, experts_per_token=2,
        router_aux_loss_coef=0.01),
    # gpt-oss-20b and gpt-oss-120b (OpenAI, 2025): grouped-query attention with biases and a
    # learned sink per head, sliding (128) and full layers alternating, YaRN RoPE (x32 of
    # 4,096), and 32 or 128 biased clamped-SwiGLU experts per layer, 4 per token;
    # 20.9B and 116.8B parameters.
    "gpt-oss-20b": dict(_GPT_OSS, num_layers=24, num_experts=32,
                        layer_types=tuple(("sliding", "full") * 12)),
    "gpt-oss-120b": dict(_GPT_OSS, num_layers=36, num_experts=128,
                         layer_types=tuple(("sliding", "full") * 18)),
    # A tiny GPT-OSS for tests and the CPU demo: 4 experts, top 2, a window of 8.
    "gpt-oss-tiny": dict(
        _GPT_OSS, vocab_size=512, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16,
        mlp_dim=96, num_layers=2, max_len=128, num_experts=4, experts_per_token=2,
        sliding_window=8, layer_types=("sliding", "full"), rope_scaling=None,
        router_aux_loss_coef=0.01),
    # Llama 4 Scout 17B-16E and Maverick 17B-128E (Meta, 2025), their text models: 16
    # experts in every layer (Llama 3 RoPE scaling x16 of 8,192), or 128 experts in every
    # other layer (dense layers between, no q/k norm, no scaling); 17B active each.
    "llama4-scout": dict(
        _LLAMA4, num_experts=16, max_len=10_485_760,
        rope_scaling=dict(factor=16.0, low_freq_factor=1.0, high_freq_factor=1.0,
                          original_max_len=8192)),
    "llama4-maverick": dict(_LLAMA4, num_experts=128, moe_layers=tuple(range(1, 48, 2)),
                            qk_l2_norm=False, max_len=1_048_576),
    # A tiny Llama 4 for tests and the CPU demo: chunks of 4, a global layer last, 4 experts.
    "llama4-tiny": dict(
        _LLAMA4, vocab_size=512, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16,
        mlp_dim=128, expert_mlp_dim=64, shared_expert_mlp_dim=64, num_layers=4, max_len=128,
        layer_types=("chunked", "chunked", "chunked", "full"), attention_chunk_size=4,
        nope_layers=(3,), attn_temperature_floor=4, num_experts=4, experts_per_token=1,
        router_aux_loss_coef=0.01),
    # Qwen3-Next-80B-A3B (its Instruct and Thinking models alike): 79.7B parameters
    # (the multi-token-prediction layer aside), 3B active. Teacher-forced only: decoding
    # is refused until the cache holds the linear layers' state.
    "qwen3-next-80b-a3b": dict(_QWEN3_NEXT),
    # A tiny Qwen3-Next for tests: three linear layers and a gated attention layer, 4
    # experts, top 2, and the gated shared expert.
    "qwen3-next-tiny": dict(
        _QWEN3_NEXT, vocab_size=512, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16,
        mlp_dim=128, num_layers=4, max_len=128, layer_types=("linear", "linear", "linear",
                                                              "full"),
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=4, experts_per_token=2, expert_mlp_dim=64,
        shared_expert_mlp_dim=64, router_aux_loss_coef=0.01),
    # DeepSeek-V3 (and R1, the same architecture): 671B parameters, 37B active.
    "deepseek-v3": dict(_DEEPSEEK_V3),
    # A tiny DeepSeek-V3 for tests and the CPU demo: a dense layer then two of 8 experts in
    # 4 groups (2 of the best 2 groups), a 16-wide latent, low-rank queries.
    "deepseek-v3-tiny": dict(
        _DEEPSEEK_V3, vocab_size=512, d_model=64, num_heads=4, head_dim=24, mlp_dim=128,
        num_layers=3, max_len=128, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
        v_head_dim=16, num_experts=8, experts_per_token=2, expert_mlp_dim=32,
        shared_expert_mlp_dim=32, moe_layers=(1, 2), router_groups=4, router_top_groups=2,
        rope_scaling=None, query_pre_attn_scalar=None, pad_id=0, eos_id=1, bos_id=2),
    # M2M-100 418M (Fan et al. 2020, 100 languages) and NLLB-200 distilled 600M (NLLB team
    # 2022, 200 languages): pre-norm encoder-decoders with fairseq's sinusoids from position
    # 2, one shared table; 483.9M and 615.1M parameters with their vocabularies.
    "m2m100-418m": dict(_M2M100, vocab_size=128_112),
    "nllb-200-600m": dict(_M2M100, vocab_size=256_206),
    # facebook/mbart-large-50 (and its many-to-many translator; 2020, 50 languages) and
    # google/pegasus-large (2020, summarisation): 611.1M and 568.8M parameters (their logits
    # biases included; PEGASUS's position tables are functions, not parameters).
    "mbart-large-50": dict(_MBART, vocab_size=250_054),
    "pegasus-large": dict(_PEGASUS, vocab_size=96_103, num_encoder_layers=16,
                          num_decoder_layers=16),
    # T5Gemma 2B-2B (Google, 2025): gemma-2-2b's layers in both stacks (the encoder's
    # bidirectional, its sliding layers a window of 4,096 on either side), a token table per
    # stack, the head tied to the decoder's; 5,596,853,760 parameters.
    "t5gemma-2b-2b": dict(_T5GEMMA),
    # A tiny T5Gemma for tests and the CPU demo: a sliding (8) and a full layer per stack.
    "t5gemma-tiny": dict(
        _T5GEMMA, vocab_size=512, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16,
        mlp_dim=128, num_encoder_layers=2, num_decoder_layers=2, max_len=128,
        sliding_window=8, layer_types=("sliding", "full"), query_pre_attn_scalar=16.0),
    # ModernBERT-base (149.7M) and -large (395.8M), their masked-LM models.
    "modernbert-base": dict(
        _MODERNBERT, d_model=768, num_heads=12, mlp_dim=1152, num_layers=22,
        layer_types=tuple("full" if i % 3 == 0 else "sliding" for i in range(22))),
    "modernbert-large": dict(
        _MODERNBERT, d_model=1024, num_heads=16, mlp_dim=2624, num_layers=28,
        layer_types=tuple("full" if i % 3 == 0 else "sliding" for i in range(28))),
    # Whisper tiny (39M) and large-v3 (1.55B: 128 mel bins, one more vocabulary entry).
    "whisper-tiny": dict(
        _WHISPER, d_model=384, num_heads=6, mlp_dim=1536, num_encoder_layers=4,
        num_decoder_layers=4),
    "whisper-large-v3": dict(
        _WHISPER, vocab_size=51_866, d_model=1280, num_heads=20, mlp_dim=5120,
        num_encoder_layers=32, num_decoder_layers=32,
        audio=dict(num_mel_bins=128, max_source_positions=1500)),
    # A small Llama-style model: RMSNorm, RoPE, SwiGLU, grouped-query attention, no biases.
    "llama-small": dict(
        _LLAMA, vocab_size=32_000, d_model=768, num_heads=12, num_kv_heads=4, mlp_dim=2048,
        num_layers=12, max_len=2048),
}


def list_configs() -> list[str]:
    """The preset names `get_config` accepts."""
    return sorted(_PRESETS)


def get_config(name: str, **overrides) -> TransformerConfig:
    """A preset with `overrides` applied, validated.

    Raises:
        UserError: `name` is not a preset (the message lists them) or an override key is
            not a config field (the message names it).
    """
    if name not in _PRESETS:
        raise UserError(f"unknown config {name!r}; known configs: {list_configs()}")
    check_keys(overrides)
    return TransformerConfig(**{**_PRESETS[name], **overrides})
