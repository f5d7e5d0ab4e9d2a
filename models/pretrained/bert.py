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

Old checkpoints spell LayerNorm's weight and bias "gamma" and "beta" (`Family.renames`),
keep `position_ids` buffers (ignored) and a copy of the tied embedding and of the bias in
`cls.predictions.decoder` (`Family.copies`: they must equal the tensors read).
Special ids: pad `pad_token_id` (0 by default); BERT has no start or end token of its own
(bos and eos None unless config.json names them). Refused by name: another `hidden_act`,
`position_embedding_type` other than "absolute", a decoder (`is_decoder`,
`add_cross_attention`), an untied head, and heads of other classes (token classification,
question answering, ...). `roberta` (its own module) is this table with other positions.
"""

from __future__ import annotations

from models.config import TransformerConfig
from models.errors import UserError
from models.pretrained.family import ConfigReader, Family, Inexpressible, require
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
# Fields of older config.json files that transformers never reads (the original TF code's
# pooler description, text direction) or that only train (the classifier's dropout).
UNREAD_FIELDS = ("directionality", "pooler_fc_size", "pooler_num_attention_heads",
                 "pooler_num_fc_layers", "pooler_size_per_head", "pooler_type",
                 "classifier_dropout", "output_past")
# Old spellings of LayerNorm's parameters (TF-converted checkpoints).
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


def read_encoder(r: ConfigReader, name: str, default_pad: int | None) -> dict:
    """The TransformerConfig fields BERT and RoBERTa read alike (all but the positions'
    offset and max_len): sizes, post-norm LayerNorm layers with biases, an embedding norm,
    the activation, token types, dropout rates, the head, and the pad id."""
    act = r.take("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        r.refuse("hidden_act", act, f"supported: {sorted(ACTIVATIONS)}")
    r.expect("position_embedding_type", "absolute")
    r.expect("is_decoder", False)
    r.expect("add_cross_attention", False)
    r.expect("tie_word_embeddings", True)
    for key in UNREAD_FIELDS:
        r.take(key, None)
    labels = heads_of(r, name)
    return dict(
        architecture="encoder_only", vocab_size=r.take("vocab_size"),
        d_model=r.take("hidden_size"), num_heads=r.take("num_attention_heads"),
        mlp_dim=r.take("intermediate_size"), num_layers=r.take("num_hidden_layers"),
        positions="learned", norm="layernorm", norm_position="post",
        norm_eps=r.take("layer_norm_eps", 1e-12), activation=ACTIVATIONS[act], use_bias=True,
        tie_embeddings=True, scale_embeddings=False, embedding_norm=True,
        num_token_types=r.take("type_vocab_size", 2), num_labels=labels,
        label_names=label_names_of(r, labels),
        dropout_rate=float(r.take("hidden_dropout_prob", 0.1)),
        attention_dropout_rate=float(r.take("attention_probs_dropout_prob", 0.1)),
        pad_id=r.take("pad_token_id", None) if "pad_token_id" in r.hf else default_pad)


def encoder_to_hf(cfg: TransformerConfig, model_type: str, name: str, **fields) -> dict:
    """config.json fields BERT and RoBERTa write alike; `fields` are the family's own
    `require` values (its position offset). `architectures` follows the head."""
    require(cfg, model_type, architecture="encoder_only", positions="learned",
            norm="layernorm", norm_position="post", use_bias=True, qkv_bias=False,
            sliding_window=None, num_kv_heads=cfg.num_heads,
            head_dim=cfg.d_model // cfg.num_heads, tie_embeddings=True,
            scale_embeddings=False, embedding_norm=True, **fields)
    if cfg.activation not in HF_ACTIVATIONS:
        raise Inexpressible(f"{model_type} cannot express activation={cfg.activation!r}")
    if cfg.d_model % cfg.num_heads:
        raise Inexpressible(f"{model_type} needs num_heads={cfg.num_heads} to divide "
                            f"d_model={cfg.d_model}")
    if not cfg.num_token_types:
        raise Inexpressible(f"{model_type} always has token types (num_token_types=0)")
    hf = {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "intermediate_size": cfg.mlp_dim, "hidden_act": HF_ACTIVATIONS[cfg.activation],
        "hidden_dropout_prob": cfg.dropout_rate,
        "attention_probs_dropout_prob": cfg.attention_dropout_rate,
        "max_position_embeddings": cfg.max_len + cfg.position_offset,
        "type_vocab_size": cfg.num_token_types, "layer_norm_eps": cfg.norm_eps,
        "position_embedding_type": "absolute", "is_decoder": False,
        "add_cross_attention": False, "tie_word_embeddings": True,
        "pad_token_id": cfg.pad_id, "bos_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id,
        "architectures": [f"{name}ForMaskedLM"],
    }
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
    fields = read_encoder(r, "Bert", default_pad=0)
    cfg = TransformerConfig(**fields, max_len=r.take("max_position_embeddings", 512),
                            bos_id=r.take("bos_token_id", None),
                            eos_id=r.take("eos_token_id", None))
    r.finish()
    return cfg


def config_to_hf(cfg: TransformerConfig) -> dict:
    return encoder_to_hf(cfg, "bert", "Bert")


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
