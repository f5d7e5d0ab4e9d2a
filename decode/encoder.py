"""Encoder-only models (BERT, RoBERTa): fill in masked tokens, classify a text.

An encoder-only model reads a whole input in one bidirectional pass (no cache, no loop):
the masked-LM head gives a distribution over the vocabulary at every position, a
classifier (config.num_labels = C > 0) one over its C labels. Inputs follow the convention
training uses: `tokenizer.encode(text, add_special_tokens=True)`, that is BERT's
`[CLS] x [SEP]`, RoBERTa's `<s> x </s>`, and the project's tokenizers' `[BOS] x [EOS]` when
exported with add_bos / add_eos (`ByteTokenizer(mask=True)` reads "[MASK]" in text as id
260).

Three levels, each built on the one before:

    # 1. arrays: right-padded int[B, T] tokens, int[B] lengths; one jitted computation
    out = decode.fill_mask(model, params, tokens, lengths, top_k=5)
    out.ids, out.probs                 # int32[B, T, k], float32[B, T, k]: best first, at
                                       # every position (the caller picks the masked ones)
    at_mask_BT = tokens == mask_id
    out.ids[at_mask_BT]                # int32[M, k]: the M masks of the batch, row by row
    probs_BC = decode.classify(model, params, tokens, lengths)        # float32[B, C]

    # 2. lists of token ids of any lengths (padded and batched here)
    decode.encoder.fill_mask_lists(model, params, [[2, 9, 260, 1]], mask_id=260, top_k=2)
    # [[[(17, 0.41), (9, 0.20)]]]        per list, per mask (in order): (id, probability)
    decode.encoder.classify_lists(model, params, [[2, 9, 1], [2, 7, 7, 1]])  # float32[2, C]

    # 3. text, with a `models.load(...)` result's tokenizer: `decode.encoder_text`
    decode.fill_mask_text(pre, ["The cat sat on the [MASK] ."], top_k=3)

Probabilities are a softmax in float32 over the whole vocabulary (all C labels). One
compilation per (model, batch, padded width, top_k); the list (and text) levels pad each
batch to `decode.bucket_width` of its longest input (at most max_len), so new inputs
rarely recompile.

Every mistake is a UserError that names the value and the limit: a model with the other
head (or no encoder-only model at all), top_k outside [1, vocab_size], an input longer
than max_len.
`decode.generate` and `decode.beam_search` refuse an encoder-only model.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from decode.checks import as_array
from decode.generate import bucket_width, pad_prompts
from models.checks import check_same_shape, check_tokens, is_concrete
from models.config import TransformerConfig
from models.errors import UserError, is_int

FILL_MASK, CLASSIFY = "fill-mask", "classification"


@flax.struct.dataclass
class FillMaskOutput:
    """What `fill_mask` returns: the k likeliest tokens at every position, best first.

    Attributes:
        ids: int32[B, T, k] token ids; ties go to the lower id.
        probs: float32[B, T, k] their probabilities (softmax over the vocabulary), each
            row non-increasing. Positions past a row's length hold what the model predicts
            for its padding: ignore them.
    """

    ids: Int[Array, "B T k"]
    probs: Float[Array, "B T k"]


# ---------------------------------------------------------------------------------------------
# Checks.

def label_names(config: TransformerConfig) -> tuple[str, ...]:
    """A classifier's C label names: config.label_names, or transformers' LABEL_0 ..
    LABEL_{C-1} when it has none (() for a masked-LM model)."""
    return config.label_names or tuple(f"LABEL_{i}" for i in range(config.num_labels))


def _labels_shown(config: TransformerConfig) -> str:
    names = label_names(config)
    return ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")


def check_head(config: TransformerConfig, task: str) -> None:
    """The model is encoder-only with the head `task` needs: FILL_MASK the masked-LM head
    (num_labels=0), CLASSIFY a classifier (num_labels=C > 0).

    Raises:
        UserError: naming the model's architecture or its num_labels and what to use.
    """
    if config.architecture != "encoder_only":
        raise UserError(f"{task} needs an encoder-only model (BERT, RoBERTa); this one is "
                         f"{config.architecture}: it generates (decode.generate, "
                         "decode.beam_search)")
    if task == FILL_MASK and config.num_labels:
        raise UserError(f"fill-mask needs a masked-LM model (num_labels=0); this one is a "
                         f"classifier (num_labels={config.num_labels}: "
                         f"{_labels_shown(config)}): use decode.classify")
    if task == CLASSIFY and not config.num_labels:
        raise UserError("classification needs a classifier (num_labels > 0); this model has "
                         "a masked-LM head (num_labels=0): use decode.fill_mask")


def check_top_k(config: TransformerConfig, top_k) -> int:
    """`top_k` as an int in [1, vocab_size] (static: never a traced value)."""
    if not is_int(top_k) or not 1 <= top_k <= config.vocab_size:
        raise UserError(f"top_k={top_k!r} must be an int in [1, vocab_size="
                         f"{config.vocab_size}]")
    return int(top_k)


def _check_arrays(config: TransformerConfig, tokens, lengths, token_types):
    """Right-padded int[B, T] tokens (T <= max_len, ids in the vocabulary), their lengths
    int[B] in [1, T], and token types int[B, T] or None; as int32 arrays (numpy when
    concrete). Values are checked when concrete."""
    tokens = as_array(tokens)
    check_tokens(config, tokens, "tokens")
    B, T = tokens.shape
    lengths = as_array(lengths)
    if lengths.shape != (B,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise UserError(f"lengths must be an int array of shape ({B},) (one per row of "
                         f"tokens), got shape {lengths.shape} dtype {lengths.dtype}")
    if is_concrete(lengths):
        bad = np.nonzero((lengths < 1) | (lengths > T))[0]
        if bad.size:
            b = int(bad[0])
            raise UserError(f"lengths[{b}]={int(lengths[b])} must be in [1, padded width {T}]")
    if token_types is not None:
        token_types = as_array(token_types)
        check_same_shape(token_types, tokens, "token_types", "tokens")
        if not jnp.issubdtype(token_types.dtype, jnp.integer):
            raise UserError(f"token_types must have an integer dtype, got {token_types.dtype}")
        if not config.num_token_types:
            raise UserError("token_types given, but the config has num_token_types=0")
        if is_concrete(token_types):
            bad = token_types[(token_types < 0) | (token_types >= config.num_token_types)]
            if bad.size:
                raise UserError(f"token_types hold type {int(bad[0])} outside [0, "
                                 f"num_token_types={config.num_token_types})")
        token_types = token_types.astype(jnp.int32)
    return tokens.astype(jnp.int32), lengths.astype(jnp.int32), token_types


# ---------------------------------------------------------------------------------------------
# 1. Arrays, jitted.

@functools.partial(jax.jit, static_argnames=("model", "top_k"))
def _fill_mask(model, params, tokens_BT, lengths_B, token_types_BT, *, top_k) -> FillMaskOutput:
    logits_BTV = model.apply({"params": params}, tokens_BT, lengths=lengths_B,
                             token_types=token_types_BT)
    probs_BTV = jax.nn.softmax(logits_BTV.astype(jnp.float32), axis=-1)
    probs_BTk, ids_BTk = jax.lax.top_k(probs_BTV, top_k)
    return FillMaskOutput(ids_BTk.astype(jnp.int32), probs_BTk)


@functools.partial(jax.jit, static_argnames=("model",))
def _classify(model, params, tokens_BT, lengths_B, token_types_BT) -> Float[Array, "B C"]:
    logits_BC = model.apply({"params": params}, tokens_BT, lengths=lengths_B,
                            token_types=token_types_BT, method="classify")
    return jax.nn.softmax(logits_BC.astype(jnp.float32), axis=-1)


def fill_mask(
    model: nn.Module,
    params,
    tokens: Int[Array, "B T"],
    lengths: Int[Array, " B"],
    *,
    top_k: int = 5,
    token_types: Int[Array, "B T"] | None = None,
) -> FillMaskOutput:
    """The `top_k` likeliest tokens, and their probabilities, at every position.

    Shapes stay static whatever the number of masks: the caller picks the masked positions.

        tokens = [[2, 9, 260, 1, 0]]        # [BOS] x [MASK] [EOS] pad; lengths = [4]
        out = fill_mask(model, params, tokens, lengths, top_k=2)
        out.ids[0, 2], out.probs[0, 2]      # the mask's 2 best fillers: [17, 9], [.41, .20]
        out.ids[tokens == 260]              # int32[M, 2], every mask of the batch in order

    Args:
        model: an encoder-only `models.build(...)` module with the masked-LM head
            (num_labels=0) (static); params: its parameters.
        tokens: int[B, T] right-padded token ids, T <= max_len (whatever fills the padding).
        lengths: int[B] the true lengths, in [1, T].
        top_k: k, the tokens kept per position, in [1, vocab_size] (static). top_k =
            vocab_size gives the whole distribution, sorted.
        token_types: optional int[B, T] token types (BERT's sentence A/B); None is type 0.

    Returns:
        A `FillMaskOutput`: ids int32[B, T, k] and probs float32[B, T, k], best first.

    Raises:
        UserError: naming the value and the limit (a classifier, top_k outside
            [1, vocab_size], T > max_len, ids outside the vocabulary, bad lengths). Values
            are checked when concrete (not inside your own `jax.jit`).
    """
    cfg = model.config
    check_head(cfg, FILL_MASK)
    top_k = check_top_k(cfg, top_k)
    tokens, lengths, token_types = _check_arrays(cfg, tokens, lengths, token_types)
    return _fill_mask(model, params, tokens, lengths, token_types, top_k=top_k)


def classify(
    model: nn.Module,
    params,
    tokens: Int[Array, "B T"],
    lengths: Int[Array, " B"],
    *,
    token_types: Int[Array, "B T"] | None = None,
) -> Float[Array, "B C"]:
    """Each row's probabilities over the C labels (float32 softmax of the classifier).

        probs = classify(model, params, tokens, lengths)    # [[0.07, 0.93], ...]
        label_names(model.config)[int(probs[0].argmax())]    # "pos"

    Args:
        model: an encoder-only `models.build(...)` classifier (num_labels = C > 0)
            (static); params: its parameters.
        tokens: int[B, T] right-padded token ids, T <= max_len; one example per row, whose
            first token is the one the classifier reads ([CLS], <s>, [BOS]).
        lengths: int[B] the true lengths, in [1, T].
        token_types: optional int[B, T] token types; None is type 0.

    Returns:
        float32[B, C], each row summing to 1.

    Raises:
        UserError: naming the value and the limit (a masked-LM model, T > max_len, ids
            outside the vocabulary, bad lengths).
    """
    cfg = model.config
    check_head(cfg, CLASSIFY)
    tokens, lengths, token_types = _check_arrays(cfg, tokens, lengths, token_types)
    return _classify(model, params, tokens, lengths, token_types)


# ---------------------------------------------------------------------------------------------
# 2. Lists of token ids, padded and batched.

def _batches(config: TransformerConfig, token_lists, batch_size: int):
    """(indices, tokens int32[b, W], lengths int32[b]) per batch of `batch_size` lists, W
    the bucket of the batch's longest list, at most max_len."""
    token_lists = [list(t) for t in token_lists]
    for i, ids in enumerate(token_lists):
        if not ids:
            raise UserError(f"token_lists[{i}] is empty")
        if len(ids) > config.max_len:
            raise UserError(f"token_lists[{i}] has {len(ids)} tokens; the model takes at "
                             f"most {config.max_len} (max_len)")
    if not is_int(batch_size) or batch_size < 1:
        raise UserError(f"batch_size={batch_size!r} must be a positive int")
    pad = config.pad_id if config.pad_id is not None else 0
    for start in range(0, len(token_lists), batch_size):
        batch = token_lists[start:start + batch_size]
        width = min(bucket_width(max(map(len, batch))), config.max_len)
        tokens, lengths = pad_prompts(batch, width=width, pad_id=pad)
        yield range(start, start + len(batch)), tokens, lengths


def fill_mask_lists(model: nn.Module, params, token_lists: Sequence[Sequence[int]], *,
                    mask_id: int, top_k: int = 5,
                    batch_size: int = 16) -> list[list[list[tuple[int, float]]]]:
    """The `top_k` fillers of every `mask_id` in lists of token ids (special tokens
    included), batched `batch_size` lists at a time.

        fill_mask_lists(model, params, [[2, 260, 7, 260, 1], [2, 5, 1]], mask_id=260,
                        top_k=2)
        # [[[(17, 0.41), (9, 0.2)], [(5, 0.33), (6, 0.1)]], []]   a list without a mask: []

    Returns:
        Per list, per occurrence of `mask_id` (in order), the k (id, probability) pairs,
        best first.
    """
    cfg = model.config
    check_head(cfg, FILL_MASK)
    top_k = check_top_k(cfg, top_k)
    if not is_int(mask_id) or not 0 <= mask_id < cfg.vocab_size:
        raise UserError(f"mask_id={mask_id!r} is outside [0, vocab_size={cfg.vocab_size})")
    out: list = []
    for _, tokens, lengths in _batches(cfg, token_lists, batch_size):
        res = fill_mask(model, params, tokens, lengths, top_k=top_k)
        ids, probs = np.asarray(res.ids), np.asarray(res.probs)
        for b, n in enumerate(lengths):
            where = np.nonzero(tokens[b, :n] == mask_id)[0]
            out.append([list(zip(ids[b, t].tolist(), probs[b, t].tolist(), strict=True))
                        for t in where])
    return out


def classify_lists(model: nn.Module, params, token_lists: Sequence[Sequence[int]], *,
                   batch_size: int = 16) -> np.ndarray:
    """float32[n, C]: the label probabilities of each of n lists of token ids (special
    tokens included), batched `batch_size` lists at a time."""
    cfg = model.config
    check_head(cfg, CLASSIFY)
    rows = [np.asarray(classify(model, params, tokens, lengths))
            for _, tokens, lengths in _batches(cfg, token_lists, batch_size)]
    return np.concatenate(rows) if rows else np.zeros((0, cfg.num_labels), np.float32)
