"""`t5` (v1.0, v1.1 and FLAN-T5) and `mt5`: an encoder-decoder with T5's bucketed relative
position bias (one [buckets, N] table per stack, stored in its first block and shared by
all its layers; bidirectional buckets in the encoder, causal in the decoder), attention
logits not scaled by 1/sqrt(H), pre-norm RMSNorm without bias plus a final norm per stack,
no biases anywhere, head_dim `d_kv` (free of d_model / num_heads), one embedding table for
both stacks, and an MLP given by `feed_forward_proj`: "relu" (v1.0), "gated-gelu" (tanh
GELU, GeGLU: v1.1, FLAN-T5, mT5), "gated-silu" (SwiGLU), "gelu" (exact), "silu".

The head, following transformers v5:
- Tied or not is settled by the tensors (`config_from_weights`), not by config.json: the
  head is the embedding unless the file holds an `lm_head.weight` that differs from it
  (v5 writes `tie_word_embeddings: true` for every T5 and drops a tied head when saving;
  v4 files of v1.1 and mT5 hold their own head and say false).
- Its input is scaled by d_model ** -0.5 (our `scale_head_input`) as t5's
  `scale_decoder_outputs` says; a config.json without that field (written by transformers
  v4) scales unless `tie_word_embeddings` is false. mt5 never scales in v5.

Effective activation: transformers derives `dense_act_fn` and `is_gated_act` from
`feed_forward_proj`, but values stored in config.json override the derived ones, so they
are what we read too. Special ids: the decoder start token (`decoder_start_token_id`,
default the pad id) is our `bos_id`; pad 0 and eos 1 by default. T5 has no maximum length;
`max_len` is `n_positions` (512 when absent), written back as such.

Files may also hold `encoder.embed_tokens.weight` / `decoder.embed_tokens.weight` (copies
of `shared.weight`, which they stand in for when it is absent), and files written by
earlier versions of transformers' T5 an unused cross-attention position table in decoder
block 0 (skipped, as transformers does).
Refused by name: any other activation, a gated exact GELU, an encoder-only config, umT5
(its own model_type, a bias table in every layer) and config fields this module does not
know.
"""

from __future__ import annotations

import numpy as np

from models.config import TransformerConfig
from models.layers import GATED
from models.pretrained.config_map import DECODER_START, MULTI_HEAD, ConfigMap, Field, SpecialIds
from models.pretrained.family import ConfigReader, Family, Inexpressible
from models.pretrained.files import Weights
from models.pretrained.mapping import Rule
from models.pretrained.rules import (
    Attention,
    Mlp,
    Scope,
    cross_attention,
    embeddings,
    final_norm,
    mlp,
    norm,
    relative_bias,
    self_attention,
    untied_head,
)

# (dense_act_fn, is_gated_act) -> our activation; everything else is refused.
ACTIVATIONS = {("relu", False): "relu", ("gelu", False): "gelu_exact",
               ("gelu_new", False): "gelu", ("gelu_pytorch_tanh", False): "gelu",
               ("silu", False): "silu", ("swish", False): "silu",
               ("gelu_new", True): "geglu", ("gelu_pytorch_tanh", True): "geglu",
               ("silu", True): "swiglu", ("swish", True): "swiglu"}
# Ours -> (feed_forward_proj, dense_act_fn, is_gated_act) as transformers writes them.
HF_ACTIVATIONS = {"relu": ("relu", "relu", False), "gelu_exact": ("gelu", "gelu", False),
                  "gelu": ("gelu_new", "gelu_new", False), "silu": ("silu", "silu", False),
                  "geglu": ("gated-gelu", "gelu_new", True),
                  "swiglu": ("gated-silu", "silu", True)}
# The class defaults of the fields a config.json may leave out.
DEFAULTS = {
    "t5": dict(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8,
               feed_forward_proj="relu"),
    "mt5": dict(vocab_size=250112, d_model=512, d_kv=64, d_ff=1024, num_layers=8,
                num_heads=6, feed_forward_proj="gated-gelu"),
}
MAX_LEN = 512                        # T5's training length, when n_positions is absent
SHARED = "shared"                    # the one embedding table: both stacks' and a tied head's
EMBEDDING = f"{SHARED}.weight"
STACK_EMBEDDINGS = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
HEAD = "lm_head.weight"


def derived_activation(proj: str) -> tuple[str, bool] | None:
    """(dense_act_fn, is_gated_act) as transformers derives them from feed_forward_proj,
    or None for a value it rejects ("ACT" or "gated-ACT" only)."""
    parts = proj.split("-")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        return None
    if proj == "gated-gelu":                 # T5 v1.1's spelling of tanh GELU
        return "gelu_new", True
    return parts[-1], len(parts) == 2


def read_activation(r: ConfigReader, default: str) -> str:
    proj = r.take("feed_forward_proj", default)
    derived = derived_activation(proj) if isinstance(proj, str) else None
    if derived is None:
        r.refuse("feed_forward_proj", proj, "'ACT' or 'gated-ACT'")
    act, gated = r.take("dense_act_fn", derived[0]), r.take("is_gated_act", derived[1])
    if (act, gated) not in ACTIVATIONS:
        known = ", ".join(sorted({hf[0] for hf in HF_ACTIVATIONS.values()}))
        if (act, gated) == derived:
            r.refuse("feed_forward_proj", proj, f"supported: {known}")
        r.refuse("dense_act_fn", act, f"with is_gated_act={gated} (feed_forward_proj="
                 f"{proj!r}); supported: the activations of {known}")
    return ACTIVATIONS[act, gated]


def scales_head_input(r: ConfigReader, model_type: str) -> bool:
    tie = r.take("tie_word_embeddings", True)
    if model_type == "mt5":
        r.expect("scale_decoder_outputs", False)
        return False
    if "scale_decoder_outputs" in r.hf:     # written by v5 (null: not scaled either)
        return bool(r.take("scale_decoder_outputs", False))
    return tie is not False                   # v4: tied meant scaled


def config_map(model_type: str) -> ConfigMap:
    """The map of `t5` or `mt5`: the same fields with their class's defaults."""
    d = DEFAULTS[model_type]
    return ConfigMap(
        fields=(Field("vocab_size", "vocab_size", d["vocab_size"]),
                Field("d_model", "d_model", d["d_model"]),
                Field("num_heads", "num_heads", d["num_heads"]),
                Field("d_kv", "head_dim", d["d_kv"]), Field("d_ff", "mlp_dim", d["d_ff"]),
                Field("num_layers", "num_encoder_layers", d["num_layers"]),
                Field("n_positions", "max_len", MAX_LEN),
                Field("relative_attention_num_buckets", "relative_buckets", 32),
                Field("relative_attention_max_distance", "relative_max_distance", 128),
                Field("layer_norm_epsilon", "norm_eps", 1e-6),
                Field("dropout_rate", "dropout_rate", 0.1, float)),    # T5's one rate
        fixed=dict(architecture="encoder_decoder", positions="relative", norm="rmsnorm",
                   norm_position="pre", use_bias=False, qkv_bias=False, sliding_window=None,
                   num_kv_heads=MULTI_HEAD, share_embeddings=True, scale_embeddings=False,
                   scale_attention=False),
        constants=dict(is_encoder_decoder=True),
        unread=("initializer_factor", "classifier_dropout", "output_past"),  # init, heads
        ids=SpecialIds(pad=0, eos=1, start="pad", start_key=DECODER_START, null_is_none=True))


def reader(model_type: str):
    cmap = config_map(model_type)

    def config_from_hf(hf: dict) -> TransformerConfig:
        r = ConfigReader(hf, model_type)
        activation = read_activation(r, DEFAULTS[model_type]["feed_forward_proj"])
        scale = scales_head_input(r, model_type)
        fields = cmap.read(r)
        dropout = fields["dropout_rate"]
        cfg = TransformerConfig(
            **fields,
            num_decoder_layers=r.take("num_decoder_layers", fields["num_encoder_layers"]),
            activation=activation,
            # The tensors settle this (`config_from_weights`); config.json's guess first.
            tie_embeddings=r.hf.get("tie_word_embeddings") is not False,
            scale_head_input=scale, attention_dropout_rate=dropout, mlp_dropout_rate=dropout)
        r.finish()
        return cfg

    return config_from_hf


def writer(model_type: str):
    cmap = config_map(model_type)

    def config_to_hf(cfg: TransformerConfig) -> dict:
        hf = cmap.write(cfg, model_type,
                        scale_head_input=cfg.scale_head_input if model_type == "t5" else False,
                        # T5 has one dropout rate; the others are how a run trains, not what
                        # the model computes, so a fine-tune that changed one still saves.
                        mlp_dropout_rate=cfg.mlp_dropout_rate)
        if cfg.activation not in HF_ACTIVATIONS:
            raise Inexpressible(f"{model_type} cannot express activation={cfg.activation!r}")
        proj, act, gated = HF_ACTIVATIONS[cfg.activation]
        hf.update(num_decoder_layers=cfg.num_decoder_layers, feed_forward_proj=proj,
                  dense_act_fn=act, is_gated_act=gated,
                  # What transformers v4 reads as "tied and scaled" (v5 settles tying from
                  # the tensors: a head is written only when untied).
                  tie_word_embeddings=cfg.tie_embeddings)
        if model_type == "t5":
            hf["scale_decoder_outputs"] = cfg.scale_head_input
        return hf

    return config_to_hf


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal as transformers compares tied parameters (values in float32)."""
    return a.shape == b.shape and np.array_equal(a.astype(np.float32), b.astype(np.float32))


def config_from_weights(cfg: TransformerConfig, weights: Weights) -> TransformerConfig:
    """Tied unless the file holds an `lm_head.weight` that differs from the embedding (as
    transformers v5 decides when loading). The first rows are compared first, so a head
    of its own is told apart without reading both tables whole."""
    keys = weights.keys()
    embedding = next((k for k in (EMBEDDING, *STACK_EMBEDDINGS) if k in keys), None)
    if HEAD not in keys:
        tied = True
    elif embedding is None or weights.shape(HEAD) != weights.shape(embedding):
        tied = False       # a missing or misshapen embedding is named when reading
    else:
        tied = (_equal(weights.read_rows(HEAD, 1), weights.read_rows(embedding, 1))
                and _equal(weights.read(HEAD), weights.read(embedding)))
    return cfg.replace(tie_embeddings=tied)


def _layer(stack: str) -> Scope:
    return Scope.layers(f"{stack}.block.{{i}}.layer", stack)


def _mlp(cfg: TransformerConfig, stack: str, sub: int) -> list[Rule]:
    """Sublayer `sub` of each block: the MLP (wi_0 gates wi_1 when gated) and its norm."""
    ff = f"{sub}.DenseReluDense"
    names = (Mlp(gate=f"{ff}.wi_0", up=f"{ff}.wi_1", down=f"{ff}.wo") if cfg.activation
             in GATED else Mlp(up=f"{ff}.wi", down=f"{ff}.wo"))
    return [*mlp(cfg, _layer(stack), names),
            *norm(cfg, _layer(stack), f"{sub}.layer_norm", "mlp_norm")]


def rules(cfg: TransformerConfig) -> list[Rule]:
    """Each block's sublayers are numbered: 0 self-attention, then (decoder) 1
    cross-attention, then the MLP; each with its (pre-)norm. The relative position bias
    table is held by the first block's self-attention."""
    table = embeddings(cfg, stack="encoder", tokens=SHARED)
    for stack in ("encoder", "decoder"):
        table += [*relative_bias(stack, f"{stack}.block.0.layer.0.SelfAttention."
                                        "relative_attention_bias"),
                  *self_attention(cfg, _layer(stack), Attention.apart("0.SelfAttention.{}")),
                  *norm(cfg, _layer(stack), "0.layer_norm", "self_attention_norm"),
                  *final_norm(cfg, stack, f"{stack}.final_layer_norm")]
    table += [*_mlp(cfg, "encoder", 1),
              *cross_attention(cfg, _layer("decoder"), Attention.apart("1.EncDecAttention.{}")),
              *norm(cfg, _layer("decoder"), "1.layer_norm", "cross_attention_norm"),
              *_mlp(cfg, "decoder", 2)]
    return table + untied_head(cfg)


def family(model_type: str, architecture: str) -> Family:
    return Family(
        model_type=model_type, architectures=(architecture,),
        config_from_hf=reader(model_type), config_to_hf=writer(model_type), rules=rules,
        copies={EMBEDDING: STACK_EMBEDDINGS}, config_from_weights=config_from_weights,
        # Files of earlier versions of transformers' T5: a cross-attention position table
        # nothing reads.
        ignored=(r"decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight",))


FAMILY = family("t5", "T5ForConditionalGeneration")
MT5_FAMILY = family("mt5", "MT5ForConditionalGeneration")
