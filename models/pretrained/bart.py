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

Fields of older configs (mBART-style switches that transformers' BART no longer reads) are
accepted at the values BART computes with, and refused by name otherwise: normalize_before,
add_final_layer_norm, add_bias_logits, do_blenderbot_90_layernorm (False),
normalize_embedding (True), static_position_embeddings (False), extra_pos_embeddings (2).
"""

from __future__ import annotations

from models.config import TransformerConfig
from models.pretrained.family import ConfigReader, Family, Inexpressible, require
from models.pretrained.mapping import Rule
from models.pretrained.rules import (
    Attention,
    Mlp,
    Scope,
    cross_attention,
    embeddings,
    logits_bias,
    mlp,
    norm,
    self_attention,
)

ACTIVATIONS = {"gelu": "gelu_exact", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu",
               "relu": "relu", "silu": "silu", "swish": "silu"}
# What we write for each of ours (the first spelling transformers reads as it).
HF_ACTIVATIONS = {"gelu_exact": "gelu", "gelu": "gelu_new", "relu": "relu", "silu": "silu"}
NORM_EPS = 1e-5                       # torch.nn.LayerNorm's default, which BART and Marian use
# Fields of the classification heads, of training, and of old generation code (a forced
# first token, now forced_bos_token_id): none changes the logits.
HEAD_FIELDS = ("classifier_dropout", "classif_dropout", "_num_labels", "output_past",
               "force_bos_token_to_be_generated")


def read_common(r: ConfigReader, *, default_act: str, default_eos: int) -> dict:
    """The TransformerConfig fields BART and Marian read alike: sizes, one head count and
    FFN width for both stacks, post-norm LayerNorm layers with biases, the activation,
    dropout rates, no layer drop, a tied head, and the special ids."""
    d = r.take("d_model")
    heads = r.take("encoder_attention_heads")
    if r.take("decoder_attention_heads") != heads:
        r.refuse("decoder_attention_heads", r.hf["decoder_attention_heads"],
                 f"one head count for both stacks: encoder_attention_heads={heads}")
    ffn = r.take("encoder_ffn_dim")
    if r.take("decoder_ffn_dim") != ffn:
        r.refuse("decoder_ffn_dim", r.hf["decoder_ffn_dim"],
                 f"one FFN width for both stacks: encoder_ffn_dim={ffn}")
    layers = r.take("encoder_layers")
    r.expect("num_hidden_layers", layers)      # transformers' alias of encoder_layers
    act = r.take("activation_function", default_act)
    if act not in ACTIVATIONS:
        r.refuse("activation_function", act, f"supported: {sorted(ACTIVATIONS)}")
    for key in ("encoder_layerdrop", "decoder_layerdrop"):
        r.expect(key, 0.0)
    r.expect("is_encoder_decoder", True)
    r.expect("tie_word_embeddings", True)
    r.take("init_std", None)                   # initialisation only
    for key in HEAD_FIELDS:
        r.take(key, None)
    for key in ("normalize_before", "add_final_layer_norm", "add_bias_logits",
                "do_blenderbot_90_layernorm"):
        r.expect(key, False)
    eos = r.take("eos_token_id", default_eos)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return dict(
        architecture="encoder_decoder", vocab_size=r.take("vocab_size"), d_model=d,
        num_heads=heads, mlp_dim=ffn, num_encoder_layers=layers,
        num_decoder_layers=r.take("decoder_layers"),
        max_len=r.take("max_position_embeddings"), norm="layernorm", norm_position="post",
        norm_eps=NORM_EPS, activation=ACTIVATIONS[act], use_bias=True, tie_embeddings=True,
        scale_embeddings=bool(r.take("scale_embedding", False)), logits_bias=True,
        dropout_rate=float(r.take("dropout", 0.1)),
        attention_dropout_rate=float(r.take("attention_dropout", 0.0)),
        mlp_dropout_rate=float(r.take("activation_dropout", 0.0)), eos_id=eos)


def common_to_hf(cfg: TransformerConfig, model_type: str, **fields) -> dict:
    """config.json fields BART and Marian write alike; `fields` are the family's own
    `require` values (its positions and embeddings)."""
    require(cfg, model_type, architecture="encoder_decoder", norm="layernorm",
            norm_position="post", norm_eps=NORM_EPS, use_bias=True, qkv_bias=False,
            sliding_window=None, num_kv_heads=cfg.num_heads,
            head_dim=cfg.d_model // cfg.num_heads, tie_embeddings=True, logits_bias=True,
            mlp_dropout_rate=cfg.mlp_dropout_rate, **fields)
    if cfg.activation not in HF_ACTIVATIONS:
        raise Inexpressible(f"{model_type} cannot express activation={cfg.activation!r}")
    if cfg.d_model % cfg.num_heads:
        raise Inexpressible(f"{model_type} needs num_heads={cfg.num_heads} to divide "
                            f"d_model={cfg.d_model}")
    return {
        "vocab_size": cfg.vocab_size, "d_model": cfg.d_model,
        "encoder_layers": cfg.num_encoder_layers, "decoder_layers": cfg.num_decoder_layers,
        "encoder_attention_heads": cfg.num_heads, "decoder_attention_heads": cfg.num_heads,
        "encoder_ffn_dim": cfg.mlp_dim, "decoder_ffn_dim": cfg.mlp_dim,
        "max_position_embeddings": cfg.max_len,
        "activation_function": HF_ACTIVATIONS[cfg.activation],
        "scale_embedding": cfg.scale_embeddings, "dropout": cfg.dropout_rate,
        "attention_dropout": cfg.attention_dropout_rate,
        "activation_dropout": cfg.mlp_dropout_rate, "encoder_layerdrop": 0.0,
        "decoder_layerdrop": 0.0, "is_encoder_decoder": True, "tie_word_embeddings": True,
        "decoder_start_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id,
        "pad_token_id": cfg.pad_id, "forced_eos_token_id": None,
    }


def config_from_hf(hf: dict) -> TransformerConfig:
    r = ConfigReader(hf, "bart")
    r.expect("normalize_embedding", True)
    r.expect("static_position_embeddings", False)
    r.expect("extra_pos_embeddings", 2)
    r.take("bos_token_id", None)               # the source's <s>: see the module docstring
    fields = read_common(r, default_act="gelu", default_eos=2)       # BartConfig's defaults
    cfg = TransformerConfig(
        **fields, positions="learned", position_offset=2, embedding_norm=True,
        share_embeddings=True, pad_id=r.take("pad_token_id", 1),
        bos_id=r.take("decoder_start_token_id", 2))
    r.finish()
    return cfg


def config_to_hf(cfg: TransformerConfig) -> dict:
    hf = common_to_hf(cfg, "bart", positions="learned", position_offset=2,
                      embedding_norm=True, share_embeddings=True)
    return {**hf, "bos_token_id": cfg.bos_id}


ATTENTION = Attention.apart("self_attn.{}_proj", o="out")
CROSS_ATTENTION = Attention.apart("encoder_attn.{}_proj", o="out")
MLP = Mlp(up="fc1", down="fc2")


def layer_rules(cfg: TransformerConfig) -> list[Rule]:
    """The encoder and decoder layers of BART and Marian (post-norm: each sublayer's norm
    is named after it), and the logits bias."""
    table = []
    for stack in ("encoder", "decoder"):
        layer = Scope.layers(f"model.{stack}.layers.{{i}}", stack)
        table += [*self_attention(cfg, layer, ATTENTION),
                  *norm(cfg, layer, "self_attn_layer_norm", "self_attention_norm")]
        if stack == "decoder":
            table += [*cross_attention(cfg, layer, CROSS_ATTENTION),
                      *norm(cfg, layer, "encoder_attn_layer_norm", "cross_attention_norm")]
        table += [*mlp(cfg, layer, MLP), *norm(cfg, layer, "final_layer_norm", "mlp_norm")]
    return table + logits_bias("final_logits_bias")


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
