"""Evaluation: validation loss/accuracy/perplexity, and decoded samples scored by exact match
and BLEU (sacrebleu), with a few source / reference / hypothesis triples to print.

How samples are decoded is a `decode.DecodeRequest` (`decode_request`): from scratch,
greedy and beam search with the config's `beam_size` and `length_penalty`. A fine-tuned
model (`init_from`) decodes as its directory says it should (its generation_config.json,
`DecodeRequest.from_generation`): its end ids, forced first and last tokens, banned ids,
minimum length, and its beam count and length penalty with transformers' length
normalisation, so the scores are those its users would see; `config.beam_size` only where
the directory names no beam count. The sources go through the text service
(`decode.TextDecoder`) encoded as training encodes them, in fixed-shape batches.
"""

from __future__ import annotations

import numpy as np
import sacrebleu

from decode import Batching, DecodeRequest, LengthLimit, TextDecoder
from train import step as step_lib
from train.data import Dataset, Tokenizer
from train.data.pipeline import encode_side
from train.model_config import ModelChoice


def loss_metrics(dp, params, batches, label_names: tuple[str, ...] = ()) -> dict:
    """Token loss, accuracy and perplexity over evaluation batches (all devices); for a
    classifier also each class's F1 (named by `label_names`) and their mean.

    Each batch is one eval step, a collective over every device of every process: every
    process must pass the same number of batches (`train.data.eval_batches` agrees on it).
    """
    total = None
    for batch in batches:
        sums = dp.metrics(dp.eval_step(params, batch))
        total = sums if total is None else {k: total[k] + sums[k] for k in total}
    return step_lib.summarise(total, label_names)


def decode_request(evaluation, choice: ModelChoice, *, beam: bool) -> DecodeRequest:
    """The request an evaluation decodes with: greedy, or with `beam` beam search (see the
    module docstring), from the evaluation settings' `beam_size`, `length_penalty` and
    `max_decode_length` (`train.settings.EvalSettings`). The number of new tokens is
    always `max_decode_length`: a directory's `max_length` is for its users' inputs, not
    for this run's data.

        from scratch, beam:  DecodeRequest(strategy="beam", beam_size=evaluation.beam_size,
                             length_penalty=evaluation.length_penalty, max_new_tokens=...)
        opus-mt, beam:       strategy "beam", its num_beams, length_penalty 1.0,
                             length_normalization "hf", eos_id (0,), forced_eos_id 0,
                             banned_ids (58100,)
        opus-mt, greedy:     strategy "greedy", eos_id (0,), forced_eos_id 0,
                             banned_ids (58100,)

    A directory that names no beam count gets `evaluation.beam_size` (transformers' default of
    1 would leave no beam search to score), with its length penalty (transformers' 1.0
    when it names none). A beam size of 1 is greedy decoding: with `beam` the request is
    then "greedy", and there is no beam search to score.
    """
    generation = choice.generation
    if generation is None:
        request = DecodeRequest(beam_size=evaluation.beam_size,
                                length_penalty=evaluation.length_penalty)
    else:
        request = DecodeRequest.from_generation(generation, choice.config)
        if generation.num_beams is None:
            request = request.replace(beam_size=evaluation.beam_size)
    return request.replace(max_new_tokens=evaluation.max_decode_length,
                           strategy="beam" if beam and request.beam_size > 1 else "greedy")


def translate(model, params, tok: Tokenizer, sources: list[str],
              request: DecodeRequest | None = None, *, max_source_length: int,
              batch_size: int = 64, **fields) -> list[str]:
    """Translations of `sources` as `request` decodes them, in fixed-shape batches.

    Sources are encoded as in training (`encode_side`: a Hugging Face tokenizer's template,
    ending in EOS), cut to `max_source_length` keeping the EOS, and decoded in batches of
    `batch_size` rows of that width (short batches filled with lone-EOS rows, so nothing
    recompiles) by the text service (`decode.TextDecoder`); outputs are decoded as the
    target side.

    `params` are host arrays, so each call runs on this process's first local device: no
    collective, and processes may decode different numbers of batches.

    Args:
        request: how to decode (`decode_request` gives evaluation's); None builds one from
            `fields`, greedy unless `beam_size` > 1.
        fields: `decode.DecodeRequest` fields, each over the request's: `max_new_tokens`,
            `beam_size` (1, the default without a request: greedy; > 1: beam search),
            `length_penalty`, end, forced and banned ids, `length_normalization`, ...
    """
    if request is None:
        request = DecodeRequest().replace(**{"beam_size": 1, **fields})
        request = request.replace(strategy="beam" if request.beam_size > 1 else "greedy")
    else:
        request = request.replace(**fields)
    service = TextDecoder(
        model, params, tok, encode=lambda texts: encode_side(tok, texts, "source"),
        limit=LengthLimit(max_source_length, "max_source_length", overlong="cut_keep_last"),
        batching=Batching(size=batch_size, width=max_source_length, pad_row=(tok.eos_id,)))
    return service.decode(sources, request)


def scores(hypotheses: list[str], references: list[str], metric: str) -> dict:
    """`exact_match` (fraction of identical strings) and/or corpus `bleu` (sacrebleu)."""
    out = {}
    if metric in ("exact_match", "both"):
        out["exact_match"] = float(np.mean([
            h.strip() == r.strip() for h, r in zip(hypotheses, references, strict=True)]))
    if metric in ("bleu", "both"):
        out["bleu"] = float(sacrebleu.corpus_bleu(hypotheses, [references], force=True).score)
    return out


def decoded_metrics(model, params, tok, ds: Dataset, *, split: str, n: int,
                    request: DecodeRequest, metric: str, max_source_length: int,
                    ) -> tuple[dict, list[tuple[str, str, str]]]:
    """Decodes the first `n` examples of `split` as `request` says (`decode_request`
    gives evaluation's); their scores (`metric`: see `scores`) and (source, reference,
    hypothesis) triples. Sources are cut to `max_source_length`."""
    n = min(n, len(ds.split(split)))
    pairs = ds.examples(split, range(n))
    hyps = translate(model, params, tok, [s for s, _ in pairs], request,
                     max_source_length=max_source_length)
    refs = [t for _, t in pairs]
    triples = [(s, r, h) for (s, r), h in zip(pairs, hyps, strict=True)]
    return scores(hyps, refs, metric), triples
