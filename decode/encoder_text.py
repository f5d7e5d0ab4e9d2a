"""Encoder-only models on text: fill in masks, classify, with a model's own tokenizer.

The text level over `decode.encoder`'s lists of token ids:

    pre = models.load("path/to/bert")
    decode.fill_mask_text(pre, ["The cat sat on the [MASK] ."], top_k=3)
    # [[[("mat", 0.41), ("floor", 0.20), ("rug", 0.10)]]]   per text, per mask, per filler
    decode.classify_text(pre, ["a fine film"])
    # [Classified(label="pos", probability=0.93, distribution={"neg": 0.07, "pos": 0.93})]

Texts are read as training reads them, `tokenizer.encode(text, add_special_tokens=True)`
(BERT's `[CLS] x [SEP]`, RoBERTa's `<s> x </s>`). Every mistake is a UserError that names
the value and the limit: a tokenizer without a mask token, a text without one, a text
longer than max_len (in tokens, special tokens included), and `decode.encoder`'s own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from decode.encoder import (
    CLASSIFY,
    FILL_MASK,
    check_head,
    check_top_k,
    classify_lists,
    fill_mask_lists,
    label_names,
)
from models.config import TransformerConfig
from models.errors import UserError


class Classified(NamedTuple):
    """One text's classification (`classify_text`).

    Attributes:
        label: the likeliest label's name (config.label_names, else "LABEL_i").
        probability: its probability.
        distribution: every label's probability, in class order {name: probability}.
    """

    label: str
    probability: float
    distribution: dict[str, float]


def _shown(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit - 3] + "...")


def mask_token_of(tokenizer, where: str = "this model") -> tuple[int, str]:
    """(mask id, its spelling in text) of `tokenizer`.

    Raises:
        UserError: "the tokenizer of WHERE has no mask token; fill-mask needs one" (or
            "WHERE has no tokenizer" when `tokenizer` is None).
    """
    if tokenizer is None:
        raise UserError(f"{where} has no tokenizer; fill-mask needs one with a mask token")
    if tokenizer.mask_id is None:
        raise UserError(f"the tokenizer of {where} has no mask token; fill-mask needs one")
    return tokenizer.mask_id, tokenizer.mask_token


def encode_text(tokenizer, config: TransformerConfig, text: str, *, name: str = "text",
                need_mask: bool = False) -> list[int]:
    """`tokenizer.encode(text, add_special_tokens=True)`, checked for the model:

        "The cat sat on the [MASK] ."  ->  [CLS] the cat sat on the [MASK] . [SEP]

    Raises:
        UserError: `name` with the text when it holds no mask token (with `need_mask`),
            `name` with its length in tokens and max_len when it is longer.
    """
    ids = tokenizer.encode(text, add_special_tokens=True)
    if need_mask and tokenizer.mask_id not in ids:
        raise UserError(f"{name} {_shown(text)} has no mask token {tokenizer.mask_token!r}: "
                         "write it where a token is to be filled in")
    if not ids:
        raise UserError(f"{name} {_shown(text)} gives no tokens")
    if len(ids) > config.max_len:
        raise UserError(f"{name} is {len(ids)} tokens long (special tokens included); the "
                         f"model takes at most {config.max_len} (max_len)")
    return ids


def token_strings(tokenizer, ids: Sequence[int]) -> list[str]:
    """How each id reads alone: its text (`decode([id])`, outer spaces stripped, as
    transformers' fill-mask pipeline shows it), or its piece when that text is empty, not
    valid UTF-8 on its own or not printable (special tokens, a lone byte, a control
    character): "mat", "[SEP]", "<0xC3>", "<0x17>"."""
    out = []
    for i, piece in zip(ids, tokenizer.id_to_piece(ids), strict=True):
        text = tokenizer.decode([i]).strip()
        out.append(text if text and text.isprintable() and "\ufffd" not in text else piece)
    return out


def fill_mask_text(pre, texts: Sequence[str], *, top_k: int = 5,
                   batch_size: int = 16) -> list[list[list[tuple[str, float]]]]:
    """The `top_k` fillers of every mask token in each text.

        fill_mask_text(pre, ["The cat sat on the [MASK] .", "[MASK] and [MASK]"], top_k=2)
        # [[[("mat", 0.41), ("floor", 0.2)]],
        #  [[("salt", 0.3), ("bread", 0.1)], [("pepper", 0.5), ("butter", 0.1)]]]

    Args:
        pre: a `models.load(...)` result (anything with `.model`, `.params`, `.tokenizer`),
            an encoder-only masked-LM model whose tokenizer has a mask token ("[MASK]",
            "<mask>").
        texts: each with at least one mask token, as the tokenizer writes it.
        top_k: fillers per mask, in [1, vocab_size].
        batch_size: texts run together.

    Returns:
        Per text, per mask (in order), the k (token string, probability) pairs, best first;
        token strings as `token_strings` gives them.

    Raises:
        UserError: a classifier; a tokenizer without a mask token; texts[i] without one
            (naming it and the token); texts[i] longer than max_len (both numbers); top_k.
    """
    cfg = pre.model.config
    check_head(cfg, FILL_MASK)
    check_top_k(cfg, top_k)
    mask_id, _ = mask_token_of(pre.tokenizer)
    lists = [encode_text(pre.tokenizer, cfg, t, name=f"texts[{i}]", need_mask=True)
             for i, t in enumerate(texts)]
    found = fill_mask_lists(pre.model, pre.params, lists, mask_id=mask_id, top_k=top_k,
                            batch_size=batch_size)
    return [[list(zip(token_strings(pre.tokenizer, [i for i, _ in fillers]),
                      [p for _, p in fillers], strict=True)) for fillers in masks]
            for masks in found]


def classify_text(pre, texts: Sequence[str], *, batch_size: int = 16) -> list[Classified]:
    """The likeliest label of each text, with its probability and the whole distribution.

        classify_text(pre, ["a fine film", "dull"])
        # [Classified(label="pos", probability=0.93, distribution={"neg": 0.07, "pos": 0.93}),
        #  Classified(label="neg", probability=0.81, distribution={"neg": 0.81, "pos": 0.19})]

    Args:
        pre: a `models.load(...)` result (`.model`, `.params`, `.tokenizer`), an
            encoder-only classifier with a tokenizer.
        texts: one example each.
        batch_size: texts run together.

    Raises:
        UserError: a masked-LM model; no tokenizer; texts[i] longer than max_len.
    """
    cfg = pre.model.config
    check_head(cfg, CLASSIFY)
    if pre.tokenizer is None:
        raise UserError("this model has no tokenizer; classify_text needs one "
                         "(decode.classify takes token ids)")
    lists = [encode_text(pre.tokenizer, cfg, t, name=f"texts[{i}]") for i, t in enumerate(texts)]
    return classified(cfg, classify_lists(pre.model, pre.params, lists, batch_size=batch_size))


def classified(config: TransformerConfig, probs_NC: np.ndarray) -> list[Classified]:
    """Rows of label probabilities [N, C] as `Classified` (ties go to the lower class)."""
    names = label_names(config)
    out = []
    for row in np.asarray(probs_NC):
        best = int(row.argmax())
        out.append(Classified(names[best], float(row[best]),
                              dict(zip(names, row.tolist(), strict=True))))
    return out
