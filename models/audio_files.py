"""Reading audio files for Whisper: WAV, FLAC (and what else libsndfile reads) as mono
float32 samples at 16 kHz.

    wave = read_audio("speech.flac")              # float32 [n], 16 kHz, mono
    feats, mask = log_mel_features([wave])        # models.audio_features

Several channels are averaged into one (as Whisper's own loader, ffmpeg with `-ac 1`,
does); other sampling rates are resampled to 16 kHz with scipy's polyphase filter
(`scipy.signal.resample_poly`, a Kaiser-windowed FIR), or refused by name where scipy is
not installed. A file that cannot be read is one `UserError` naming it, and so is one that
ends before the frames its header promises (a truncated download): libsndfile reads such a
WAV up to where it stops without a word, so the WAV header's data size is read here too
(`wav_header_frames`), and a FLAC whose decoder fails part way is named the same way.
"""

from __future__ import annotations

import math
import os
import struct

import numpy as np

from models.audio_features import SAMPLING_RATE
from models.errors import UserError


def resample(wave: np.ndarray, rate: int, target: int = SAMPLING_RATE) -> np.ndarray:
    """float32 `wave` at `rate` Hz resampled to `target` Hz (polyphase, up/down by their
    greatest common divisor: 44.1 kHz -> 16 kHz is up 160, down 441)."""
    if rate == target:
        return wave.astype(np.float32)
    try:
        from scipy.signal import resample_poly
    except ImportError:
        raise UserError(f"audio at {rate} Hz needs resampling to {target} Hz, which needs "
                        "scipy (pip install scipy), or give 16 kHz audio") from None
    g = math.gcd(rate, target)
    return resample_poly(wave.astype(np.float64), target // g, rate // g).astype(np.float32)


# A WAV data size that says "length unknown": written by a writer that could not seek back
# (ffmpeg to a pipe writes 0xFFFFFFFF; some writers leave 0).
_UNKNOWN_SIZES = (0, 0xFFFFFFFF)
_BLOCK = 4096                         # frames read at a time (a quarter second at 16 kHz)


def wav_header_frames(path: str) -> int | None:
    """The frames a RIFF WAVE file's header promises: its data chunk's size over the
    frame size (the fmt chunk's block align). None for any other file, for a data size
    that says "length unknown" (`_UNKNOWN_SIZES`), or a header that stops before its
    data chunk.

        44-byte header, data size 32000, block align 2 (mono PCM_16)  -> 16000
    """
    with open(path, "rb") as f:
        head = f.read(12)
        if len(head) < 12 or head[:4] not in (b"RIFF", b"RIFX") or head[8:] != b"WAVE":
            return None
        order = "<" if head[:4] == b"RIFF" else ">"
        align = None
        while len(chunk := f.read(8)) == 8:
            name, (size,) = chunk[:4], struct.unpack(order + "I", chunk[4:])
            if name == b"data":
                return None if not align or size in _UNKNOWN_SIZES else size // align
            padded = size + (size & 1)                    # chunks are padded to even sizes
            if name != b"fmt ":
                f.seek(padded, os.SEEK_CUR)
            elif len(body := f.read(padded)) >= 14:
                (align,) = struct.unpack(order + "H", body[12:14])
    return None


def read_audio(path: str, *, sampling_rate: int = SAMPLING_RATE) -> np.ndarray:
    """The samples of an audio file as float32 [n] in [-1, 1], mono, at `sampling_rate`.

    Raises:
        UserError: a missing or unreadable file (naming it and the reader's reason), one
            that holds fewer frames than its header promises (naming both counts), an
            empty one, or one that needs resampling without scipy.
    """
    try:
        import soundfile
    except ImportError:
        raise UserError("reading audio files needs soundfile (pip install soundfile)") from None
    if not os.path.isfile(path):
        raise UserError(f"audio file {path!r} does not exist")
    blocks, failed = [], None
    try:
        with soundfile.SoundFile(path) as f:
            promised, rate, channels = f.frames, f.samplerate, f.channels
            try:
                # In blocks, so a decoder that fails part way still says how far it got.
                for block in f.blocks(_BLOCK, dtype="float32", always_2d=True):
                    if not len(block):
                        break
                    blocks.append(block)
            except (RuntimeError, soundfile.LibsndfileError) as e:
                failed = e
    except (RuntimeError, soundfile.LibsndfileError, TypeError, ValueError) as e:
        raise UserError(f"cannot read audio file {path!r}: {e}") from None
    data = np.concatenate(blocks) if blocks else np.zeros((0, channels), np.float32)
    # libsndfile reads a WAV up to where it ends and reports that many frames.
    promised = max(promised, wav_header_frames(path) or 0)
    if data.shape[0] < promised:
        how = (f"the first {data.shape[0]} were read before the reader failed ({failed})"
               if failed else f"it holds {data.shape[0]}")
        raise UserError(f"audio file {path!r} is cut short: its header promises {promised} "
                        f"frames, {how} (a truncated download? fetch it again)")
    if failed is not None:
        raise UserError(f"cannot read audio file {path!r}: {failed}")
    if data.shape[0] == 0:
        raise UserError(f"audio file {path!r} has no samples")
    wave = data.mean(axis=1) if data.shape[1] > 1 else data[:, 0]
    return resample(wave, int(rate), sampling_rate)
