"""`modernbert` (ModernBERT, 2024: ModernBertForMaskedLM, ModernBertForSequenceClassification,
ModernBertModel): a pre-norm encoder-only stack with RoPE, alternating global and local
layers, GeGLU and no biases.

- Embeddings: the token table, then a LayerNorm without bias (`norm_bias`, every norm's);
  no positions (RoPE in the attention), no token types.
- Layers: the first reads its input without a norm (`first_attention_norm=False`); fused
  `attn.Wqkv` (split into our query/key/value, fused again on save) and `attn.Wo`; a
  global layer every `global_attn_every_n_layers` (layer 0 first; or `layer_types`) with
  RoPE at the full base, the others local: each token sees the positions within
  `local_attention` // 2 on either side, RoPE at the local base (`rope_parameters` per
  kind, or v4's `global_rope_theta` / `local_rope_theta`); the MLP's fused `Wi` is the
  GeGLU's gated input then its up projection (`hidden_activation` gelu: erf GELU).
- Heads: the masked-LM head's `head.dense` (bias as `classifier_bias`), the activation,
  `head.norm`, then the tied token table plus `decoder.bias`; the classifier pools the first
  token (`classifier_pooling` "cls") or the mean of the real tokens ("mean"), applies the
  same kind of head, then `classifier`.
`architectures` names the head (see `bert.heads_of`); a file with `classifier.weight`
classifies. The special ids: pad 50283, cls (our bos) 50281, sep (our eos) 50282.

Refused by name: biases on the attention but not the MLP (or the reverse), a head activation
other than the layers', another RoPE type, layer kinds other than full and sliding
attention, `decoder_bias` false, an untied head. Dropouts train only and are not read;
the sparse-prediction and flash-attention switches change nothing computed.
"""

from __future__ import annotations

from models.config import TransformerConfig
from models.pretrained import bert
from models.pretrained.config_map import D_OVER_N, MULTI_HEAD, ConfigMap, Field, SpecialIds
from models.pretrained.family import ConfigReader, Family, Inexpressible
from models.pretrained.mapping import Rule
from models.pretrained.rules import (
    ROOT,
    Attention,
    Mlp,
    Scope,
    embeddings,
    final_norm,
    linear,
    mlp,
    norm,
    self_attention,
)

FIELDS = (
    Field("vocab_size", "vocab_size", 50368), Field("hidden_size", "d_model", 768),
    Field("num_attention_heads", "num_heads", 12), Field("intermediate_size", "mlp_dim", 1152),
    Field("num_hidden_layers", "num_layers", 22),
    Field("max_position_embeddings", "max_len", 8192), Field("norm_eps", "norm_eps", 1e-5),
    Field("attention_dropout", "attention_dropout_rate", 0.0, float))
MAP = ConfigMap(
    fields=FIELDS,
    fixed=dict(architecture="encoder_only", positions="rope", norm="layernorm",
               norm_position="pre", norm_bias=False, first_attention_norm=False,
               num_kv_heads=MULTI_HEAD, head_dim=D_OVER_N, tie_embeddings=True,
               scale_embeddings=False, embedding_norm=True, num_token_types=0,
               classifier_head="transform", qkv_bias=False, dropout_rate=0.0),
    constants=dict(norm_bias=False, decoder_bias=True, tie_word_embeddings=True),
    unread=("initializer_cutoff_factor", "deterministic_flash_attn", "sparse_prediction",
            "sparse_pred_ignore_index", "reference_compile", "repad_logits_with_grad",
            "embedding_dropout", "mlp_dropout", "classifier_dropout", "cls_token_id",
            "sep_token_id"),
    ids=SpecialIds(pad=50283, eos=50282, start=50281))
ACTIVATIONS = {"gelu": "geglu_exact", "gelu_pytorch_tanh": "geglu", "gelu_new": "geglu",
               "silu": "swiglu"}
HF_ACTIVATIONS = {"geglu_exact": "gelu", "geglu": "gelu_pytorch_tanh", "swiglu": "silu"}
POOLING = {"cls": "first", "mean": "mean"}
KINDS = {"full_attention": "full", "sliding_attention": "sliding"}


def _thetas(r: ConfigReader) -> tuple[float, float]:
    """(the global layers' RoPE base, the local layers') from v5's per-kind
    `rope_parameters` or v4's `global_rope_theta` / `local_rope_theta`."""
    given = r.take("rope_parameters", None) or {}
    old = (r.take("global_rope_theta", 160_000.0), r.take("local_rope_theta", 10_000.0))
    thetas = []
    for kind, default in zip(("full_attention", "sliding_attention"), old, strict=True):
        params = dict(given.get(kind) or {})
        if params.pop("rope_type", "default") != "default" or set(params) - {"rope_theta"}:
            r.refuse("rope_parameters", given, "the default RoPE with a base per layer kind")
        thetas.append(float(params.get("rope_theta", default)))
    return thetas[0], thetas[1]


def config_from_hf(hf: dict) -> TransformerConfig:
    r = ConfigReader(hf, "modernbert")
    act = r.take("hidden_activation", "gelu")
    if act not in ACTIVATIONS:
        r.refuse("hidden_activation", act, f"supported: {sorted(ACTIVATIONS)}")
    head_act = r.take("classifier_activation", "gelu")
    if head_act != act:
        r.refuse("classifier_activation", head_act, f"the layers' hidden_activation {act!r}")
    biases = {k: bool(r.take(k, False)) for k in ("attention_bias", "mlp_bias")}
    if len(set(biases.values())) > 1:
        r.refuse("mlp_bias", biases["mlp_bias"], f"biases on the attention and the MLP "
                 f"together (attention_bias={biases['attention_bias']})")
    head_bias = bool(r.take("classifier_bias", False))
    pooling = r.take("classifier_pooling", "cls")
    if pooling not in POOLING:
        r.refuse("classifier_pooling", pooling, f"one of {sorted(POOLING)}")
    fields = MAP.read(r)
    layers = fields["num_layers"]
    every = r.take("global_attn_every_n_layers", 3)
    kinds = r.take("layer_types", None) or [
        "full_attention" if i % every == 0 else "sliding_attention" for i in range(layers)]
    if not isinstance(kinds, list) or len(kinds) != layers or not set(kinds) <= set(KINDS):
        r.refuse("layer_types", kinds, f"one of {tuple(KINDS)} for each of the {layers} "
                 "layers")
    local = r.take("local_attention", 128)
    r.take("sliding_window", None)                 # transformers' local_attention // 2
    full, sliding = _thetas(r)
    labels = bert.heads_of(r, "ModernBert")
    cfg = TransformerConfig(
        **fields, activation=ACTIVATIONS[act], use_bias=biases["attention_bias"],
        head_bias=head_bias,
        layer_types=tuple(KINDS[k] for k in kinds), sliding_window=local // 2,
        rope_theta=full, rope_local_theta=sliding, classifier_pooling=POOLING[pooling],
        num_labels=labels, label_names=bert.label_names_of(r, labels))
    r.finish()
    return cfg


def config_to_hf(cfg: TransformerConfig) -> dict:
    if cfg.activation not in HF_ACTIVATIONS or not cfg.layer_types or (
            cfg.rope_scaling is not None or cfg.rope_local_theta is None):
        raise Inexpressible("modernbert expresses GeGLU or SwiGLU layers of global and local "
                            "kinds, each kind with its own unscaled RoPE base")
    hf = MAP.write(cfg, "modernbert", activation=cfg.activation, use_bias=cfg.use_bias,
                   head_bias=cfg.head_bias,
                   layer_types=cfg.layer_types, sliding_window=cfg.sliding_window,
                   rope_theta=cfg.rope_theta, rope_local_theta=cfg.rope_local_theta,
                   classifier_pooling=cfg.classifier_pooling, num_labels=cfg.num_labels,
                   label_names=cfg.label_names)
    act = HF_ACTIVATIONS[cfg.activation]
    hf.update(hidden_activation=act, classifier_activation=act, attention_bias=cfg.use_bias,
              mlp_bias=cfg.use_bias, classifier_bias=cfg.head_bias,
              layer_types=[{v: k for k, v in KINDS.items()}[k] for k in cfg.layer_types],
              local_attention=2 * cfg.sliding_window,
              rope_parameters={
                  "full_attention": {"rope_type": "default", "rope_theta": cfg.rope_theta},
                  "sliding_attention": {"rope_type": "default",
                                        "rope_theta": cfg.rope_local_theta}},
              classifier_pooling={v: k for k, v in POOLING.items()}[cfg.classifier_pooling],
              architectures=["ModernBertForMaskedLM"])
    if cfg.num_labels:
        labels = cfg.label_names or bert.default_label_names(cfg.num_labels)
        hf.update(architectures=["ModernBertForSequenceClassification"],
                  id2label={str(i): label for i, label in enumerate(labels)},
                  label2id={label: i for i, label in enumerate(labels)})
    return hf


LAYER = Scope.layers("model.layers.{i}", "encoder")


def rules(cfg: TransformerConfig) -> list[Rule]:
    table = [*embeddings(cfg, tokens="model.embeddings.tok_embeddings",
                         embedding_norm="model.embeddings.norm"),
             *self_attention(cfg, LAYER, Attention(qkv="attn.Wqkv", o="attn.Wo")),
             *mlp(cfg, LAYER, Mlp(gate_up="mlp.Wi", down="mlp.Wo")),
             *norm(cfg, LAYER, "mlp_norm", "mlp_norm"),
             *(r for i in range(1, cfg.num_layers)       # layer 0 reads its input unnormed
               for r in norm(cfg, ROOT, f"model.layers.{i}.attn_norm",
                             f"encoder/layer_{i}/self_attention_norm")),
             *final_norm(cfg, "encoder", "model.final_norm")]
    head = "classifier" if cfg.num_labels else "mlm_head"
    table += [*linear(ROOT, "head.dense", f"{head}/transform", bias=cfg.head_bias),
              *norm(cfg, ROOT, "head.norm", f"{head}/norm")]
    if cfg.num_labels:
        return table + linear(ROOT, "classifier", "classifier/classifier", bias=True)
    return table + [Rule("decoder.bias", "mlm_head/bias")]


FAMILY = Family(
    model_type="modernbert", architectures=("ModernBertForMaskedLM",),
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, rules=rules, prefix="model.",
    copies={"model.embeddings.tok_embeddings.weight": ("decoder.weight",)},
    config_from_weights=lambda cfg, w: bert.labels_from_weights(cfg, w, "classifier.weight"),
    optional_heads={"head.": "the head's transform", "decoder.": "the masked-LM bias",
                    "classifier.": "the classifier"})
