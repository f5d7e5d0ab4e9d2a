"""Reading audio files for Whisper: WAV, FLAC (and what else libsndfile reads) as mono
float32 samples at 16 kHz.

    wave = read_audio("speech.flac")              # float32 [n], 16 kHz, mono
    feats, mask = log_mel_features([wave])        # models.audio_features

Several channels are averaged into one (as Whisper's own loader, ffmpeg with `-ac 1`,
does); other sampling rates are resampled to 16 kHz with scipy's polyphase filter
(`scipy.signal.resample_poly`, a Kaiser-windowed FIR), or refused by name where scipy is
not installed. A file that cannot be read is one `UserError` naming it.
"""

from __future__ import annotations

import math
import os

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


def read_audio(path: str, *, sampling_rate: int = SAMPLING_RATE) -> np.ndarray:
    """The samples of an audio file as float32 [n] in [-1, 1], mono, at `sampling_rate`.

    Raises:
        UserError: a missing or unreadable file (naming it and the reader's reason), an
            empty one, or one that needs resampling without scipy.
    """
    try:
        import soundfile
    except ImportError:
        raise UserError("reading audio files needs soundfile (pip install soundfile)") from None
    if not os.path.isfile(path):
        raise UserError(f"audio file {path!r} does not exist")
    try:
        data, rate = soundfile.read(path, dtype="float32", always_2d=True)
    except (RuntimeError, soundfile.LibsndfileError, TypeError, ValueError) as e:
        raise UserError(f"cannot read audio file {path!r}: {e}") from None
    if data.shape[0] == 0:
        raise UserError(f"audio file {path!r} has no samples")
    wave = data.mean(axis=1) if data.shape[1] > 1 else data[:, 0]
    return resample(wave, int(rate), sampling_rate)
