"""Text in, text out: the one service behind `python -m decode` and training's evaluation.

    service = decode.TextDecoder(pre.model, pre.params, pre.tokenizer)
    service.decode(["the dog sees a cat .", "", "a red fox ."], request)
    # ["ku na ...", "", "..."]: exactly one output per input, in order

`TextDecoder.decode` runs these steps; the fields of a `TextDecoder` say what differs
between its users:

1. Encode every input (`encode`). The default is the tokenizer's model input
   (`tokenizer.encode(text, add_special_tokens=True)`: GPT-2 adds nothing, Llama a leading
   BOS, the project's encoder-decoder exports a trailing EOS), or space-separated token
   ids without a tokenizer; a blank input encodes to None and gives a blank output, not
   decoded. Evaluation encodes sources as training does (`train.data.pipeline
   .encode_side`).
2. Check each against the length limit (`limit`, a `LengthLimit`; default: what the
   model takes with the request's new tokens, `length_limit`), before anything is
   decoded: refuse naming the input's number, its length and the limit, or cut it.
3. Ask the request for the longest input once, so that its mistakes show before any
   decoding either.
4. Decode in batches of `batching.size` inputs with `decode.run` (beam search or
   sampling, as the request's strategy says). Each batch is padded to the bucket of its
   longest input (`decode.bucket_width`, at most the limit), so a few widths compile; or,
   with `batching.width`, every batch to that width and, with `batching.pad_row`, to
   `size` rows with that row, so one shape serves every batch (evaluation: a lone EOS).
5. Detokenise each row's new tokens up to its length (`tokenizer.decode`, or
   space-separated ids).

A request may be a function of the batch's longest input length, `request(prompt_len)
-> DecodeRequest`: a decoder-only model's generation_config.json max_length counts the
prompt, so each batch gets its own (`DecodeRequest.from_generation(..., prompt_len=P)`).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import numpy as np

from decode.generate import bucket_width, pad_prompts
from decode.request import DecodeRequest
from decode.runner import Draft, run
from models.config import TransformerConfig
from models.errors import UserError, check_positive_int

# What to do with an input longer than the limit.
OVERLONG = ("refuse", "cut", "cut_keep_last")

Encode = Callable[[Sequence[str]], list]   # texts -> each one's token ids, or None (blank)
RequestFor = Callable[[int], DecodeRequest]


@dataclasses.dataclass(frozen=True)
class LengthLimit:
    """The longest input the model takes, and what to do with a longer one.

    Attributes:
        tokens: the most tokens an input may have.
        rule: where the limit comes from, for messages ("max_len - max_new_tokens").
        overlong: "refuse" (a UserError naming the input, its length and the limit), "cut"
            (its first `tokens` tokens, with a warning) or "cut_keep_last" (its first
            `tokens - 1` and its last, the end token, silently: as training cuts).
        advice: appended to the refusal ("shorten it or pass --truncate").
    """

    tokens: int
    rule: str = "max_len"
    overlong: str = "refuse"
    advice: str = ""

    def __post_init__(self):
        check_positive_int(self.tokens, "the length limit")
        if self.overlong not in OVERLONG:
            raise UserError(f"overlong={self.overlong!r} must be one of {OVERLONG}")

    def fit(self, ids: list[int], number: int, warn: Callable[[str], None]) -> list[int]:
        """`ids` (input `number`, counted from 1) within the limit, or the refusal."""
        if len(ids) <= self.tokens:
            return ids
        if self.overlong == "cut_keep_last":
            return ids[:self.tokens - 1] + ids[-1:]
        if self.overlong == "cut":
            warn(f"input {number} cut from {len(ids)} to {self.tokens} tokens")
            return ids[:self.tokens]
        raise UserError(f"input {number} is {len(ids)} tokens long; the model takes at most "
                        f"{self.tokens} ({self.rule})" + (f"; {self.advice}" if self.advice
                                                          else ""))


def length_limit(config: TransformerConfig, max_new_tokens: int | None = None, *,
                 max_length: int | None = None) -> LengthLimit:
    """The longest input a model takes with `max_new_tokens` more (refused when longer).

    An encoder-decoder's sources are up to max_len long (its decoder holds the start token
    and the new tokens). A decoder-only model's prompt and new tokens share max_len; with
    `max_new_tokens` None, a directory's `max_length` (generation_config.json) counts the
    prompt and the new tokens, at least one.

        decoder-only, max_len 128, max_new_tokens 8   ->  120 ("max_len - max_new_tokens")
        decoder-only, max_length 20 (no max_new_tokens) ->  19 ("the directory's max_length - 1")

    Raises:
        UserError: new tokens that leave no room for an input, naming both numbers.
    """
    if config.is_encoder_decoder:
        new = max_new_tokens if max_new_tokens is not None else (
            None if max_length is None else max_length - 1)
        if new is not None and 1 + new > config.max_len:
            raise UserError(f"max new tokens {new} + the start token exceeds the model's "
                            f"max_len {config.max_len}")
        return LengthLimit(config.max_len, "max_len")
    if max_new_tokens is None:
        if max_length is None:
            raise UserError("a decoder-only model's length limit needs max_new_tokens (or the "
                            "directory's max_length, which counts the prompt)")
        if max_length > config.max_len:
            raise UserError(f"the directory's max_length={max_length} exceeds the model's "
                            f"max_len {config.max_len}")
        return LengthLimit(max_length - 1, "the directory's max_length - 1")
    if max_new_tokens >= config.max_len:
        raise UserError(f"max new tokens {max_new_tokens} leaves no room for a prompt in the "
                        f"model's max_len {config.max_len}")
    return LengthLimit(config.max_len - max_new_tokens, "max_len - max_new_tokens")


@dataclasses.dataclass(frozen=True)
class Batching:
    """How inputs are grouped and padded.

    Attributes:
        size: inputs per batch.
        width: None pads each batch to the bucket of its longest input (at most the
            length limit); an int pads every batch to that width.
        pad_row: with `width`, every batch is filled to `size` rows with this row (token
            ids), so all batches have one shape; None leaves a last batch short.
    """

    size: int = 16
    width: int | None = None
    pad_row: tuple[int, ...] | None = None

    def __post_init__(self):
        check_positive_int(self.size, "batch size")
        if self.width is not None:
            check_positive_int(self.width, "batch width")
        if self.pad_row is not None and (self.width is None or not self.pad_row):
            raise UserError("pad_row fills batches to one shape: it needs a width and at least "
                            "one token")


def one_line(text: str) -> str:
    """An output as one line: line breaks a model generates are written as \\n, \\r."""
    return text.replace("\n", "\\n").replace("\r", "\\r")


def warn_on_stderr(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def token_ids(text: str, number: int, config: TransformerConfig) -> list[int]:
    """Input `number` (counted from 1) read as space-separated token ids in the vocabulary.

        "5 6 7" -> [5, 6, 7];  "a b" -> UserError: input 1: 'a b' is not a list of ...
    """
    try:
        ids = [int(t) for t in text.split()]
    except ValueError:
        raise UserError(f"input {number}: {text!r} is not a list of space-separated token "
                        "ids") from None
    bad = [i for i in ids if not 0 <= i < config.vocab_size]
    if bad:
        raise UserError(f"input {number}: token id {bad[0]} is outside [0, vocab_size="
                        f"{config.vocab_size})")
    return ids


def model_inputs(tokenizer, config: TransformerConfig) -> Encode:
    """The default `encode`: each non-blank text as the model reads it (the tokenizer's
    special tokens added, or space-separated ids without a tokenizer); blank ones None."""
    def encode(texts: Sequence[str]) -> list:
        return [None if not text.strip() else
                tokenizer.encode(text, add_special_tokens=True) if tokenizer is not None
                else token_ids(text, number, config)
                for number, text in enumerate(texts, start=1)]
    return encode


@dataclasses.dataclass(frozen=True, eq=False)
class TextDecoder:
    """Text in, text out, one output per input (the module docstring lists the steps).

    Attributes:
        model: a `models.build(...)` module (encoder-decoder or decoder-only).
        params: its parameters.
        tokenizer: the model's tokenizer, or None to take and give space-separated ids.
        encode: texts -> each one's token ids (None: a blank output); default
            `model_inputs(tokenizer, model.config)`.
        limit: the length limit; None: `length_limit(config, request.max_new_tokens)`
            (a request function needs one given).
        batching: sizes and widths of the batches.
        warn: where warnings go (an input cut); default stderr.
        draft: a `decode.Draft` (speculative decoding), or None.
    """

    model: nn.Module
    params: object
    tokenizer: object = None
    encode: Encode | None = None
    limit: LengthLimit | None = None
    batching: Batching = Batching()
    warn: Callable[[str], None] = warn_on_stderr
    draft: Draft | None = None

    def decode(self, texts: Sequence[str], request: DecodeRequest | RequestFor, *,
               rng: jax.Array | None = None) -> list[str]:
        """Each text's decoded continuation (translation), "" for a blank one.

        Args:
            texts: the inputs.
            request: a `decode.DecodeRequest`, or a function of a batch's longest input
                length (in tokens) that gives one.
            rng: the PRNG key a sampling request draws from (batch i uses
                `fold_in(rng, index of its first input among those decoded)`).

        Raises:
            UserError: an input the encoder or the length limit refuses (naming its number),
                or a request the model cannot run; raised before anything is decoded.
        """
        request_for = _request_function(request)
        limit = self._limit(request)
        inputs = self._inputs(texts, limit)
        todo = [i for i, ids in enumerate(inputs) if ids is not None]
        if todo:                      # the request's mistakes before anything is decoded
            request_for(max(len(inputs[i]) for i in todo))
        size, outputs = self.batching.size, {}
        for start in range(0, len(todo), size):
            rows = todo[start:start + size]
            key = None if rng is None else jax.random.fold_in(rng, start)
            new = self._decode_batch([inputs[i] for i in rows], request_for, limit=limit,
                                     rng=key)
            outputs.update(zip(rows, new, strict=True))
        return ["" if ids is None else self._text(outputs[i]) for i, ids in enumerate(inputs)]

    def _limit(self, request) -> LengthLimit:
        if self.limit is not None:
            return self.limit
        if not isinstance(request, DecodeRequest):
            raise UserError("a request function needs an explicit TextDecoder limit (a "
                            "LengthLimit)")
        return length_limit(self.model.config, request.max_new_tokens)

    def _inputs(self, texts: Sequence[str], limit: LengthLimit) -> list:
        """Each text's token ids within `limit` (None for a blank one)."""
        encoded = (self.encode or model_inputs(self.tokenizer, self.model.config))(list(texts))
        if len(encoded) != len(texts):
            raise ValueError(f"encode gave {len(encoded)} inputs for {len(texts)} texts")
        out = []
        for number, ids in enumerate(encoded, start=1):
            if ids is not None:
                if not ids:
                    raise UserError(f"input {number} gives no tokens")
                ids = limit.fit(list(ids), number, self.warn)
            out.append(ids)
        return out

    def _decode_batch(self, batch: list[list[int]], request_for: RequestFor, *,
                      limit: LengthLimit, rng) -> list[list[int]]:
        """The new tokens of each input of `batch`, as lists."""
        longest = max(len(ids) for ids in batch)
        width = self.batching.width or min(bucket_width(longest), limit.tokens)
        rows = batch
        if self.batching.pad_row is not None:
            rows = batch + [list(self.batching.pad_row)] * (self.batching.size - len(batch))
        prompts, lengths = pad_prompts(rows, width=width)
        out = run(self.model, self.params, prompts, lengths, request_for(longest), rng=rng,
                  draft=self.draft)
        tokens, n = np.asarray(out.tokens), np.asarray(out.lengths)
        return [tokens[b, :n[b]].tolist() for b in range(len(batch))]

    def _text(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        return self.tokenizer.decode(ids)


def _request_function(request) -> RequestFor:
    if isinstance(request, DecodeRequest):
        return lambda _prompt_len: request
    if callable(request):
        return request
    raise UserError(f"request must be a decode.DecodeRequest or a function of the prompt "
                    f"length that gives one, got {type(request).__name__}")
