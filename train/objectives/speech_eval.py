"""Scoring a Whisper on transcribed clips: greedy transcriptions (`decode.whisper`) and
their word and character error rates (jiwer's).

    scores, pairs = transcribed_scores(loaded, tok, ds, split="validation", n=100,
                                       language="en", task="transcribe", max_new_tokens=64)
    scores        # {"wer": 0.25, "cer": 0.1}
    pairs         # [(reference, hypothesis), ...]

WER is (substitutions + deletions + insertions) / reference words over the whole split
(jiwer pools the counts over all pairs, as the field reports it), CER the same over
characters. Texts are compared as written and stripped of surrounding space: no case
folding or punctuation removal (Whisper's English text normaliser is not applied).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jiwer
import numpy as np

from train.data.speech import batch_features


@dataclasses.dataclass(frozen=True)
class Loaded:
    """What `decode.whisper.transcribe` reads of a loaded model (`models.load`'s
    `Pretrained`), from a run: its module, host parameters, config and generation
    defaults."""

    model: Any
    params: Any
    config: Any
    generation: Any


def error_rates(references: list[str], hypotheses: list[str]) -> dict[str, float]:
    """{"wer", "cer"} of hypotheses against references (jiwer's, pooled over the pairs).

        error_rates(["the cat sat"], ["the cat sad"])  # {"wer": 1/3, "cer": 1/11}
    """
    refs = [r.strip() for r in references]
    hyps = [h.strip() for h in hypotheses]
    return {"wer": float(jiwer.wer(refs, hyps)), "cer": float(jiwer.cer(refs, hyps))}


def transcribe_clips(loaded: Loaded, tokenizer, paths: list[str], *, language, task,
                     max_new_tokens: int, batch_size: int = 16) -> list[str]:
    """Greedy transcriptions of audio files, in batches of `batch_size` rows (a short
    batch filled with silent rows, so nothing compiles twice)."""
    from decode.whisper import transcribe
    audio, out = loaded.config.audio, []
    room = loaded.config.max_len - 4                # the longest prompt: start, lang, task, nt
    for start in range(0, len(paths), batch_size):
        chunk = list(paths[start:start + batch_size])
        feats = batch_features(chunk + [None] * (batch_size - len(chunk)), audio)
        result = transcribe(loaded, feats, language=language, task=task,
                            max_new_tokens=max(1, min(max_new_tokens, room)))
        tokens, lengths = np.asarray(result.tokens), np.asarray(result.lengths)
        out += [tokenizer.decode(tokens[i, :lengths[i]]) for i in range(len(chunk))]
    return out


def transcribed_scores(loaded: Loaded, tokenizer, ds, *, split: str, n: int, language, task,
                       max_new_tokens: int, batch_size: int = 16
                       ) -> tuple[dict, list[tuple[str, str]]]:
    """WER and CER of the first `n` clips of `split` (see the module docstring), and the
    (reference, hypothesis) pairs."""
    n = min(n, len(ds.split(split)))
    at = ds.keys.index(ds.data_kind.audio_key)
    examples = ds.examples(split, range(n))
    refs = [ex[0] for ex in examples]
    hyps = transcribe_clips(loaded, tokenizer, [ex[at] for ex in examples],
                            language=language, task=task, max_new_tokens=max_new_tokens,
                            batch_size=batch_size)
    return error_rates(refs, hyps), list(zip(refs, hyps, strict=True))
