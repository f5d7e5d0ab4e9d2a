"""The audio half of `python -m decode`: `--audio FILE ...` transcribes with a Whisper model.

    python -m decode --model whisper-tiny --audio a.wav b.flac
    python -m decode --model whisper-small --audio talk.wav --language es --task translate
    python -m decode --model whisper-small --audio a.wav b.wav --strategy beam --beam-size 4

Prints one line per file, in the order given: its transcript (the tokenizer's text without
special tokens; space-separated token ids for a directory without tokenizer files). Each
file is read as 16 kHz mono (`models.audio_files.read_audio`) and becomes one window of
features, the model's own (`models.audio_features.window_features`: 30 s for every Whisper
checkpoint; longer audio is refused, or cut to the window with --truncate); `--batch-size`
files are decoded together (the last batch padded with silent rows to the same shape, so it
compiles once), each giving the text it gives alone. The decoding is
`decode.whisper.transcribe`: the checkpoint's decoder prompt (--language, else detected per
file; --task, else the file's), its suppressed tokens, greedy or beam search (--strategy,
else beam when the directory's num_beams > 1; the beam size from --beam-size, else the
directory's num_beams when > 1, else 4; --length-penalty else the directory's, else 1.0,
transformers' defaults), --max-new-tokens else the directory's max_length.

Refused by name (one `error:` line, exit 2) before any file is decoded: a model that is
not Whisper (no audio encoder), a preset (--config) instead of a directory, text inputs
with --audio, a flag that text generation alone reads, a missing or unreadable file, a
language the checkpoint does not know and a task on an English-only model.
"""

from __future__ import annotations

import numpy as np

import models
from decode.source import model_source
from decode.text import one_line
from decode.whisper import WhisperSettings, transcribe
from models.audio_features import SAMPLING_RATE, window_features, window_seconds
from models.audio_files import read_audio
from models.errors import UserError

DEFAULT_BEAMS = 4      # --strategy beam with neither --beam-size nor the directory's num_beams
# Flags only text generation reads: refused with --audio (each away from its default).
TEXT_ONLY = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
             "length_normalization", "early_stopping", "eos_id", "forced_bos_id", "forced_eos_id",
             "banned_ids", "min_new_tokens", "no_repeat_ngram_size", "draft_model",
             "adapter", "fill_mask", "classify", "kv_cache_dtype", "target_lang",
             "source_lang")


def check_flags(args, parser) -> None:
    """--audio's flags: no text inputs, no flag of text generation alone, no preset;
    --language and --task only with --audio."""
    if args.audio is None:
        given = [f for f in ("language", "task") if getattr(args, f) is not None]
        if given:
            raise UserError(f"--{given[0]} applies to --audio (Whisper transcription)")
        return
    if args.text:
        raise UserError(f"--audio transcribes audio files; text inputs were given too "
                        f"({len(args.text)}: {args.text[0]!r}...): give one or the other")
    if args.config:
        raise UserError(f"--audio needs a Whisper model directory (--model or --workdir), "
                        f"not the preset {args.config!r} with random weights")
    given = [d for d in TEXT_ONLY if getattr(args, d) != parser.get_default(d)]
    if given:
        raise UserError(f"--{given[0].replace('_', '-')} applies to text generation, not "
                        "--audio")
    if args.strategy == "sample":
        raise UserError("--strategy sample applies to text generation; --audio decodes "
                        "greedy or beam")


def _load(args):
    path = model_source(args)
    pre = models.load(path, quantize=args.quantize, quantize_group=args.quantize_group)
    if pre.config.audio is None:
        raise UserError(f"--audio needs a Whisper model (an audio encoder); {path} is "
                        f"{pre.model_type} ({pre.config.architecture})")
    return pre


def _features(paths: list[str], audio, truncate: bool) -> np.ndarray:
    """float32 [F, mel, frames]: every file read and cut to the model's window
    (`models.audio_features.window_features`: 30 s for every Whisper checkpoint) before
    anything decodes."""
    out = []
    for path in paths:
        wave = read_audio(path)
        if wave.size > window_seconds(audio) * SAMPLING_RATE and not truncate:
            raise UserError(f"{path} is {wave.size / SAMPLING_RATE:.2f} s long: the model reads "
                            f"{window_seconds(audio):g} s windows and long-form transcription "
                            "is not supported (split it, or --truncate keeps the first "
                            f"{window_seconds(audio):g} s)")
        try:
            feats, _ = window_features([wave], audio=audio, truncate=truncate)
        except UserError as e:
            raise UserError(f"{path}: {e}") from None
        out.append(feats[0])
    return np.stack(out)


def _beams(args, settings: WhisperSettings) -> int:
    """1 for greedy; else --beam-size, the directory's num_beams when > 1, or 4."""
    strategy = args.strategy or ("beam" if settings.num_beams > 1 else "greedy")
    if strategy == "greedy":
        return 1
    return args.beam_size or (settings.num_beams if settings.num_beams > 1 else DEFAULT_BEAMS)


def _text(tokenizer, ids) -> str:
    if tokenizer is None:
        return " ".join(str(int(i)) for i in ids)
    return tokenizer.decode([int(i) for i in ids])


def run(args, print_line=print) -> None:
    """Transcribes args.audio (see the module docstring), one `print_line` per file."""
    pre = _load(args)
    settings = WhisperSettings.from_generation(pre.generation, pre.config)
    feats = _features(args.audio, pre.config.audio, args.truncate)
    F = feats.shape[0]
    rows = min(args.batch_size, F)
    options = dict(language=args.language, task=args.task, max_new_tokens=args.max_new_tokens,
                   num_beams=_beams(args, settings), length_penalty=args.length_penalty,
                   settings=settings)
    for start in range(0, F, rows):
        batch = feats[start:start + rows]
        real = batch.shape[0]
        if real < rows:            # silent rows: the same shape as the other batches
            batch = np.concatenate([batch, np.zeros((rows - real,) + batch.shape[1:],
                                                    batch.dtype)])
        out = transcribe(pre, batch, **options)
        tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
        for b in range(real):
            print_line(one_line(_text(pre.tokenizer, tokens[b, :lengths[b]])))
