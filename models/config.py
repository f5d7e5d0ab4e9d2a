"""`TransformerConfig`: every architectural choice in one frozen, hashable dataclass.

The model sees only this object; experiments and the command line build it (from a preset
plus overrides) and vary it with `.replace(...)`. Construction checks every field's type and
value and raises `UserError` naming the field, the value and the rule it breaks.

One rule for derived sizes: `num_kv_heads=None` means N and `head_dim=None` means D // N,
resolved when the config is made. The stored values are then plain ints, and `replace`
keeps them like any other field; pass None again to derive them from the new sizes:

    cfg = TransformerConfig(d_model=64, num_heads=4)       # head_dim 16, num_kv_heads 4
    cfg.replace(d_model=128).head_dim                      # 16: fields are independent
    cfg.replace(d_model=128, head_dim=None).head_dim       # 32
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import types
import typing
from typing import Any, Literal

import jax.numpy as jnp
import numpy as np

from models.audio import AudioInput
from models.config_checks import label_names as _label_names, validate
from models.errors import UserError, check_positive_int, is_int
from models.lora import LoraConfig
from models.rope_scaling import (
    DynamicRopeScaling,
    LinearRopeScaling,
    LongRopeScaling,
    YarnRopeScaling,
    scaling_from_dict,
    scaling_to_dict,
)

Architecture = Literal["decoder_only", "encoder_decoder", "encoder_only"]
PositionKind = Literal["sinusoidal", "sinusoidal_paper", "learned", "rope", "relative"]
NormKind = Literal["layernorm", "rmsnorm"]
NormPosition = Literal["pre", "post"]
Activation = Literal["relu", "gelu", "gelu_exact", "silu", "swiglu", "geglu", "geglu_exact",
                     "clamped_swiglu"]
ClassifierPooling = Literal["first", "mean"]
ClassifierHead = Literal["pooler", "transform"]
AttentionImpl = Literal["auto", "xla", "chunked", "cudnn"]
RematPolicy = Literal["full", "dots", "names"]
MoeDispatch = Literal["ragged", "dense"]
RouterScore = Literal["softmax", "sigmoid"]


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's RoPE scaling: low frequencies (wavelength above
    `original_max_len / low_freq_factor`) are divided by `factor`, high ones (wavelength
    below `original_max_len / high_freq_factor`) are kept, and the band between is
    interpolated smoothly. Given to the config as this object or as a dict."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            name = f"rope_scaling.{field.name}"
            value = (check_positive_int(value, name) if field.type in (int, "int")
                     else _typed(name, value, float))
            if value <= 0:
                raise UserError(f"TransformerConfig.{name}={value} must be > 0")
            object.__setattr__(self, field.name, value)
        if not self.high_freq_factor >= self.low_freq_factor:   # equal: no band between
            raise UserError(
                f"TransformerConfig.rope_scaling: high_freq_factor={self.high_freq_factor} "
                f"must be at least low_freq_factor={self.low_freq_factor}")

RopeScaling = (Llama3RopeScaling | LinearRopeScaling | DynamicRopeScaling | YarnRopeScaling
               | LongRopeScaling)

_POSITIVE = ("vocab_size", "d_model", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
             "max_len", "num_layers", "num_encoder_layers", "num_decoder_layers",
             "sliding_window", "relative_buckets", "relative_max_distance", "attention_block",
             "expert_mlp_dim", "attention_chunk_size", "shared_expert_mlp_dim",
             "attn_temperature_floor", "router_groups", "router_top_groups", "kv_lora_rank",
             "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "mlp_chunks",
             "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
             "linear_value_head_dim", "linear_conv_width", "linear_chunk_size")
_LAYER_INDICES = ("nope_layers", "moe_layers")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Architecture of a decoder-only, encoder-decoder or encoder-only transformer.

    Attributes:
        architecture: "decoder_only" (GPT/Llama), "encoder_decoder" (Vaswani/T5/BART) or
            "encoder_only" (BERT/RoBERTa).
        vocab_size: V, shared by source and target.
        d_model: D, the residual width.
        num_heads: N, query heads.
        num_kv_heads: K, key/value heads; N for multi-head, 1 for multi-query, in between for
            grouped-query attention. None means N.
        head_dim: H; None means D // N.
        mlp_dim: F, the MLP hidden width.
        num_layers: L of a decoder-only or encoder-only stack.
        num_encoder_layers, num_decoder_layers: L of each encoder-decoder stack.
        max_len: the longest sequence (positions 0 .. max_len - 1) and the largest cache.
        positions: how a token's position enters the model.
            "sinusoidal": fixed, added to the embeddings; sines in the first half of the
                channels and cosines in the second, frequencies 10000 ** (-i / (D/2 - 1))
                (tensor2tensor's spacing).
            "sinusoidal_paper": the same halves with the paper's frequencies
                10000 ** (-2i / D) (Marian).
            "learned": a table of max_len + position_offset rows added to the embeddings.
            "rope": rotary, applied to queries and keys of self-attention.
            "relative": T5's bucketed relative position bias, added to the self-attention
                logits; one [relative_buckets, N] table per stack, shared by its layers.
        position_offset: learned positions: position p reads row p + offset (BART keeps
            2 unused rows in front); "sinusoidal": position p is computed at p + offset
            (M2M-100 counts from pad_id + 1).
        relative_buckets, relative_max_distance: "relative" positions only: the number of
            buckets (half for each direction in an encoder) and the distance at which the
            logarithmically growing buckets stop.
        rope_theta: the rotary base frequency.
        rope_scaling: None, or a scaling of the rotary frequencies: `Llama3RopeScaling`,
            or one of `models.rope_scaling` (linear, dynamic NTK, YaRN, LongRoPE); a dict
            names its class under "kind" (none: Llama 3's).
        partial_rotary_factor: the fraction of each head's H channels that RoPE rotates
            (the first int(H * f), an even number; the rest pass unchanged): 1.0 rotates all.
        rope_local_theta: None, or the rotary base of the "sliding" layers of `layer_types`
            (unscaled), beside `rope_theta` and `rope_scaling` in the "full" ones (Gemma 3).
        rope_interleaved: RoPE rotates adjacent channel pairs (2i, 2i + 1), as complex
            numbers (Meta's Llama 4 layout), instead of channels i and h + i (rotate-half).
        nope_layers: the indices of layers without rotary positions (NoPE: their queries
            and keys carry no position; Llama 4's global layers); () rotates in every layer.
        attn_temperature_floor, attn_temperature_scale: None, or Llama 4's attention
            temperature tuning in the `nope_layers`: their queries are multiplied by
            1 + scale * log(1 + floor((position + 1) / floor)).
        norm: "layernorm" or "rmsnorm"; norm_position: "pre" (x + f(norm(x)), with a final
            norm after the stack) or "post" (norm(x + f(x)), as in Vaswani et al.).
        norm_eps: epsilon of every norm.
        norm_bias: LayerNorms have a bias (False: ModernBERT's).
        first_attention_norm: False: the first layer's attention reads its input unnormed
            (pre-norm; ModernBERT, whose embedding norm precedes it); not with scan_layers.
        norm_scale_offset: RMSNorm only: the norm multiplies by (offset + scale), so a
            stored scale of 0 is the identity when the offset is 1 (Gemma's 1 + weight);
            with an offset the normalised value and the product are computed in float32,
            then cast to `dtype`. 0.0: the plain scale.
        activation: "relu", "gelu" (tanh approximation, as GPT-2), "gelu_exact" (erf),
            "silu" (swish), or gated: "swiglu" (silu(x W_gate) * x W_up), "geglu" (the
            same with tanh GELU, T5 v1.1), "geglu_exact" (with erf GELU, ModernBERT) and
            "clamped_swiglu" (GPT-OSS: the gate clamped
            above and the up projection on both sides at `swiglu_limit`, then
            g * sigmoid(swiglu_alpha * g) * (u + 1)).
        swiglu_alpha, swiglu_limit: "clamped_swiglu"'s sigmoid gain and clamp.
        mlp_dropout_rate: dropout on the MLP's hidden activations (training only).
        num_experts, experts_per_token, expert_mlp_dim, router_renormalize,
            router_score, router_scales_input, shared_expert_mlp_dim, shared_expert_gate,
            moe_layers, router_aux_loss_coef, router_z_loss_coef, moe_dispatch: the
            mixture-of-experts MLP in place of the dense one (0 experts: dense); see
            `models.moe`.
        use_bias: biases in the attention and MLP projections (with experts: on the
            router's logits and on each expert's projections, as GPT-OSS).
        qkv_bias: biases in the query/key/value projections even without `use_bias`
            (Qwen2).
        qk_norm: a norm (the config's `norm`, `norm_eps`) over each head's H channels of the
            self-attention queries and keys, before rotary positions, with a scale [H] of
            its own for each (Qwen3). Not with cross-attention (an encoder-decoder).
        qk_l2_norm: Llama 4's norm of the queries and keys: x / sqrt(mean(x^2) + norm_eps)
            over each head's H channels, without a scale, after rotary positions, in the
            layers that rotate (not the `nope_layers`).
        sliding_window: None, or W: a query sees only the W most recent positions, itself
            included (key position > query position - W), in the forward pass, prefill and
            every cached step alike (Mistral). The cache stays `max_len` slots.
        layer_types: () for one kind of layer throughout (windowed when `sliding_window`
            is set, chunked when `attention_chunk_size` is), or one kind per decoder-only
            layer: "full" (every earlier key), "sliding" (the `sliding_window` most recent)
            or "chunked" (the keys of the query's chunk), or "linear" (no attention: a
            Gated DeltaNet layer, `models.gated_deltanet`; decoder-only, looped; its
            state in the cache's `linear`). An encoder-decoder's stacks
            (of one depth) share the kinds, an encoder's sliding layers seeing the keys
            within `sliding_window` positions on either side (T5Gemma). Under
            `scan_layers` each layer's kind is a scanned input, not a branch. Gemma 2
            alternates sliding and full; Gemma 3 has five sliding layers to each full
            one; Llama 4 three chunked to a full one.
        linear_num_key_heads, linear_num_value_heads, linear_key_head_dim,
            linear_value_head_dim: the "linear" layers' (Gated DeltaNet's,
            `models.gated_deltanet`) K' query/key heads of width H' and N' value heads of
            width E' (N' a multiple of K'); None without linear layers, required with them.
        linear_conv_width: the width W of the linear layers' causal depthwise convolution
            over their queries, keys and values.
        linear_chunk_size: the tokens the linear layers' delta rule solves together
            (`models.delta_rule.chunked`): how it runs, not what it computes (float32
            rounding aside); a loaded model may take it.
        attention_output_gate: self-attention's query projection is twice as wide: each
            head's second H channels are a gate, and the attention output is multiplied by
            sigmoid(gate) before the output projection (Qwen3-Next's gated attention).
        attention_chunk_size: None, or C: chunked local attention: a query at position p
            sees only the keys of its chunk, positions C * floor(p / C) .. p (Llama 4's
            `attention_chunk_size`), in the forward pass, prefill and every cached step.
        attention_sinks: a learned logit per query head (`sinks` [N], GPT-OSS) that joins
            each query's softmax over its keys with a value of zero, so a query may give
            its keys less than all of their weight: out * sigmoid(lse - sink), where lse
            is the log-sum-exp of the query's visible logits. Self-attention only; in
            every implementation but "cudnn", in the forward pass and each cached step.
        attn_logit_softcapping: None, or c: attention logits (after their scale, before any
            bias and the mask) become c * tanh(logits / c) (Gemma 2), in every attention
            implementation ("cudnn" refuses it).
        final_logit_softcapping: None, or c: the output logits become c * tanh(logits / c).
        sublayer_output_norm: a norm (of the config's kind) on the output of every
            sublayer before the residual add, x + norm_out(f(norm(x))), pre-norm only
            (Gemma 2 and 3's post-attention and post-feedforward norms).
        query_pre_attn_scalar: None, or s: attention logits are scaled by s ** -0.5
            instead of H ** -0.5 (Gemma 2 and 3); only with `scale_attention`.
        num_token_types: encoder-only: rows of the token-type (segment A/B) embedding added
            to the input; 0 for none.
        num_labels: encoder-only: 0 gives the masked-LM head, C > 0 a classifier of C
            labels instead (see `models.encoder_only`).
        label_names: a classifier's C label names, class i first (empty: unnamed, shown
            as LABEL_i); they travel with the model (config.json's id2label).
        classifier_pooling: what a classifier reads: "first" (the [CLS] token's state) or
            "mean" (the mean of its example's real tokens' states; ModernBERT's option).
        classifier_head: "pooler" (BERT's dense + tanh, then the output layer) or
            "transform" (ModernBERT's dense, the activation and the norm, then the output
            layer).
        head_bias: the encoder heads' transform dense layer has a bias (ModernBERT's
            `classifier_bias`; BERT's always has one).
        share_embeddings: encoder-decoder only: source and target use one embedding table.
        tie_embeddings: the output projection is the transposed target embedding.
        scale_embeddings: multiply embeddings by sqrt(D) (Vaswani et al.); their initial
            scale is then D ** -0.5 so the scaled input has unit variance.
        embedding_norm: a norm (of the config's kind) on the embeddings plus positions,
            before dropout (BART, BERT).
        scale_attention: divide the attention logits by sqrt(H); False for T5, which folds
            that scale into its initialisation.
        scale_head_input: multiply the last hidden state by D ** -0.5 before the output
            projection (T5 with a tied head).
        logits_bias: a learned bias [V] added to the logits (BART and Marian's
            final_logits_bias).
        dropout_rate: on embeddings and on every sublayer output before the residual add.
        attention_dropout_rate: on the attention probabilities.
        dtype: the compute dtype; param_dtype: the parameters' dtype. Given as names or
            dtypes, stored as `jnp.dtype`s (pass them straight to Flax).
        scan_layers: run the layers with `nn.scan` (parameters stacked over layers).
        remat: rematerialise each layer in the backward pass (`nn.remat`).
        remat_policy: with `remat`, what a layer keeps from its forward pass for the
            backward: "full" (nothing but its input: the whole layer runs again), "dots"
            (every matmul output without batch dimensions: the projections and the MLP;
            attention and elementwise work run again), "names" (the points named
            "attention_out" and "mlp_in": the attention output and the MLP's input).
        attention_impl: how attention is computed (`models.kernels`): "xla" (the
            materialised [B, N, T, S] core; the only one that returns probabilities),
            "chunked" (exact, blockwise, no T x S array in either pass, any backend),
            "cudnn" (cuDNN's fused kernel on a GPU, where the mask allows it), "auto" (the
            fastest exact choice per call). Like `dtype`, a loaded model may take it.
        attention_block: the query and key block size of "chunked" attention (a sequence
            shorter than one block is one block).
        audio: None (the encoder reads tokens), or the encoder-decoder's audio input
            (`models.audio.AudioInput`, or a dict of its fields; see `models.audio`).
        lora: None, or the low-rank adapters the model carries beside its weights
            (`models.lora.LoraConfig`; given as that object or as a dict of its fields).
        pad_id, eos_id, bos_id: special token ids, any values in [0, V), equal ones allowed
            (GPT-2 ends and starts with 50256 and has no pad: pad_id None). bos is the first
            decoder input (the encoder-decoder's start token; required there and for
            training); eos ends a sequence (None: a model that names no end token); pad
            fills outputs after their end (0 when None). Nothing masks by comparing tokens
            with pad_id: masks come from lengths and segment ids.
    """

    architecture: Architecture = "decoder_only"
    vocab_size: int = 256
    d_model: int = 64
    num_heads: int = 4
    num_kv_heads: int | None = None
    head_dim: int | None = None
    mlp_dim: int = 256
    num_layers: int = 2
    num_encoder_layers: int = 2
    num_decoder_layers: int = 2
    max_len: int = 256
    positions: PositionKind = "sinusoidal"
    position_offset: int = 0
    relative_buckets: int = 32
    relative_max_distance: int = 128
    rope_theta: float = 10_000.0
    rope_scaling: RopeScaling | None = None
    partial_rotary_factor: float = 1.0
    rope_local_theta: float | None = None
    rope_interleaved: bool = False
    nope_layers: tuple[int, ...] = ()
    attn_temperature_floor: int | None = None
    attn_temperature_scale: float = 0.1
    norm: NormKind = "layernorm"
    norm_position: NormPosition = "pre"
    norm_eps: float = 1e-6
    norm_bias: bool = True
    first_attention_norm: bool = True
    norm_scale_offset: float = 0.0
    activation: Activation = "relu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    mlp_dropout_rate: float = 0.0
    mlp_chunks: int = 1
    num_experts: int = 0
    experts_per_token: int = 2
    expert_mlp_dim: int | None = None
    router_renormalize: bool = True
    router_score: RouterScore = "softmax"
    router_scales_input: bool = False
    shared_expert_mlp_dim: int | None = None
    shared_expert_gate: bool = False
    moe_layers: tuple[int, ...] = ()
    router_groups: int = 1
    router_top_groups: int = 1
    router_score_bias: bool = False
    routed_scaling: float = 1.0
    router_aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0
    moe_dispatch: MoeDispatch = "ragged"
    use_bias: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    qk_l2_norm: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int | None = None
    linear_num_value_heads: int | None = None
    linear_key_head_dim: int | None = None
    linear_value_head_dim: int | None = None
    linear_conv_width: int = 4
    linear_chunk_size: int = 64
    attention_output_gate: bool = False
    attention_chunk_size: int | None = None
    attention_sinks: bool = False
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    sublayer_output_norm: bool = False
    query_pre_attn_scalar: float | None = None
    num_token_types: int = 0
    num_labels: int = 0
    label_names: tuple[str, ...] = ()
    classifier_pooling: ClassifierPooling = "first"
    classifier_head: ClassifierHead = "pooler"
    head_bias: bool = True
    share_embeddings: bool = True
    tie_embeddings: bool = True
    scale_embeddings: bool = False
    embedding_norm: bool = False
    scale_attention: bool = True
    scale_head_input: bool = False
    logits_bias: bool = False
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    dtype: Any = "float32"
    param_dtype: Any = "float32"
    scan_layers: bool = False
    remat: bool = False
    remat_policy: RematPolicy = "full"
    attention_impl: AttentionImpl = "auto"
    attention_block: int = 512
    lora: LoraConfig | None = None
    audio: AudioInput | None = None
    pad_id: int | None = 0
    eos_id: int | None = 1
    bos_id: int | None = 2

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in ("dtype", "param_dtype"):
                value = _float_dtype(field.name, value)
            elif field.name == "rope_scaling":
                value = _rope_scaling(value)
            elif field.name == "lora" and isinstance(value, dict):
                value = LoraConfig.from_dict(value)
            elif field.name == "audio":
                value = AudioInput.of(value)
            elif field.name in _POSITIVE and value is not None:
                value = check_positive_int(value, f"TransformerConfig.{field.name}")
            elif field.name == "label_names":
                value = _label_names(value)
            elif field.name == "layer_types":
                value = _layer_types(value)
            elif field.name in _LAYER_INDICES:
                value = _layer_indices(field.name, value)
            else:
                value = _typed(field.name, value, _field_types()[field.name])
            object.__setattr__(self, field.name, value)
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.head_dim is None:
            if self.d_model % self.num_heads:
                raise UserError(
                    f"TransformerConfig.d_model={self.d_model} is not divisible by "
                    f"num_heads={self.num_heads} (set head_dim to decouple them)")
            object.__setattr__(self, "head_dim", self.d_model // self.num_heads)
        validate(self)

    def layer_is_sliding(self) -> tuple[bool, ...]:
        """Whether each layer of the decoder-only stack slides (`layer_types`, or one kind
        for every layer from `sliding_window`)."""
        if self.layer_types:
            return tuple(kind == "sliding" for kind in self.layer_types)
        return (self.sliding_window is not None,) * self.num_layers

    def layer_kinds(self) -> tuple[LayerKind, ...] | None:
        """Each layer's `LayerKind` (of every stack: `layer_types` has one kind per layer of
        each), or None when every layer is alike (no `layer_types`, no `nope_layers`): the
        stack then passes no kind at all."""
        if not self.layer_types and not self.nope_layers:
            return None
        if self.layer_types:
            return tuple(LayerKind(sliding=kind == "sliding", chunked=kind == "chunked",
                                   rope=i not in self.nope_layers)
                         for i, kind in enumerate(self.layer_types))
        return tuple(LayerKind(sliding=self.sliding_window is not None,
                               chunked=self.attention_chunk_size is not None,
                               rope=i not in self.nope_layers)
                     for i in range(self.num_layers))

    def layer_has_experts(self, layer: int) -> bool:
        """Whether decoder-only layer `layer` has the mixture of experts (`num_experts`,
        in every layer or in the `moe_layers`) rather than the dense MLP."""
        return bool(self.num_experts) and (not self.moe_layers or layer in self.moe_layers)

    @property
    def has_linear_layers(self) -> bool:
        """Whether any layer is a Gated DeltaNet ("linear" in `layer_types`)."""
        return "linear" in self.layer_types

    # Derived quantities, so no caller recomputes them.
    @property
    def rope_dim(self) -> int:
        """The channels of each head that RoPE rotates (the first ones; with latent
        attention, the `qk_rope_head_dim` after the unrotated ones)."""
        if self.kv_lora_rank is not None:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def latent(self) -> bool:
        """Multi-head latent attention (DeepSeek-V3, `models.latent_attention`)."""
        return self.kv_lora_rank is not None

    @property
    def value_dim(self) -> int:
        """Each head's value width: `v_head_dim`, or `head_dim` when it is None."""
        return self.v_head_dim or self.head_dim

    @property
    def cache_shape(self) -> tuple[int, int, int]:
        """(heads, key width, value width) of one cached token per layer: the kv heads'
        keys and values, or with latent attention one head whose "key" is the compressed
        latent and the rotated key (`kv_lora_rank + qk_rope_head_dim`) and whose values
        are the latent's first `kv_lora_rank` numbers, read from the key (none stored)."""
        if self.latent:
            return 1, self.kv_lora_rank + self.qk_rope_head_dim, 0
        return self.num_kv_heads, self.head_dim, self.head_dim

    @property
    def expert_width(self) -> int:
        """Each expert's hidden width: `expert_mlp_dim`, or `mlp_dim` when it is None."""
        return self.expert_mlp_dim or self.mlp_dim

    @property
    def is_encoder_decoder(self) -> bool:
        return self.architecture == "encoder_decoder"

    @property
    def decoder_layers(self) -> int:
        """L of the stack that owns the KV cache."""
        return self.num_decoder_layers if self.is_encoder_decoder else self.num_layers

    def to_dict(self) -> dict:
        """Every field as JSON-ready values (dtype names; rope_scaling as a dict)."""
        out = dataclasses.asdict(self)
        out["dtype"], out["param_dtype"] = self.dtype.name, self.param_dtype.name
        if self.lora is not None:
            out["lora"] = self.lora.to_dict()
        if self.rope_scaling is not None:
            out["rope_scaling"] = scaling_to_dict(self.rope_scaling)
        return out

    @classmethod
    def from_dict(cls, fields: dict) -> TransformerConfig:
        """The inverse of `to_dict`; unknown keys are named."""
        check_keys(fields)
        return cls(**fields)

    def replace(self, **changes) -> TransformerConfig:
        """A copy with `changes` applied and checked; unknown keys name themselves.

        Every other field keeps its value, `head_dim` and `num_kv_heads` included; give
        them as None to derive them from the changed sizes (see the module docstring).
        """
        check_keys(changes)
        return dataclasses.replace(self, **changes)


def check_keys(changes: dict) -> None:
    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise UserError(
            f"unknown TransformerConfig field(s) {unknown}; known fields: {sorted(known)}")


@functools.cache
def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(TransformerConfig)


def _typed(name: str, value, tp):
    """`value` as the field's type (numpy scalars become Python ones), or a UserError.

    int fields take integral numbers (not bools), float fields any real number, bool fields
    only bools, `Literal` fields one of their values, `X | None` fields None or an X.
    """
    args = typing.get_args(tp)
    if isinstance(tp, types.UnionType):
        if value is None:
            return None
        (tp,) = [a for a in args if a is not type(None)]
        return _typed(name, value, tp)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        raise UserError(f"TransformerConfig.{name}={value!r} must be a {tp.__name__} or a "
                         "dict of its fields")
    if typing.get_origin(tp) is Literal:
        if isinstance(value, str) and value in args:
            return value
        raise UserError(f"TransformerConfig.{name}={value!r} is not one of {args}")
    if tp is bool and isinstance(value, (bool, np.bool_)):
        return bool(value)
    if tp is int and is_int(value):
        return int(value)
    if tp is float and isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)):
        return float(value)
    raise UserError(f"TransformerConfig.{name}={value!r} must be {tp.__name__}, "
                     f"not {type(value).__name__}")


def _rope_scaling(value):
    """None, one of the scaling classes, or one from its dict (`scaling_from_dict`)."""
    if value is None or isinstance(value, typing.get_args(RopeScaling)):
        return value
    if isinstance(value, dict):
        return scaling_from_dict(value, Llama3RopeScaling)
    raise UserError(f"TransformerConfig.rope_scaling={value!r} must be a RoPE scaling or a "
                     "dict of its fields")


LAYER_TYPES = ("full", "sliding", "chunked", "linear")


class LayerKind(typing.NamedTuple):
    """One self-attention layer's kind (`TransformerConfig.layer_kinds`): Python bools in a
    looped stack, traced bool scalars (one element of each [L] array) in a scanned one."""

    sliding: Any      # the sliding window applies
    chunked: Any      # the chunk rule applies (attention_chunk_size)
    rope: Any         # rotary positions (False: a NoPE layer)


def _layer_indices(name: str, value) -> tuple[int, ...]:
    """Distinct layer indices, ascending (a list or tuple given), or a UserError; whether
    each is below the number of layers is checked with the config (`config_checks`)."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise UserError(f"TransformerConfig.{name}={value!r} must be a list of layer indices")
    for i in value:
        if not is_int(i) or i < 0:
            raise UserError(f"TransformerConfig.{name} has {i!r}; each must be an int >= 0")
    if len(set(value)) != len(value):
        raise UserError(f"TransformerConfig.{name}={list(value)} names a layer twice")
    return tuple(sorted(int(i) for i in value))


def _layer_types(value) -> tuple[str, ...]:
    """A tuple of `LAYER_TYPES` (a list or tuple given), or a UserError."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise UserError(f"TransformerConfig.layer_types={value!r} must be a list of "
                        f"{LAYER_TYPES}")
    for kind in value:
        if kind not in LAYER_TYPES:
            raise UserError(f"TransformerConfig.layer_types has {kind!r}; each kind must be "
                            f"one of {LAYER_TYPES}")
    return tuple(value)


def _float_dtype(name: str, value) -> jnp.dtype:
    try:
        dtype = jnp.dtype(value)
    except TypeError as e:
        raise UserError(f"TransformerConfig.{name}={value!r} is not a dtype") from e
    if not jnp.issubdtype(dtype, jnp.floating):
        raise UserError(f"TransformerConfig.{name}={value!r} must be a floating dtype "
                         "(float32, bfloat16, float16)")
    return dtype
