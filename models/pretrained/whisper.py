"""`whisper` (OpenAI's speech recognition models, tiny to large-v3, distil and turbo): an
encoder-decoder whose encoder reads log-mel features through a convolutional front end
(`models.audio`: two 1-D convolutions, exact GELU, Whisper's fixed sinusoids) and whose
decoder is BART-like with learned positions (max_target_positions rows, no offset);
pre-norm LayerNorm layers with biases (eps 1e-5), a final LayerNorm after each stack, exact
(erf) GELU, and a head (`proj_out`) tied to the decoder's embedding.

Whisper's key projections (`k_proj`, self- and cross-attention) have no bias, ours do: a
bias on the keys adds q . b to every logit of a query alike, which the softmax removes, so
the key biases are read as zeros and not written (the logits are the same whatever they
hold).

The encoder's position table (`model.encoder.embed_positions.weight`) is a function of
max_source_positions and d_model (`models.audio.whisper_sinusoids`), which we compute: a
stored one must equal ours to the float32 rounding of its angles (a few units in the last
place of S radians, about 1e-4 at S = 1500, the differences between float32 exp and sin
implementations) or to the file dtype's rounding, else the checkpoint is refused naming the
tensor. The model computes its own table (no parameter holds it); the loader keeps the
file's, exactly as stored (`Pretrained.tables`), and `models.save(..., tables=pre.tables)`
writes it back, so a load then save of a published Whisper is bit for bit. Without
`tables`, `models.save` writes the table we compute (within that tolerance of torch's), so
transformers still finds every tensor it expects and gives our logits. A table given to
save passes the same check as one loaded (another model's table is refused by name).

Refused by name: scale_embedding=True, encoder_layerdrop / decoder_layerdrop > 0
(training-time layer dropping this project does not run), use_weighted_layer_sum=True (the
audio classifier's), different head counts or FFN widths in the two stacks, and any
activation but the ones BART maps. SpecAugment (`apply_spec_augment`, `mask_time_*`,
`mask_feature_*`) masks features in training only and never changes the logits of an
evaluation: accepted and not read, as `median_filter_width` (word timestamps) and
`classifier_proj_size` (the classifier head) are.

Special ids: our `bos_id` is `decoder_start_token_id` (<|startoftranscript|>); pad and eos
are config.json's (WhisperConfig's defaults 50256). `bos_token_id` (<|endoftext|>) is never
read by the model: dropped when reading, and written as the end id (as every published
Whisper config.json holds it), so transformers does not fill in its default 50256 where the
vocabulary is smaller. The decoder prompt (language, task,
<|notimestamps|>) and the suppressed tokens are generation defaults
(generation_config.json).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from models.audio import AudioInput, whisper_sinusoids
from models.config import TransformerConfig
from models.errors import UserError
from models.pretrained import bart
from models.pretrained.config_map import DECODER_START, ConfigMap, Field, SpecialIds
from models.pretrained.family import ConfigReader, Family, Inexpressible
from models.pretrained.layouts import Layout
from models.pretrained.mapping import Rule
from models.pretrained.rules import (
    Scope,
    cross_attention,
    embeddings,
    final_norm,
    mlp,
    norm,
    self_attention,
)

FIELDS = (
    Field("vocab_size", "vocab_size"), Field("d_model", "d_model"),
    Field("encoder_attention_heads", "num_heads"),          # and decoder_attention_heads
    Field("encoder_ffn_dim", "mlp_dim"),                    # and decoder_ffn_dim
    Field("encoder_layers", "num_encoder_layers"), Field("decoder_layers", "num_decoder_layers"),
    Field("max_target_positions", "max_len", 448),
    Field("dropout", "dropout_rate", 0.0, float),
    Field("attention_dropout", "attention_dropout_rate", 0.0, float),
    Field("activation_dropout", "mlp_dropout_rate", 0.0, float))
FIXED = {**bart.FIXED, "norm_position": "pre", "logits_bias": False, "positions": "learned",
         "share_embeddings": False}
MAP = ConfigMap(
    fields=FIELDS,
    fixed=FIXED,
    constants=dict(is_encoder_decoder=True, tie_word_embeddings=True, scale_embedding=False,
                   encoder_layerdrop=0.0, decoder_layerdrop=0.0, use_weighted_layer_sum=False),
    # SpecAugment (training-time feature masking), word-timestamp smoothing and the audio
    # classifier's width: none changes the logits.
    unread=("init_std", "apply_spec_augment", "mask_time_prob", "mask_time_length",
            "mask_time_min_masks", "mask_feature_prob", "mask_feature_length",
            "mask_feature_min_masks", "median_filter_width", "classifier_proj_size"),
    ids=SpecialIds(pad=50256, eos=50256, start=50257, start_key=DECODER_START,
                   source_bos="eos"))
DEFAULT_AUDIO = AudioInput()                       # WhisperConfig's 80 mels, 1500 positions


def config_from_hf(hf: dict) -> TransformerConfig:
    r = ConfigReader(hf, "whisper")
    fields = bart.read_common(r, MAP)
    audio = AudioInput(
        num_mel_bins=r.take("num_mel_bins", DEFAULT_AUDIO.num_mel_bins),
        max_source_positions=r.take("max_source_positions",
                                    DEFAULT_AUDIO.max_source_positions))
    if fields["d_model"] % 2 or fields["d_model"] < 4:
        r.refuse("d_model", fields["d_model"], "the encoder's sinusoids need an even width "
                 "of at least 4")
    cfg = TransformerConfig(**fields, audio=audio)
    r.finish()
    return cfg


def config_to_hf(cfg: TransformerConfig) -> dict:
    if cfg.audio is None:
        raise Inexpressible("whisper needs an audio encoder (TransformerConfig.audio)")
    hf = MAP.write(cfg, "whisper", audio=cfg.audio)
    if cfg.activation not in bart.HF_ACTIVATIONS:
        raise Inexpressible(f"whisper cannot express activation={cfg.activation!r}")
    if cfg.d_model % cfg.num_heads:
        raise Inexpressible(f"whisper needs num_heads={cfg.num_heads} to divide "
                            f"d_model={cfg.d_model}")
    return {**hf, "decoder_attention_heads": cfg.num_heads, "decoder_ffn_dim": cfg.mlp_dim,
            "activation_function": bart.HF_ACTIVATIONS[cfg.activation],
            "num_mel_bins": cfg.audio.num_mel_bins,
            "max_source_positions": cfg.audio.max_source_positions}


def _with_zero_bias(kernel_rule: Rule, bias_path: str) -> Rule:
    """`kernel_rule` (a key projection's weight) that also gives our key bias: zeros when
    reading, dropped when writing (a key bias never changes attention; see the module
    docstring)."""
    layout = kernel_rule.layout

    def to_ours(xs, cfg):
        (kernel,) = layout.to_ours(xs, cfg)
        return [kernel, np.zeros(kernel.shape[1:], kernel.dtype)]

    return dataclasses.replace(
        kernel_rule, ours=(*kernel_rule.ours, bias_path),
        layout=Layout(to_ours, lambda ours, cfg: layout.to_theirs(ours[:1], cfg)))


def _no_key_bias(table: list[Rule]) -> list[Rule]:
    """An attention's rules without `k_proj.bias`: its key bias rides on the key kernel's
    rule (`_with_zero_bias`)."""
    out = []
    bias_of = {r.theirs[0].replace(".bias", ".weight"): r.ours[0] for r in table
               if r.theirs[0].endswith("k_proj.bias")}
    for rule in table:
        if rule.theirs[0].endswith("k_proj.bias"):
            continue
        bias = bias_of.get(rule.theirs[0])
        out.append(rule if bias is None else _with_zero_bias(rule, bias))
    return out


def _conv(theirs: str, ours: str) -> list[Rule]:
    """A torch Conv1d (weight [out, in, k]) <-> a flax Conv (kernel [k, in, out]), biased."""
    weight = Layout(lambda xs, cfg: [xs[0].transpose(2, 1, 0)],
                    lambda xs, cfg: [xs[0].transpose(2, 1, 0)])
    return [Rule(f"{theirs}.weight", f"{ours}/kernel", weight), Rule(f"{theirs}.bias",
                                                                       f"{ours}/bias")]


ATTENTION = bart.ATTENTION
CROSS_ATTENTION = bart.CROSS_ATTENTION


def rules(cfg: TransformerConfig) -> list[Rule]:
    table = [POSITION_RULE, *_conv("model.encoder.conv1", "src_embed/conv1"),
             *_conv("model.encoder.conv2", "src_embed/conv2"),
             *embeddings(cfg, stack="decoder", tokens="model.decoder.embed_tokens",
                         positions="model.decoder.embed_positions")]
    for stack in ("encoder", "decoder"):
        layer = Scope.layers(f"model.{stack}.layers.{{i}}", stack)
        table += [*_no_key_bias(self_attention(cfg, layer, ATTENTION)),
                  *norm(cfg, layer, "self_attn_layer_norm", "self_attention_norm")]
        if stack == "decoder":
            table += [*_no_key_bias(cross_attention(cfg, layer, CROSS_ATTENTION)),
                      *norm(cfg, layer, "encoder_attn_layer_norm", "cross_attention_norm")]
        table += [*mlp(cfg, layer, bart.MLP), *norm(cfg, layer, "final_layer_norm", "mlp_norm")]
        table += final_norm(cfg, stack, f"model.{stack}.layer_norm")
    return table


POSITIONS = "model.encoder.embed_positions.weight"


def _position_tolerance(cfg: TransformerConfig, dtype) -> float:
    """How far a stored encoder table may be from ours: its angles (up to S radians) are
    float32 products of a float32 exp, so a table computed elsewhere differs from ours by
    a few float32 units of S (about 1e-4 at S = 1500), or by the file dtype's rounding."""
    eps32 = float(np.finfo(np.float32).eps)
    return max(4 * cfg.audio.max_source_positions * eps32, 2 * float(jnp.finfo(dtype).eps))


def _check_positions(xs, cfg):
    (stored,) = xs
    want = whisper_sinusoids(cfg.audio.max_source_positions, cfg.d_model)
    if stored.shape != want.shape or not np.allclose(
            stored.astype(np.float64), want, rtol=0, atol=_position_tolerance(cfg, stored.dtype)):
        raise UserError(
            f"whisper checkpoint: {POSITIONS} (shape {stored.shape}) is not Whisper's "
            f"sinusoids for max_source_positions={cfg.audio.max_source_positions}, d_model="
            f"{cfg.d_model} (shape {want.shape}); this project computes that table and cannot "
            "load a different one")
    return []


# The encoder's fixed positions: checked when reading (no parameter of ours holds them, the
# loader keeps the file's as a table) and written from that table when a save is given it,
# else as we compute them, so transformers finds every tensor it expects.
POSITION_RULE = Rule(POSITIONS, (), Layout(
    _check_positions,
    lambda ours, cfg: [whisper_sinusoids(cfg.audio.max_source_positions,
                                         cfg.d_model).astype(cfg.param_dtype)]))


FAMILY = Family(model_type="whisper", architectures=("WhisperForConditionalGeneration",),
                config_from_hf=config_from_hf, config_to_hf=config_to_hf, rules=rules,
                prefix="model.",
                copies={"model.decoder.embed_tokens.weight": ("proj_out.weight",)})
