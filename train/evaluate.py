"""Evaluation: validation loss/accuracy/perplexity, and decoded samples scored by exact match
and BLEU (sacrebleu), with a few source / reference / hypothesis triples to print.

How samples are decoded (`decode_settings`): from scratch, greedy and beam search with the
config's `beam_size` and `length_penalty`. A fine-tuned model (`init_from`) decodes as its
directory says it should (generation_config.json, through `GenerationDefaults`): its end
ids, forced first and last tokens, banned ids, minimum length, and its beam count and
length penalty with transformers' length normalisation, so the scores are those its users
would see; `config.beam_size` only where the directory names no beam count.
"""

from __future__ import annotations

import numpy as np
import sacrebleu

import decode
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


def decode_settings(config, choice: ModelChoice, *, beam: bool) -> tuple[int, dict]:
    """(beam size, keyword arguments of `translate`) for an evaluation's greedy (`beam`
    False: beam size 1) or beam-search decoding; see the module docstring.

        from scratch, beam:  (config.beam_size, {"length_penalty": config.length_penalty})
        opus-mt, beam:       (its num_beams, {"length_penalty": 1.0,
                              "length_normalization": "hf", "eos_id": (0,),
                              "forced_eos_id": 0, "banned_ids": (58100,)})
        opus-mt, greedy:     (1, {"eos_id": (0,), "forced_eos_id": 0, "banned_ids": (58100,)})

    A directory that names no beam count gets `config.beam_size` (transformers' default of
    1 would leave no beam search to score), with its length penalty (transformers' 1.0
    when it names none). The number of new tokens is always `config.max_decode_length`: a
    directory's `max_length` is for its users' inputs, not for this run's data.
    """
    generation = choice.generation
    if generation is None:
        return ((config.beam_size, {"length_penalty": config.length_penalty}) if beam
                else (1, {}))
    options = dict(generation.beam_options(choice.config) if beam
                   else generation.generate_options(choice.config))
    options.pop("max_new_tokens", None)
    beam_size = options.pop("beam_size", 1)
    if beam and generation.num_beams is None:
        beam_size = config.beam_size
    return beam_size, options


def translate(model, params, tok: Tokenizer, sources: list[str], *, max_source_length: int,
              max_new_tokens: int, beam_size: int = 1, length_penalty: float = 0.6,
              batch_size: int = 64, **options) -> list[str]:
    """Greedy (beam_size 1) or beam-search translations, in fixed-shape batches.

    Sources are encoded as in training (`encode_side`: a Hugging Face tokenizer's template,
    ending in EOS), cut to `max_source_length` keeping the EOS; outputs are decoded as the
    target side.

    `params` are host arrays, so each call runs on this process's first local device: no
    collective, and processes may decode different numbers of batches.

    Args:
        options: further keyword arguments of `decode.generate` or `decode.beam_search`
            (end ids, forced and banned ids, `length_normalization`, ...), as
            `decode_settings` gives them.
    """
    out = []
    for start in range(0, len(sources), batch_size):
        chunk = sources[start:start + batch_size]
        prompts = np.zeros((batch_size, max_source_length), np.int32)
        lengths = np.ones(batch_size, np.int32)
        prompts[:, 0] = tok.eos_id                   # padding rows: a lone EOS
        for i, ids in enumerate(encode_side(tok, chunk, "source")):       # as in training
            if len(ids) > max_source_length:                                 # cut, keep EOS
                ids = ids[:max_source_length - 1] + ids[-1:]
            prompts[i, :len(ids)] = ids
            lengths[i] = len(ids)
        if beam_size > 1:
            tokens = decode.beam_search(model, params, prompts, lengths, beam_size=beam_size,
                                        max_new_tokens=max_new_tokens,
                                        length_penalty=length_penalty, **options).tokens[:, 0]
        else:
            tokens = decode.generate(model, params, prompts, lengths,
                                     max_new_tokens=max_new_tokens, temperature=0.0,
                                     **options).tokens
        out += [tok.decode(row) for row in np.asarray(tokens)[:len(chunk)]]
    return out


def scores(hypotheses: list[str], references: list[str], metric: str) -> dict:
    """`exact_match` (fraction of identical strings) and/or corpus `bleu` (sacrebleu)."""
    out = {}
    if metric in ("exact_match", "both"):
        out["exact_match"] = float(np.mean([
            h.strip() == r.strip() for h, r in zip(hypotheses, references, strict=True)]))
    if metric in ("bleu", "both"):
        out["bleu"] = float(sacrebleu.corpus_bleu(hypotheses, [references], force=True).score)
    return out


def decoded_metrics(model, params, tok, ds: Dataset, split: str, n: int, config,
                    beam_size: int, **options) -> tuple[dict, list[tuple[str, str, str]]]:
    """Decodes the first `n` examples of `split`; scores and (source, reference, hypothesis).

    `options` are `translate`'s (`decode_settings` gives them); the length penalty defaults
    to `config.length_penalty`."""
    n = min(n, len(ds.split(split)))
    pairs = ds.examples(split, range(n))
    hyps = translate(model, params, tok, [s for s, _ in pairs],
                     max_source_length=config.max_source_length,
                     max_new_tokens=config.max_decode_length, beam_size=beam_size,
                     **{"length_penalty": config.length_penalty, **options})
    refs = [t for _, t in pairs]
    triples = [(s, r, h) for (s, r), h in zip(pairs, hyps, strict=True)]
    return scores(hyps, refs, config.metric), triples
