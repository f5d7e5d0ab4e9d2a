"""`t5gemma` (T5GemmaForConditionalGeneration, Google's 2025 encoder-decoders adapted from
Gemma 2): two stacks of Gemma 2 layers, the encoder's self-attention bidirectional, the
decoder's causal with a cross-attention over the encoder output between its self-attention
and MLP.

Each stack is read as Gemma 2 reads its config (`models.pretrained.gemma2`): RMSNorm times
(1 + weight), four norms per layer (before and after each sublayer; the cross-attention's
too), grouped-query attention scaled by `query_pre_attn_scalar ** -0.5` and soft-capped
(`attn_logit_softcapping`, in the cross-attention as well), RoPE in both stacks' self-
attention, embeddings times sqrt(D) rounded to the compute dtype, GeGLU, alternating
sliding and full layers (`layer_types`): a decoder's sliding layer sees the
`sliding_window` most recent positions, an encoder's those within `sliding_window`
positions on either side (transformers' bidirectional window). The output logits are
soft-capped (`final_logit_softcapping`) and the head is the decoder's token embedding; the
encoder has a token table of its own. The decoder starts from `bos_token_id`.

The `encoder` and `decoder` sub-configs become one `TransformerConfig` (the published
balanced checkpoints: 2b-2b, 9b-9b, s-s to xl-xl): every field they hold must agree, or it
is refused naming both values; so are the unbalanced ones (9b-2b), an untied head and a
`cross_attention_hidden_size` other than the encoder's width.
"""

from __future__ import annotations

import dataclasses

from models.config import TransformerConfig
from models.errors import UserError
from models.pretrained import gemma2, llama
from models.pretrained.config_map import ConfigMap, SpecialIds
from models.pretrained.family import ConfigReader, Family, Inexpressible
from models.pretrained.mapping import Rule
from models.pretrained.rope import read_rope, write_rope
from models.pretrained.rules import (
    Attention,
    Scope,
    cross_attention,
    embeddings,
    final_norm,
    mlp,
    norm,
    self_attention,
)

# A sub-config is Gemma 2's (T5GemmaModuleConfig's defaults are gemma-2-2b's, as Gemma2Config's).
MODULE_MAP = ConfigMap(fields=gemma2.FIELDS, fixed=gemma2.FIXED, accepted=gemma2.MAP.accepted,
                       unread=gemma2.MAP.unread, ids=gemma2.MAP.ids)
# Keys of a sub-config that the whole config settles (the special ids, the head's tie, the
# decoder's cross-attention width) or that train only (dropout).
SETTLED = ("is_decoder", "cross_attention_hidden_size", "dropout_rate", "use_cache",
           "model_type", "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings",
           "is_encoder_decoder", "classifier_dropout_rate")
IDS = SpecialIds(pad=0, eos=1, start=2)
DEFAULT_DEPTH = TransformerConfig.__dataclass_fields__["num_layers"].default   # unread here
# Fields of a stack's config that both stacks must share (all but the depth).
SHARED = tuple(f.name for f in dataclasses.fields(TransformerConfig) if f.name != "num_layers")


def _stack(r: ConfigReader, which: str) -> tuple[TransformerConfig, dict]:
    """One sub-config as a decoder-only Gemma 2 config, and the dict read."""
    given = r.take(which)
    if not isinstance(given, dict):
        r.refuse(which, given, "a sub-config (a dict of T5GemmaModuleConfig's fields)")
    sub = ConfigReader({k: v for k, v in given.items() if k not in SETTLED}, f"t5gemma {which}")
    rope = read_rope(sub, sub.hf.get("max_position_embeddings", 8192))
    return gemma2.common_config(sub, MODULE_MAP, softcaps=(50.0, 30.0), pattern=2,
                                rope=rope), given


def config_from_hf(hf: dict) -> TransformerConfig:
    r = ConfigReader(hf, "t5gemma")
    (enc, _), (dec, dec_hf) = _stack(r, "encoder"), _stack(r, "decoder")
    if enc.num_layers != dec.num_layers:
        r.refuse("encoder.num_hidden_layers", enc.num_layers, f"as many layers as the "
                 f"decoder's {dec.num_layers} (one kind per layer for both stacks)")
    for name in SHARED:
        if getattr(enc, name) != getattr(dec, name):
            r.refuse(f"encoder's {name}", getattr(enc, name), f"the decoder's value "
                     f"{getattr(dec, name)!r}: one config for both stacks (a balanced T5Gemma)")
    cross = dec_hf.get("cross_attention_hidden_size") or enc.d_model
    if cross != enc.d_model:
        r.refuse("decoder.cross_attention_hidden_size", cross,
                 f"the encoder's width {enc.d_model}")
    if not r.take("tie_word_embeddings", True):
        r.refuse("tie_word_embeddings", False, "the head tied to the decoder's embedding")
    vocab = r.take("vocab_size", enc.vocab_size)
    if vocab != enc.vocab_size:
        r.refuse("vocab_size", vocab, f"the stacks' vocab_size {enc.vocab_size}")
    r.expect("is_encoder_decoder", True)
    for key in ("dropout_rate", "classifier_dropout_rate", "attention_dropout"):
        r.take(key, None)              # copied into the stacks (dropout: training only)
    ids = IDS.read(r)
    start = r.take("decoder_start_token_id", None)
    if start is not None and start != ids["bos_id"]:
        r.refuse("decoder_start_token_id", start, f"bos_token_id={ids['bos_id']}, where "
                 "transformers' generate starts a T5Gemma decoder")
    cfg = dec.replace(architecture="encoder_decoder", num_encoder_layers=enc.num_layers,
                      num_decoder_layers=dec.num_layers, num_layers=DEFAULT_DEPTH,
                      share_embeddings=False, tie_embeddings=True, **ids)
    r.finish()
    return cfg


def config_to_hf(cfg: TransformerConfig) -> dict:
    if (not cfg.is_encoder_decoder or cfg.share_embeddings or not cfg.tie_embeddings
            or cfg.audio is not None):
        raise Inexpressible("t5gemma expresses text encoder-decoders with a token table per "
                            "stack and the head tied to the decoder's (share_embeddings=False,"
                            " tie_embeddings=True)")
    try:                                     # each stack as a Gemma 2 decoder's config
        stack = cfg.replace(architecture="decoder_only", num_layers=cfg.num_decoder_layers)
    except UserError as e:
        raise Inexpressible(f"t5gemma's stacks are Gemma 2's, and this one is not: {e}") from e
    module = {**gemma2.common_to_hf(stack, "t5_gemma_module", MODULE_MAP), **write_rope(cfg),
              "tie_word_embeddings": True}
    return {"encoder": {**module, "is_decoder": False},
            "decoder": {**module, "is_decoder": True, "cross_attention_hidden_size": cfg.d_model},
            "vocab_size": cfg.vocab_size, "tie_word_embeddings": True,
            "is_encoder_decoder": True, **IDS.write(cfg), "decoder_start_token_id": cfg.bos_id}


ENCODER = Scope.layers("model.encoder.layers.{i}", "encoder")
DECODER = Scope.layers("model.decoder.layers.{i}", "decoder")
ATTENTION = Attention.apart("self_attn.{}_proj")
CROSS = Attention.apart("cross_attn.{}_proj")


def rules(cfg: TransformerConfig) -> list[Rule]:
    table = [*embeddings(cfg, stack="encoder", tokens="model.encoder.embed_tokens"),
             *embeddings(cfg, stack="decoder", tokens="model.decoder.embed_tokens")]
    for at in (ENCODER, DECODER):
        table += [*self_attention(cfg, at, ATTENTION), *mlp(cfg, at, llama.MLP),
                  *norm(cfg, at, "pre_self_attn_layernorm", "self_attention_norm"),
                  *norm(cfg, at, "post_self_attn_layernorm", "self_attention_output_norm"),
                  *norm(cfg, at, "pre_feedforward_layernorm", "mlp_norm"),
                  *norm(cfg, at, "post_feedforward_layernorm", "mlp_output_norm")]
    return [*table, *cross_attention(cfg, DECODER, CROSS),
            *norm(cfg, DECODER, "pre_cross_attn_layernorm", "cross_attention_norm"),
            *norm(cfg, DECODER, "post_cross_attn_layernorm", "cross_attention_output_norm"),
            *final_norm(cfg, "encoder", "model.encoder.norm"),
            *final_norm(cfg, "decoder", "model.decoder.norm")]


FAMILY = Family(model_type="t5gemma", architectures=("T5GemmaForConditionalGeneration",),
                config_from_hf=config_from_hf, config_to_hf=config_to_hf, rules=rules,
                prefix="model.",
                copies={"model.decoder.embed_tokens.weight": ("lm_head.out_proj.weight",)})
