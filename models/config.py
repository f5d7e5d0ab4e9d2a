"""`TransformerConfig`: every architectural choice in one frozen, hashable dataclass.

The model sees only this object; experiments and the command line build it (from a preset
plus overrides) and vary it with `.replace(...)`. Construction validates every field and
raises `ValueError` naming the field, the value and the rule it breaks.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp

Architecture = Literal["decoder_only", "encoder_decoder"]
PositionKind = Literal["sinusoidal", "learned", "rope"]
NormKind = Literal["layernorm", "rmsnorm"]
NormPosition = Literal["pre", "post"]
Activation = Literal["relu", "gelu", "swiglu"]

_CHOICES = {
    "architecture": ("decoder_only", "encoder_decoder"),
    "positions": ("sinusoidal", "learned", "rope"),
    "norm": ("layernorm", "rmsnorm"),
    "norm_position": ("pre", "post"),
    "activation": ("relu", "gelu", "swiglu"),
}
_POSITIVE_INTS = (
    "vocab_size", "d_model", "num_heads", "num_kv_heads", "head_dim", "mlp_dim", "max_len",
    "num_layers", "num_encoder_layers", "num_decoder_layers",
)


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Architecture of a decoder-only or encoder-decoder transformer.

    Attributes:
        architecture: "decoder_only" (GPT/Llama) or "encoder_decoder" (Vaswani/T5/BART).
        vocab_size: V, shared by source and target.
        d_model: D, the residual width.
        num_heads: N, query heads.
        num_kv_heads: K, key/value heads; N for multi-head, 1 for multi-query, in between for
            grouped-query attention. None means N.
        head_dim: H; None means D // N.
        mlp_dim: F, the MLP hidden width.
        num_layers: L of a decoder-only stack.
        num_encoder_layers, num_decoder_layers: L of each encoder-decoder stack.
        max_len: the longest sequence (positions 0 .. max_len - 1) and the largest cache.
        positions: "sinusoidal" or "learned" (added to the embeddings) or "rope" (rotary,
            applied to queries and keys of self-attention).
        rope_theta: the rotary base frequency.
        norm: "layernorm" or "rmsnorm"; norm_position: "pre" (x + f(norm(x)), with a final
            norm after the stack) or "post" (norm(x + f(x)), as in Vaswani et al.).
        norm_eps: epsilon of every norm.
        activation: "relu", "gelu" (tanh approximation, as GPT-2) or "swiglu" (gated).
        use_bias: biases in the attention and MLP projections.
        share_embeddings: encoder-decoder only: source and target use one embedding table.
        tie_embeddings: the output projection is the transposed target embedding.
        scale_embeddings: multiply embeddings by sqrt(D) (Vaswani et al.); their initial
            scale is then D ** -0.5 so the scaled input has unit variance.
        dropout_rate: on embeddings and on every sublayer output before the residual add.
        attention_dropout_rate: on the attention probabilities.
        dtype: compute dtype name; param_dtype: parameter dtype name.
        scan_layers: run the layers with `nn.scan` (parameters stacked over layers).
        remat: rematerialise each layer in the backward pass (`nn.remat`).
        pad_id, eos_id, bos_id: special token ids (bos is the decoder start token).
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
    rope_theta: float = 10_000.0
    norm: NormKind = "layernorm"
    norm_position: NormPosition = "pre"
    norm_eps: float = 1e-6
    activation: Activation = "relu"
    use_bias: bool = True
    share_embeddings: bool = True
    tie_embeddings: bool = True
    scale_embeddings: bool = False
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    dtype: str = "float32"
    param_dtype: str = "float32"
    scan_layers: bool = False
    remat: bool = False
    pad_id: int = 0
    eos_id: int = 1
    bos_id: int = 2

    def __post_init__(self):
        for name in ("dtype", "param_dtype"):
            value = getattr(self, name)
            try:
                canonical = jnp.dtype(value).name
            except TypeError as e:
                raise ValueError(f"TransformerConfig.{name}={value!r} is not a dtype") from e
            if not jnp.issubdtype(jnp.dtype(canonical), jnp.floating):
                raise ValueError(
                    f"TransformerConfig.{name}={value!r} must be a floating dtype "
                    "(float32, bfloat16, float16)")
            object.__setattr__(self, name, canonical)
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.head_dim is None and self.num_heads > 0 and self.d_model > 0:
            if self.d_model % self.num_heads:
                raise ValueError(
                    f"TransformerConfig.d_model={self.d_model} is not divisible by "
                    f"num_heads={self.num_heads} (set head_dim to decouple them)")
            object.__setattr__(self, "head_dim", self.d_model // self.num_heads)
        self._validate()

    def _validate(self):
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"TransformerConfig.{name}={getattr(self, name)!r} is not one of {allowed}")
        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TransformerConfig.{name}={value!r} must be a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"TransformerConfig.num_heads={self.num_heads} is not divisible by "
                f"num_kv_heads={self.num_kv_heads}")
        if self.positions == "rope" and self.head_dim % 2:
            raise ValueError(
                f"TransformerConfig.head_dim={self.head_dim} must be even for rope positions")
        if self.rope_theta <= 0:
            raise ValueError(f"TransformerConfig.rope_theta={self.rope_theta} must be > 0")
        if not self.norm_eps > 0:
            raise ValueError(f"TransformerConfig.norm_eps={self.norm_eps} must be > 0")
        for name in ("dropout_rate", "attention_dropout_rate"):
            rate = getattr(self, name)
            if not 0.0 <= rate < 1.0:
                raise ValueError(f"TransformerConfig.{name}={rate} must be in [0, 1)")
        ids = {"pad_id": self.pad_id, "eos_id": self.eos_id, "bos_id": self.bos_id}
        for name, value in ids.items():
            if isinstance(value, bool) or not isinstance(value, int) \
                    or not 0 <= value < self.vocab_size:
                raise ValueError(
                    f"TransformerConfig.{name}={value!r} must be an int in "
                    f"[0, vocab_size={self.vocab_size})")
        if len(set(ids.values())) != len(ids):
            raise ValueError(f"TransformerConfig special ids must be distinct, got {ids}")

    # Derived quantities, so no caller recomputes them.
    @property
    def is_encoder_decoder(self) -> bool:
        return self.architecture == "encoder_decoder"

    @property
    def decoder_layers(self) -> int:
        """L of the stack that owns the KV cache."""
        return self.num_decoder_layers if self.is_encoder_decoder else self.num_layers

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def params_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)

    def replace(self, **changes) -> TransformerConfig:
        """A copy with `changes` applied and validated; unknown keys name themselves.

        `head_dim` and `num_kv_heads` that equal their defaults (D // N and N) are derived
        again from the changed sizes: `replace(d_model=128)` of a 4-head config has
        head_dim 32, and an MHA config stays MHA when `num_heads` changes.
        """
        check_keys(changes)
        if "head_dim" not in changes and self.head_dim * self.num_heads == self.d_model:
            changes["head_dim"] = None
        if "num_kv_heads" not in changes and self.num_kv_heads == self.num_heads:
            changes["num_kv_heads"] = None
        return dataclasses.replace(self, **changes)


def check_keys(changes: dict) -> None:
    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise ValueError(
            f"unknown TransformerConfig field(s) {unknown}; known fields: {sorted(known)}")
