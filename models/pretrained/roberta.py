"""`roberta`: BERT's table (`bert`) with positions that start after the pad id, one token
type in published checkpoints (`type_vocab_size` 1, read as given), and its own heads:

    RobertaForMaskedLM                 lm_head: dense, exact GELU (whatever `hidden_act`
                                       says), layer_norm, the tied word embeddings plus
                                       lm_head.bias                     -> num_labels 0
    RobertaForSequenceClassification   classifier.dense + tanh of the first token (<s>),
                                       then classifier.out_proj (C rows) -> num_labels C
                                       (our classifier/pooler and classifier/classifier)

Positions: transformers numbers the tokens that are not `pad_token_id` from pad + 1 on (the
pad tokens keep row pad). Ours are 0 .. n-1 plus `position_offset` = pad + 1, so a
right-padded row (whose real tokens never equal the pad id, as a tokenizer makes them)
reads the same rows at its real positions; a pad id inside the text, or left padding,
would shift transformers' positions and not ours. `max_len` is max_position_embeddings
- (pad + 1) (512 for roberta-base's 514).

Files may hold copies of the tied embedding and bias (`lm_head.decoder.weight`,
`lm_head.decoder.bias`) and a pooler that neither head uses (skipped, with a warning). A
base model saved alone loads with a new masked-LM head, as `bert` does. Special ids: pad 1,
bos 0, eos 2 by default. Refused by name, beyond what `bert` refuses: a masked-LM model
whose `hidden_act` is not "gelu" (its head would still use exact GELU, ours the config's
activation) and a config without a pad id (the positions' offset).
"""

from __future__ import annotations

import dataclasses

from models.config import TransformerConfig
from models.errors import UserError
from models.pretrained.bert import (
    MAP as BERT_MAP,
    RENAMES,
    encoder_rules,
    encoder_to_hf,
    labels_from_weights,
    read_encoder,
)
from models.pretrained.config_map import SpecialIds
from models.pretrained.family import ConfigReader, Family, Inexpressible
from models.pretrained.files import Weights
from models.pretrained.rules import classifier, mlm_head

# BERT's map with RobertaConfig's special ids.
MAP = dataclasses.replace(BERT_MAP, ids=SpecialIds(pad=1, eos=2, start=0, null_is_none=True))


def _check_head_activation(cfg: TransformerConfig, act: str | None = None) -> None:
    """RobertaLMHead applies exact GELU whatever hidden_act is; our head applies the config's
    activation, so a masked-LM RoBERTa must use exact GELU throughout."""
    if not cfg.num_labels and cfg.activation != "gelu_exact":
        raise UserError(
            f"roberta config.json: hidden_act={act or cfg.activation!r} is not supported for "
            "a masked-LM model (RobertaLMHead applies exact GELU, 'gelu', whatever hidden_act "
            "says, and this project's head applies the layers' activation)")


def config_from_hf(hf: dict) -> TransformerConfig:
    r = ConfigReader(hf, "roberta")
    fields = read_encoder(r, "Roberta", MAP)
    pad = fields["pad_id"]
    if pad is None:
        r.refuse("pad_token_id", None, "RoBERTa's positions start after the pad id")
    max_positions = r.take("max_position_embeddings", 512)
    if max_positions <= pad + 1:
        r.refuse("max_position_embeddings", max_positions,
                 f"positions start at pad_token_id + 1 = {pad + 1}")
    cfg = TransformerConfig(**fields, max_len=max_positions - pad - 1, position_offset=pad + 1)
    r.finish()
    if "RobertaForMaskedLM" in (hf.get("architectures") or ()):
        _check_head_activation(cfg, hf.get("hidden_act"))
    return cfg


def config_from_weights(cfg: TransformerConfig, weights: Weights) -> TransformerConfig:
    cfg = labels_from_weights(cfg, weights, "classifier.out_proj.weight")
    _check_head_activation(cfg)
    return cfg


def config_to_hf(cfg: TransformerConfig) -> dict:
    if cfg.pad_id is None:
        raise Inexpressible("roberta needs a pad id (its positions start after it)")
    if not cfg.num_labels and cfg.activation != "gelu_exact":
        raise Inexpressible(f"roberta's masked-LM head uses exact GELU; this config's "
                            f"activation is {cfg.activation!r}")
    return encoder_to_hf(cfg, "roberta", "Roberta", cmap=MAP, position_offset=cfg.pad_id + 1)


def rules(cfg: TransformerConfig) -> list:
    if cfg.num_labels:
        head = classifier(pooler="classifier.dense", out="classifier.out_proj")
    else:
        head = mlm_head(cfg, transform="lm_head.dense", transform_norm="lm_head.layer_norm",
                        bias="lm_head.bias")
    return encoder_rules(cfg, "roberta") + head


FAMILY = Family(
    model_type="roberta", architectures=("RobertaForMaskedLM",),
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, rules=rules, prefix="roberta.",
    copies={"roberta.embeddings.word_embeddings.weight": ("lm_head.decoder.weight",),
            "lm_head.bias": ("lm_head.decoder.bias",)},
    config_from_weights=config_from_weights, renames=RENAMES,
    optional_heads={"lm_head.": "the masked-LM head", "classifier.": "the classifier"},
    skipped=(r"(roberta\.)?pooler\.dense\.(weight|bias)", r"lm_head\..*"),
    ignored=(r"(roberta\.)?embeddings\.(position_ids|token_type_ids)",))
