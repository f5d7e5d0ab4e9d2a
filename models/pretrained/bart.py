"""`bart`: an encoder-decoder with learned positions offset by 2 (a table of
max_position_embeddings + 2 rows per stack), a LayerNorm on the embeddings plus positions
(`layernorm_embedding`), post-norm layers, exact (erf) GELU by default, optionally
sqrt(D)-scaled embeddings, one embedding table shared by the encoder, the decoder and the
tied head, and `final_logits_bias` ([1, V] in the file, our "logits_bias" [V]) added to the
logits. `marian` (its own module) is this layer table with other embeddings.

Special ids: our `bos_id` is the decoder start token (`decoder_start_token_id`, eos in real
BART checkpoints); `eos_id` and `pad_id` are config.json's. BART's `bos_token_id` (<s>, 0 in
real checkpoints) starts the *source* text: the tokenizer adds it and the model never reads
it, so our config has no field for it. Saving writes it as the decoder start token, the one
start token our config knows (transformers falls back to bos_token_id where no decoder start
is given, so both stay the same token); generation_config.json, written from the loaded
`GenerationDefaults.raw` by `models.save`, keeps the original value. Generation defaults
(forced_eos_token_id, num_beams, ...) go to generation_config.json only: config.json gets
forced_eos_token_id null so that BartConfig's default (2) does not add one.

config.json files written by transformers 3 (facebook/bart-large's among them) hold
BartConfig's mBART-style switches, which later BartConfigs do not have: they are accepted at
the values BART computes with, and refused by name otherwise: normalize_before,
add_final_layer_norm, add_bias_logits, do_blenderbot_90_layernorm (False),
normalize_embedding (True), static_position_embeddings (False), extra_pos_embeddings (2).
"""

from __future__ import annotations

from models.config import TransformerConfig
from models.pretrained.config_map import (
    D_OVER_N,
    DECODER_START,
    MULTI_HEAD,
    ConfigMap,
    Field,
    SpecialIds,
)
from models.pretrained.family import ConfigReader, Family, Inexpressible
from models.pretrained.mapping import Rule
from models.pretrained.rules import (
    Attention,
    Mlp,
    Scope,
    cross_attention,
    embeddings,
    final_norm,
    logits_bias as _logits_bias,
    mlp,
    norm,
    self_attention,
)

ACTIVATIONS = {"gelu": "gelu_exact", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu",
               "relu": "relu", "silu": "silu", "swish": "silu"}
# What we write for each of ours (the first spelling transformers reads as it).
HF_ACTIVATIONS = {"gelu_exact": "gelu", "gelu": "gelu_new", "relu": "relu", "silu": "silu"}
NORM_EPS = 1e-5                       # torch.nn.LayerNorm's default, which BART and Marian use
FIELDS = (
    Field("vocab_size", "vocab_size"), Field("d_model", "d_model"),
    Field("encoder_attention_heads", "num_heads"),          # and decoder_attention_heads
    Field("encoder_ffn_dim", "mlp_dim"),                    # and decoder_ffn_dim
    Field("encoder_layers", "num_encoder_layers"), Field("decoder_layers", "num_decoder_layers"),
    Field("max_position_embeddings", "max_len"),
    Field("scale_embedding", "scale_embeddings", False, bool),
    Field("dropout", "dropout_rate", 0.1, float),
    Field("attention_dropout", "attention_dropout_rate", 0.0, float),
    Field("activation_dropout", "mlp_dropout_rate", 0.0, float))
# Post-norm LayerNorm layers with biases, one head count for both stacks, a tied head with
# a logits bias (a family adds its positions and embeddings).
FIXED = dict(architecture="encoder_decoder", norm="layernorm", norm_position="post",
             norm_eps=NORM_EPS, use_bias=True, qkv_bias=False, sliding_window=None,
             num_kv_heads=MULTI_HEAD, head_dim=D_OVER_N, tie_embeddings=True, logits_bias=True)
CONSTANTS = dict(encoder_layerdrop=0.0, decoder_layerdrop=0.0, is_encoder_decoder=True,
                 tie_word_embeddings=True)
# BartConfig's mBART-style switches in config.json files of transformers 3, at the values
# BART computes with.
LEGACY = dict(normalize_before=False, add_final_layer_norm=False, add_bias_logits=False,
              do_blenderbot_90_layernorm=False)
# Initialisation, the classification heads, training, and a forced first token as
# force_bos_token_to_be_generated (which generation's forced_bos_token_id replaced): none
# changes the logits.
UNREAD = ("init_std", "classifier_dropout", "classif_dropout", "_num_labels", "output_past",
          "force_bos_token_to_be_generated")
MAP = ConfigMap(
    fields=FIELDS,
    fixed={**FIXED, "positions": "learned", "position_offset": 2, "embedding_norm": True,
           "share_embeddings": True},
    constants=CONSTANTS,
    accepted={**LEGACY, "normalize_embedding": True, "static_position_embeddings": False,
              "extra_pos_embeddings": 2},
    unread=UNREAD,
    ids=SpecialIds(pad=1, eos=2, start=2, start_key=DECODER_START, source_bos="start"))


def read_common(r: ConfigReader, cmap: ConfigMap) -> dict:
    """The TransformerConfig fields of BART or Marian (`cmap`, its map): the map's, with one
    head count and FFN width for both stacks, and the activation."""
    heads = r.take("encoder_attention_heads")
    if r.take("decoder_attention_heads") != heads:
        r.refuse("decoder_attention_heads", r.hf["decoder_attention_heads"],
                 f"one head count for both stacks: encoder_attention_heads={heads}")
    ffn = r.take("encoder_ffn_dim")
    if r.take("decoder_ffn_dim") != ffn:
        r.refuse("decoder_ffn_dim", r.hf["decoder_ffn_dim"],
                 f"one FFN width for both stacks: encoder_ffn_dim={ffn}")
    r.expect("num_hidden_layers", r.take("encoder_layers"))   # transformers' alias of it
    act = r.take("activation_function", "gelu")      # BartConfig's and MarianConfig's default
    if act not in ACTIVATIONS:
        r.refuse("activation_function", act, f"supported: {sorted(ACTIVATIONS)}")
    return {**cmap.read(r), "activation": ACTIVATIONS[act]}


def common_to_hf(cfg: TransformerConfig, model_type: str, cmap: ConfigMap) -> dict:
    """config.json of a BART or Marian config (`cmap`, its map)."""
    hf = cmap.write(cfg, model_type)
    if cfg.activation not in HF_ACTIVATIONS:
        raise Inexpressible(f"{model_type} cannot express activation={cfg.activation!r}")
    if cfg.d_model % cfg.num_heads:
        raise Inexpressible(f"{model_type} needs num_heads={cfg.num_heads} to divide "
                            f"d_model={cfg.d_model}")
    return {**hf, "decoder_attention_heads": cfg.num_heads, "decoder_ffn_dim": cfg.mlp_dim,
            "activation_function": HF_ACTIVATIONS[cfg.activation],
            "forced_eos_token_id": None}


def config_from_hf(hf: dict) -> TransformerConfig:
    r = ConfigReader(hf, "bart")
    cfg = TransformerConfig(**read_common(r, MAP))
    r.finish()
    return cfg


def config_to_hf(cfg: TransformerConfig) -> dict:
    return common_to_hf(cfg, "bart", MAP)


ATTENTION = Attention.apart("self_attn.{}_proj", o="out")
CROSS_ATTENTION = Attention.apart("encoder_attn.{}_proj", o="out")
MLP = Mlp(up="fc1", down="fc2")


def layer_rules(cfg: TransformerConfig, *, logits_bias: bool = True) -> list[Rule]:
    """The encoder and decoder layers of BART, Marian and M2M-100 (each sublayer's norm is
    named after it, before or after it), and the logits bias (unless `logits_bias` is
    False: M2M-100 has none)."""
    table = []
    for stack in ("encoder", "decoder"):
        layer = Scope.layers(f"model.{stack}.layers.{{i}}", stack)
        table += [*self_attention(cfg, layer, ATTENTION),
                  *norm(cfg, layer, "self_attn_layer_norm", "self_attention_norm")]
        if stack == "decoder":
            table += [*cross_attention(cfg, layer, CROSS_ATTENTION),
                      *norm(cfg, layer, "encoder_attn_layer_norm", "cross_attention_norm")]
        table += [*mlp(cfg, layer, MLP), *norm(cfg, layer, "final_layer_norm", "mlp_norm")]
    return table + (_logits_bias("final_logits_bias") if logits_bias else [])


def pre_norm_rules(cfg: TransformerConfig, per_stack=lambda stack: [], *,
                   logits_bias: bool = True) -> list[Rule]:
    """The weight map of BART's layers made pre-norm (M2M-100, mBART, PEGASUS): the shared
    table, each stack's own rules (`per_stack(stack)`: its positions, its embedding norm)
    and the final LayerNorm closing it (`model.{stack}.layer_norm`), then the layers."""
    table = embeddings(cfg, stack="encoder", tokens="model.shared")
    for stack in ("encoder", "decoder"):
        table += [*per_stack(stack), *final_norm(cfg, stack, f"model.{stack}.layer_norm")]
    return table + layer_rules(cfg, logits_bias=logits_bias)


def rules(cfg: TransformerConfig) -> list[Rule]:
    table = embeddings(cfg, stack="encoder", tokens="model.shared")
    for stack in ("encoder", "decoder"):
        table += embeddings(cfg, stack=stack, positions=f"model.{stack}.embed_positions",
                            embedding_norm=f"model.{stack}.layernorm_embedding")
    return table + layer_rules(cfg)


# transformers ties each stack's embed_tokens and the head to the shared table.
SHARED_COPIES = {"model.shared.weight": ("model.encoder.embed_tokens.weight",
                                         "model.decoder.embed_tokens.weight", "lm_head.weight")}

FAMILY = Family(model_type="bart", architectures=("BartForConditionalGeneration",),
                config_from_hf=config_from_hf, config_to_hf=config_to_hf, rules=rules,
                prefix="model.", copies=SHARED_COPIES,
                ignored=(r"(model\.)?(encoder|decoder)\.version",))
