"""`bert`: an encoder-only stack (`models.encoder_only`) with word + learned position +
token-type embeddings, a LayerNorm on their sum (eps `layer_norm_eps`, as every norm),
post-norm layers with biases, exact (erf) GELU by default, and one of two heads, as the
checkpoint's class has it:

    BertForMaskedLM                  cls.predictions: transform.dense, the activation,
    (BertForPreTraining, BertModel)  transform.LayerNorm, then the tied word embeddings
                                     plus cls.predictions.bias        -> num_labels 0
    BertForSequenceClassification    bert.pooler.dense + tanh of the first token, then
                                     classifier (C rows)              -> num_labels C

`architectures` names the class; the tensors settle the head where they can
(`config_from_weights`): a file with `classifier.weight` classifies with its rows as labels
(config.json's id2label is written for every BERT, so it cannot tell). A base model saved
alone (BertModel: no cls.* tensors) loads as a masked-LM model whose head is newly
initialised, with a warning naming it; its pooler (and a pre-training file's next-sentence
head) are skipped with a warning too. `problem_type` picks the training loss only.

Checkpoints converted from the original TensorFlow BERT spell LayerNorm's weight and bias
"gamma" and "beta" (`Family.renames`); files may keep `position_ids` buffers (ignored) and
a copy of the tied embedding and of the bias in `cls.predictions.decoder`
(`Family.copies`: they must equal the tensors read).
Special ids: pad `pad_token_id` (0 by default); BERT has no start or end token of its own
(bos and eos None unless config.json names them). Refused by name: another `hidden_act`,
`position_embedding_type` other than "absolute", a decoder (`is_decoder`,
`add_cross_attention`), an untied head, and heads of other classes (token classification,
question answering, ...). `roberta` (its own module) is this table with other positions.
"""

from __future__ import annotations

from models.config import TransformerConfig
from models.errors import UserError
from models.pretrained.config_map import D_OVER_N, MULTI_HEAD, ConfigMap, Field, SpecialIds
from models.pretrained.family import ConfigReader, Family, Inexpressible
from models.pretrained.files import Weights
from models.pretrained.mapping import Rule
from models.pretrained.rules import (
    Attention,
    Mlp,
    Scope,
    classifier,
    embeddings,
    mlm_head,
    mlp,
    norm,
    self_attention,
)

ACTIVATIONS = {"gelu": "gelu_exact", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu",
               "relu": "relu"}
HF_ACTIVATIONS = {"gelu_exact": "gelu", "gelu": "gelu_new", "relu": "relu"}
# Fields that config.json files converted from the original TensorFlow BERT hold and
# transformers never reads (that code's pooler description, the text direction), or that
# only train (the classifier's dropout).
UNREAD_FIELDS = ("directionality", "pooler_fc_size", "pooler_num_attention_heads",
                 "pooler_num_fc_layers", "pooler_size_per_head", "pooler_type",
                 "classifier_dropout", "output_past")
# LayerNorm's parameters as checkpoints converted from TensorFlow spell them.
RENAMES = ((r"(LayerNorm|layer_norm)\.gamma$", r"\1.weight"),
           (r"(LayerNorm|layer_norm)\.beta$", r"\1.bias"))


def heads_of(r: ConfigReader, name: str) -> int:
    """num_labels as `architectures` says ("Bert" or "Roberta" classes): 0 for the
    masked-LM model, the pre-training model and the base model, C (id2label's size) for
    sequence classification; every other class is refused by name."""
    archs = r.take("architectures", None) or []
    labels = set()
    for arch in archs:
        if arch in (f"{name}ForMaskedLM", f"{name}ForPreTraining", f"{name}Model"):
            labels.add(0)
        elif arch == f"{name}ForSequenceClassification":
            id2label = r.hf.get("id2label")
            labels.add(len(id2label) if id2label else int(r.hf.get("num_labels", 2)))
        else:
            r.refuse("architectures", archs, f"supported: {name}ForMaskedLM, "
                     f"{name}ForSequenceClassification, {name}ForPreTraining, {name}Model")
    if len(labels) > 1:
        r.refuse("architectures", archs, "one head: a masked-LM model or a classifier")
    return labels.pop() if labels else 0


def label_names_of(r: ConfigReader, num_labels: int) -> tuple[str, ...]:
    """A classifier's label names from id2label, class 0 first; () when there is no
    classifier or the names are transformers' defaults (LABEL_0, LABEL_1, ...)."""
    id2label = r.hf.get("id2label") or {}
    if not num_labels or len(id2label) != num_labels:
        return ()
    try:
        names = tuple(str(id2label[key]) for key in sorted(id2label, key=int))
    except ValueError:
        r.refuse("id2label", id2label, "keys must be the integers 0 .. num_labels - 1")
    if sorted(int(k) for k in id2label) != list(range(num_labels)):
        r.refuse("id2label", id2label, "keys must be the integers 0 .. num_labels - 1")
    return () if names == default_label_names(num_labels) else names


def default_label_names(num_labels: int) -> tuple[str, ...]:
    return tuple(f"LABEL_{i}" for i in range(num_labels))


FIELDS = (
    Field("vocab_size", "vocab_size"), Field("hidden_size", "d_model"),
    Field("num_attention_heads", "num_heads"), Field("intermediate_size", "mlp_dim"),
    Field("num_hidden_layers", "num_layers"), Field("layer_norm_eps", "norm_eps", 1e-12),
    Field("type_vocab_size", "num_token_types", 2),
    Field("hidden_dropout_prob", "dropout_rate", 0.1, float),
    Field("attention_probs_dropout_prob", "attention_dropout_rate", 0.1, float))
MAP = ConfigMap(
    fields=FIELDS,
    fixed=dict(architecture="encoder_only", positions="learned", norm="layernorm",
               norm_position="post", use_bias=True, qkv_bias=False, sliding_window=None,
               num_kv_heads=MULTI_HEAD, head_dim=D_OVER_N, tie_embeddings=True,
               scale_embeddings=False, embedding_norm=True),
    constants=dict(position_embedding_type="absolute", is_decoder=False,
                   add_cross_attention=False, tie_word_embeddings=True),
    unread=UNREAD_FIELDS,
    ids=SpecialIds(pad=0, null_is_none=True))


def read_encoder(r: ConfigReader, name: str, cmap: ConfigMap) -> dict:
    """The TransformerConfig fields of BERT or RoBERTa (`cmap`, its map; `name`, its class
    names' prefix) but the positions' offset and max_len: the map's, the activation and
    the head."""
    act = r.take("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        r.refuse("hidden_act", act, f"supported: {sorted(ACTIVATIONS)}")
    fields = cmap.read(r)
    labels = heads_of(r, name)
    return {**fields, "activation": ACTIVATIONS[act], "num_labels": labels,
            "label_names": label_names_of(r, labels)}


def encoder_to_hf(cfg: TransformerConfig, model_type: str, name: str, *, cmap: ConfigMap,
                  **required) -> dict:
    """config.json of a BERT or RoBERTa config (`cmap`, its map; `required`, values the
    family computes: its position offset). `architectures` follows the head."""
    hf = cmap.write(cfg, model_type, **required)
    if cfg.activation not in HF_ACTIVATIONS:
        raise Inexpressible(f"{model_type} cannot express activation={cfg.activation!r}")
    if cfg.d_model % cfg.num_heads:
        raise Inexpressible(f"{model_type} needs num_heads={cfg.num_heads} to divide "
                            f"d_model={cfg.d_model}")
    if not cfg.num_token_types:
        raise Inexpressible(f"{model_type} always has token types (num_token_types=0)")
    hf.update(hidden_act=HF_ACTIVATIONS[cfg.activation],
              max_position_embeddings=cfg.max_len + cfg.position_offset,
              architectures=[f"{name}ForMaskedLM"])
    if cfg.num_labels:
        labels = cfg.label_names or default_label_names(cfg.num_labels)
        hf.update(architectures=[f"{name}ForSequenceClassification"],
                  id2label={str(i): label for i, label in enumerate(labels)},
                  label2id={label: i for i, label in enumerate(labels)})
    return hf


def labels_from_weights(cfg: TransformerConfig, weights: Weights, key: str) -> TransformerConfig:
    """A classifier when the file holds its output layer `key` (a torch Linear [C, D]), with
    C labels; otherwise what `architectures` said (a classifier missing from the file is
    then newly initialised)."""
    keys = weights.keys()
    if key not in keys:
        return cfg
    rows = weights.shape(key)[0]
    if cfg.num_labels and rows != cfg.num_labels:
        raise UserError(f"checkpoint {weights.directory}: {key} has {rows} rows, but "
                         f"config.json's id2label names {cfg.num_labels} labels")
    return cfg.replace(num_labels=rows)


def config_from_hf(hf: dict) -> TransformerConfig:
    r = ConfigReader(hf, "bert")
    cfg = TransformerConfig(**read_encoder(r, "Bert", MAP),
                            max_len=r.take("max_position_embeddings", 512))
    r.finish()
    return cfg


def config_to_hf(cfg: TransformerConfig) -> dict:
    return encoder_to_hf(cfg, "bert", "Bert", cmap=MAP)


ATTENTION = Attention(q="attention.self.query", k="attention.self.key",
                      v="attention.self.value", o="attention.output.dense")
MLP = Mlp(up="intermediate.dense", down="output.dense")


def encoder_rules(cfg: TransformerConfig, base: str) -> list[Rule]:
    """The embeddings and layers of BERT and RoBERTa under `base` ("bert", "roberta"):
    post-norm LayerNorms after attention (`attention.output.LayerNorm`) and after the MLP
    (`output.LayerNorm`)."""
    layer = Scope.layers(f"{base}.encoder.layer.{{i}}", "encoder")
    e = f"{base}.embeddings"
    return [*embeddings(cfg, tokens=f"{e}.word_embeddings", positions=f"{e}.position_embeddings",
                        token_types=f"{e}.token_type_embeddings",
                        embedding_norm=f"{e}.LayerNorm"),
            *self_attention(cfg, layer, ATTENTION),
            *norm(cfg, layer, "attention.output.LayerNorm", "self_attention_norm"),
            *mlp(cfg, layer, MLP), *norm(cfg, layer, "output.LayerNorm", "mlp_norm")]


def rules(cfg: TransformerConfig) -> list[Rule]:
    if cfg.num_labels:
        head = classifier(pooler="bert.pooler.dense", out="classifier")
    else:
        head = mlm_head(cfg, transform="cls.predictions.transform.dense",
                        transform_norm="cls.predictions.transform.LayerNorm",
                        bias="cls.predictions.bias")
    return encoder_rules(cfg, "bert") + head


FAMILY = Family(
    model_type="bert", architectures=("BertForMaskedLM",), config_from_hf=config_from_hf,
    config_to_hf=config_to_hf, rules=rules, prefix="bert.",
    copies={"bert.embeddings.word_embeddings.weight": ("cls.predictions.decoder.weight",),
            "cls.predictions.bias": ("cls.predictions.decoder.bias",)},
    config_from_weights=lambda cfg, w: labels_from_weights(cfg, w, "classifier.weight"),
    renames=RENAMES,
    optional_heads={"cls.predictions.": "the masked-LM head", "bert.pooler.": "the pooler",
                    "classifier.": "the classifier"},
    skipped=(r"(bert\.)?pooler\.dense\.(weight|bias)", r"cls\..*"),
    ignored=(r"(bert\.)?embeddings\.(position_ids|token_type_ids)",))
