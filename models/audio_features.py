"""Whisper's input features: log-mel spectrograms of 30 s windows of 16 kHz audio, in numpy.

Computed outside the jitted model (the encoder reads them, `models.audio`), the same as
transformers' `WhisperFeatureExtractor` to float32 tolerance:

    audio -> zeros after it up to 480,000 samples (30 s)
          -> STFT: n_fft 400, hop 160, periodic Hann window, centred (reflect padding),
             3001 frames, the last dropped -> power |X|^2 [3000, 201]
          -> Slaney mel filterbank (0 to 8 kHz, area-normalised) -> [M, 3000]
          -> log10(max(x, 1e-10)), floored at (its maximum - 8), then (x + 4) / 4

Each example is scaled by its own maximum, so a batch gives the features of its examples
one at a time. The mask marks the frames of real audio (frame f starts at sample 160 f),
as the extractor's `return_attention_mask=True` gives it; Whisper's encoder reads every
frame all the same.

    feats, mask = log_mel_features([wave_a, wave_b])   # float32 [2, 80, 3000], bool [2, 3000]

A model reads its own window of these (`window_features`): every Whisper checkpoint's is
the whole 30 s; a tiny test model's the first `audio.num_frames` frames.

Audio longer than 30 s is refused by name unless `truncate=True` (the extractor's default,
which keeps the first 30 s): long-form transcription is not implemented.
"""

from __future__ import annotations

import functools

import numpy as np

from models.errors import UserError

SAMPLING_RATE = 16_000
N_FFT = 400
HOP_LENGTH = 160
CHUNK_SECONDS = 30
N_SAMPLES = CHUNK_SECONDS * SAMPLING_RATE          # 480,000
N_FRAMES = N_SAMPLES // HOP_LENGTH                 # 3,000


def _hertz_to_mel(hertz: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above."""
    hertz = np.asarray(hertz, np.float64)
    step = np.log(6.4) / 27.0
    return np.where(hertz < 1000.0, 3.0 * hertz / 200.0,
                    15.0 + np.log(np.maximum(hertz, 1e-10) / 1000.0) / step)


def _mel_to_hertz(mels: np.ndarray) -> np.ndarray:
    step = np.log(6.4) / 27.0
    return np.where(mels < 15.0, 200.0 * mels / 3.0, 1000.0 * np.exp(step * (mels - 15.0)))


@functools.lru_cache(maxsize=4)
def mel_filters(num_mel_bins: int, n_fft: int = N_FFT,
                sampling_rate: int = SAMPLING_RATE) -> np.ndarray:
    """float64[n_fft // 2 + 1, num_mel_bins]: triangular filters whose corners are evenly
    spaced in Slaney mels from 0 Hz to sampling_rate / 2, each scaled by 2 / its width in
    Hz (equal area)."""
    bins = n_fft // 2 + 1
    corners = _mel_to_hertz(np.linspace(_hertz_to_mel(0.0), _hertz_to_mel(sampling_rate / 2),
                                        num_mel_bins + 2))
    fft_hz = np.linspace(0, sampling_rate // 2, bins)
    width = np.diff(corners)
    slopes = corners[None, :] - fft_hz[:, None]                     # [bins, M + 2]
    rising = -slopes[:, :-2] / width[:-1]
    falling = slopes[:, 2:] / width[1:]
    filters = np.maximum(0.0, np.minimum(rising, falling))
    return filters * (2.0 / (corners[2:] - corners[:-2]))[None, :]


@functools.lru_cache(maxsize=1)
def _hann(n: int) -> np.ndarray:
    """The periodic Hann window of n samples (the first n of n + 1)."""
    return 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(n) / n)


def _log_mel(wave: np.ndarray, num_mel_bins: int) -> np.ndarray:
    """float32[M, N_FRAMES] of one wave of N_SAMPLES samples."""
    padded = np.pad(wave.astype(np.float64), N_FFT // 2, mode="reflect")
    starts = np.arange(N_FRAMES + 1) * HOP_LENGTH
    frames = padded[starts[:, None] + np.arange(N_FFT)[None, :]] * _hann(N_FFT)[None, :]
    power = np.abs(np.fft.rfft(frames, axis=1)[:-1]) ** 2                   # [3000, 201]
    mel = (power @ mel_filters(num_mel_bins)).T                             # [M, 3000]
    log = np.log10(np.maximum(mel, 1e-10))
    log = np.maximum(log, log.max() - 8.0)
    return ((log + 4.0) / 4.0).astype(np.float32)


def _as_wave(audio, index: int) -> np.ndarray:
    wave = np.asarray(audio)
    if wave.ndim != 1 or not (np.issubdtype(wave.dtype, np.floating)
                              or np.issubdtype(wave.dtype, np.integer)):
        raise UserError(f"audio {index} must be a 1-D array of samples (mono), got "
                        f"{wave.dtype} {wave.shape}")
    if wave.size == 0:
        raise UserError(f"audio {index} has no samples")
    if not np.isfinite(wave).all():
        raise UserError(f"audio {index} holds NaN or Inf samples")
    return wave


def log_mel_features(audios, *, num_mel_bins: int = 80, sampling_rate: int = SAMPLING_RATE,
                     truncate: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Whisper's features of a batch of mono waves (see the module docstring).

    Args:
        audios: a list of 1-D arrays of samples (floats in [-1, 1]), or one such array.
        num_mel_bins: 80, or 128 for Whisper large-v3 (the model's `audio.num_mel_bins`).
        sampling_rate: must be 16,000 (resample first, `models.audio_files`).
        truncate: keep the first 30 s of longer audio instead of refusing it.

    Returns:
        float32 features [B, num_mel_bins, 3000] and bool[B, 3000], the frames of real
        audio.

    Raises:
        UserError: another sampling rate, audio that is not 1-D, empty, non-finite, or
            longer than 30 s without `truncate`.
    """
    if sampling_rate != SAMPLING_RATE:
        raise UserError(f"Whisper's features need {SAMPLING_RATE} Hz audio, not "
                        f"sampling_rate={sampling_rate} (resample it first)")
    if isinstance(audios, np.ndarray) and audios.ndim == 1:
        audios = [audios]
    waves = [_as_wave(a, i) for i, a in enumerate(audios)]
    if not waves:
        raise UserError("log_mel_features needs at least one audio")
    feats, mask = [], np.zeros((len(waves), N_FRAMES), bool)
    for i, wave in enumerate(waves):
        if wave.size > N_SAMPLES and not truncate:
            raise UserError(
                f"audio {i} is {wave.size / SAMPLING_RATE:.2f} s long: Whisper reads "
                f"{CHUNK_SECONDS} s windows and long-form transcription is not supported "
                "(split the audio, or truncate=True to keep its first 30 s)")
        wave = wave[:N_SAMPLES].astype(np.float32)
        mask[i, :-(-wave.size // HOP_LENGTH)] = True
        feats.append(_log_mel(np.pad(wave, (0, N_SAMPLES - wave.size)), num_mel_bins))
    return np.stack(feats), mask


def window_features(audios, *, audio, truncate: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The features a model with `audio` (a `models.audio.AudioInput`) reads: those of
    `log_mel_features`, cut to the model's window of `audio.num_frames` frames. Every
    Whisper checkpoint's window is 30 s (3000 frames), where this is `log_mel_features`
    itself; a smaller model (the tests' tiny ones) reads the first frames of the same
    features:

        window_features([wave], audio=AudioInput(8, 125))   # [1, 8, 250]: the first 2.5 s

    Args:
        audios: as `log_mel_features` takes them (16 kHz mono waves).
        audio: the model's `config.audio`.
        truncate: keep the first `window_seconds(audio)` of longer audio instead of
            refusing it.

    Returns:
        float32 features [B, num_mel_bins, num_frames] and bool[B, num_frames].

    Raises:
        UserError: audio longer than the window (without `truncate`), a window longer than
            30 s, or what `log_mel_features` refuses.
    """
    frames = audio.num_frames
    if frames > N_FRAMES:
        raise UserError(f"the model reads {frames} frames ({frames * HOP_LENGTH / SAMPLING_RATE:g}"
                        f" s), more than Whisper's {CHUNK_SECONDS} s window of {N_FRAMES}")
    if isinstance(audios, np.ndarray) and audios.ndim == 1:
        audios = [audios]
    waves = [_as_wave(a, i) for i, a in enumerate(audios)]
    limit = frames * HOP_LENGTH
    for i, wave in enumerate(waves):
        if wave.size > limit and not truncate:
            raise UserError(f"audio {i} is {wave.size / SAMPLING_RATE:.2f} s long, over the "
                            f"model's window of {window_seconds(audio):g} s "
                            f"({frames} frames)")
    feats, mask = log_mel_features([w[:limit] for w in waves], num_mel_bins=audio.num_mel_bins)
    return feats[:, :, :frames], mask[:, :frames]


def window_seconds(audio) -> float:
    """How much audio a model with `audio` (`AudioInput`) reads: 30 s for Whisper."""
    return audio.num_frames * HOP_LENGTH / SAMPLING_RATE
