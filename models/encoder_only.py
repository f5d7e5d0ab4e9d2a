"""The encoder-only family (BERT, RoBERTa): a bidirectional stack and its two heads.

    logits_BTV = model.apply(v, tokens, lengths=lengths)                    # masked LM
    logits_BC  = model.apply(v, tokens, lengths=lengths, method="classify")  # C labels
    logits_BTC = model.apply(v, tokens, segment_ids=seg, positions=pos,
                             method="classify_positions")   # packed rows: read each
                                                            # example's first position
    x_BTD      = model.apply(v, tokens, lengths=lengths, method="encode")
    logits_BTV = model.apply({"params": head}, x_BTD, method="logits_from_hidden")
                 # the masked-LM head alone; `head`: the entries head_param_names() names

The stack is the encoder-decoder's encoder: the same attention function, layers and
`LayerStack`, bidirectional, with padding (`lengths`, or segment id 0) and packed segments
kept apart by the mask. The embedding may add token types (BERT's sentence A/B) and an
embedding norm. Which head the model has follows the config, as a Hugging Face class
fixes it:

    num_labels == 0   masked-LM head: dense, activation, norm, then the tied embedding
                      plus its own bias [V]                       (BertForMaskedLM)
    num_labels == C   pooler (dense + tanh of the first token), dropout, then a linear
                      layer to C logits                  (BertForSequenceClassification)

ModernBERT's heads (`classifier_head="transform"`, `classifier_pooling`): its classifier
pools the first token or the mean of the example's real tokens, then applies the masked-LM
head's transform (dense, the activation, the norm) before the output layer; without
`head_bias` the transforms have no bias, and a gated activation's plain function
(`models.layers.UNGATED`) is the heads' activation.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from models.axes import XAVIER_UNIFORM, ZEROS, PlainInit, named
from models.blocks import LayerInputs, LayerStack, SelfAttentionLayer
from models.checks import check_same_shape, check_tokens
from models.config import TransformerConfig
from models.errors import UserError
from models.layers import ACTIVATIONS, UNGATED, InputEmbedding, make_norm, token_embedding
from models.masks import MaskSpec, positions_like, valid_from_lengths


def _dense(cfg: TransformerConfig, features: int, name: str, out_axis: str,
           bias: bool = True) -> nn.Dense:
    return nn.Dense(features, use_bias=bias, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                    kernel_init=named(XAVIER_UNIFORM, "embed", out_axis),
                    bias_init=named(ZEROS, out_axis), name=name)


def _transform(cfg: TransformerConfig, x_BTD):
    """norm(act(x W + b)): the heads' transform (the bias with `head_bias`)."""
    act = ACTIVATIONS[UNGATED.get(cfg.activation, cfg.activation)]
    h_BTD = act(_dense(cfg, cfg.d_model, "transform", "embed", cfg.head_bias)(x_BTD))
    return make_norm(cfg, "norm")(h_BTD)


class MaskedLMHead(nn.Module):
    """h -> norm(act(h W + b)) E^T + bias: next to nothing but a transform before the tied
    embedding `E` and a per-token bias."""

    config: TransformerConfig
    tokens: nn.Embed

    @nn.compact
    def __call__(self, x_BTD: Float[Array, "B T D"]) -> Float[Array, "B T V"]:
        cfg = self.config
        h_BTD = _transform(cfg, x_BTD)
        bias_V = self.param("bias", named(ZEROS, "vocab"), (cfg.vocab_size,),
                            cfg.param_dtype)
        logits_BTV = self.tokens.attend(h_BTD).astype(jnp.float32)
        return logits_BTV + bias_V.astype(jnp.float32)[None, None, :]


class ClassificationHead(nn.Module):
    """A pooled state -> tanh(dense) (the "pooler"; or with `classifier_head="transform"`
    the masked-LM head's transform) -> dropout -> C logits, for every state it is given
    (`[..., D] -> [..., C]`)."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x_BD: Float[Array, "... D"], deterministic: bool) -> Float[Array, "... C"]:
        cfg = self.config
        if cfg.classifier_head == "transform":
            pooled_BD = _transform(cfg, x_BD)
        else:
            pooled_BD = jnp.tanh(_dense(cfg, cfg.d_model, "pooler", "embed")(x_BD))
        pooled_BD = nn.Dropout(cfg.dropout_rate)(pooled_BD, deterministic=deterministic)
        return _dense(cfg, cfg.num_labels, "classifier", "labels")(pooled_BD).astype(jnp.float32)


class EncoderOnly(PlainInit, nn.Module):
    """A BERT/RoBERTa-style bidirectional encoder with a masked-LM or a classification head
    (see the module docstring). Padding is given by `lengths` (right-padded rows) or
    segment ids (packed rows, 0 = padding), never by comparing tokens with a pad id."""

    config: TransformerConfig

    def setup(self):
        cfg = self.config
        self.tokens = token_embedding(cfg, "tokens")
        self.embed = InputEmbedding(cfg, self.tokens)
        self.encoder = LayerStack(cfg, SelfAttentionLayer, cfg.num_layers, causal=False)
        if cfg.num_labels:
            self.classifier = ClassificationHead(cfg)
        else:
            self.mlm_head = MaskedLMHead(cfg, self.tokens)

    def encode(
        self,
        tokens: Int[Array, "B T"],
        *,
        lengths: Int[Array, " B"] | None = None,
        segment_ids: Int[Array, "B T"] | None = None,
        positions: Int[Array, "B T"] | None = None,
        token_types: Int[Array, "B T"] | None = None,
        deterministic: bool = True,
    ) -> Float[Array, "B T D"]:
        """The last hidden states. Padding (past `lengths`, or segment id 0) neither sees
        nor is seen; packed segments (with per-segment `positions`) see only themselves."""
        cfg = self.config
        check_tokens(cfg, tokens, "tokens")
        check_same_shape(segment_ids, tokens, "segment_ids", "tokens")
        check_same_shape(positions, tokens, "positions", "tokens")
        check_same_shape(token_types, tokens, "token_types", "tokens")
        if token_types is not None and not cfg.num_token_types:
            raise UserError("token_types given, but the config has num_token_types=0")
        positions = positions_like(tokens) if positions is None else positions
        valid_BT = valid_from_lengths(tokens, lengths, "lengths")
        index_BT = positions_like(tokens)               # for a sliding layer's window
        spec = MaskSpec(index_BT, index_BT, q_segment=segment_ids, k_segment=segment_ids,
                        q_valid=valid_BT, k_valid=valid_BT, aligned=True)
        x_BTD = self.embed(tokens, positions, deterministic, token_types)
        x_BTD, _ = self.encoder(x_BTD, LayerInputs(spec, positions, deterministic=deterministic))
        return x_BTD

    def __call__(self, tokens: Int[Array, "B T"], **kwargs) -> Float[Array, "B T V"]:
        """Masked-LM logits of every position (float32); keywords as `encode`."""
        if self.config.num_labels:
            raise UserError(f"this model classifies (num_labels={self.config.num_labels}); "
                             "its logits come from method='classify'")
        return self.logits_from_hidden(self.encode(tokens, **kwargs))

    def logits_from_hidden(self, x_BTD: Float[Array, "B T D"]) -> Float[Array, "B T V"]:
        """The masked-LM head alone: what the forward makes of `encode`'s states. It
        reads only the parameters `head_param_names()` names."""
        if self.config.num_labels:
            raise UserError(f"this model classifies (num_labels={self.config.num_labels}); "
                             "it has no masked-LM head")
        return self.mlm_head(x_BTD)

    def head_param_names(self) -> tuple[str, ...]:
        """The top-level parameter entries the masked-LM head reads (the tied token table
        and the head's own). Needs no binding."""
        return ("tokens", "mlm_head")

    def classify(self, tokens: Int[Array, "B T"], *, deterministic: bool = True,
                 **kwargs) -> Float[Array, "B C"]:
        """Class logits (float32) from each row's first token; keywords as `encode`. One
        example per row: the first token is the [CLS] (<s>) token the tokenizer adds."""
        return self.classify_positions(tokens, deterministic=deterministic, first_only=True,
                                       **kwargs)[:, 0]

    def classify_positions(self, tokens: Int[Array, "B T"], *, deterministic: bool = True,
                           first_only: bool = False, **kwargs) -> Float[Array, "B T C"]:
        """Class logits (float32) read at every position, for packed rows whose examples
        start at their segments' first positions (training reads those); keywords as
        `encode`. With `first_only`, the head reads position 0 alone (`[B, 1, C]`). With
        `classifier_pooling="mean"` a position reads the mean of its example's real
        tokens (its segment's, or its row's up to `lengths`)."""
        if not self.config.num_labels:
            raise UserError("this model has a masked-LM head (num_labels=0); give the config "
                             "num_labels > 0 for a classifier")
        x_BTD = self.encode(tokens, deterministic=deterministic, **kwargs)
        if self.config.classifier_pooling == "mean":
            x_BTD = _example_means(x_BTD, tokens, kwargs.get("lengths"),
                                   kwargs.get("segment_ids"))
        return self.classifier(x_BTD[:, :1] if first_only else x_BTD, deterministic)


def _example_means(x_BTD, tokens_BT, lengths_B, segment_ids_BT):
    """At each position, the mean of the states of its example's real tokens: those of its
    segment (ids > 0), or of its row up to `lengths` (every token without either)."""
    if segment_ids_BT is None:
        segment_ids_BT = valid_from_lengths(tokens_BT, lengths_B, "lengths").astype(jnp.int32)
    same_BTS = ((segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :])
                & (segment_ids_BT[:, None, :] > 0)).astype(jnp.float32)
    sums_BTD = jnp.einsum("bts,bsd->btd", same_BTS, x_BTD.astype(jnp.float32))
    counts_BT1 = jnp.maximum(same_BTS.sum(-1, keepdims=True), 1.0)
    return (sums_BTD / counts_BT1).astype(x_BTD.dtype)
