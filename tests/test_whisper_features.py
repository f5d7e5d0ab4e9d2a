"""Whisper's log-mel features (models.audio_features) against transformers'
WhisperFeatureExtractor, and reading audio files (models.audio_files): the same features
to float32 tolerance for 80 and 128 mel bins, a batch the same as its examples one at a
time, the mask of real frames, long audio refused or truncated, and named errors for files
that cannot be read or hold fewer frames than their header promises. Audio files are made
in temporary directories."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from models.audio_features import N_FRAMES, N_SAMPLES, SAMPLING_RATE, log_mel_features
from models.audio_files import read_audio, wav_header_frames
from models.errors import UserError

transformers = pytest.importorskip("transformers")
soundfile = pytest.importorskip("soundfile")
pytest.importorskip("torch")


def _waves(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    t = np.arange(52_345) / SAMPLING_RATE
    return [rng.uniform(-0.5, 0.5, 3 * SAMPLING_RATE).astype(np.float32),
            (0.3 * np.sin(2 * np.pi * 440 * t) + rng.normal(0, 0.01, t.size)).astype(np.float32),
            rng.normal(0, 0.1, N_SAMPLES).astype(np.float32),
            rng.normal(0, 1e-4, 161).astype(np.float32)]


@pytest.mark.parametrize("mels", [80, 128])
def test_features_and_mask_equal_whisper_feature_extractor(mels):
    waves = _waves()
    feats, mask = log_mel_features(waves, num_mel_bins=mels)
    theirs = transformers.WhisperFeatureExtractor(feature_size=mels)(
        waves, sampling_rate=SAMPLING_RATE, return_attention_mask=True, return_tensors="np")
    assert feats.dtype == np.float32 and feats.shape == (4, mels, N_FRAMES)
    np.testing.assert_allclose(feats, theirs["input_features"], atol=1e-4, rtol=0)
    np.testing.assert_array_equal(mask, theirs["attention_mask"].astype(bool))
    assert list(mask.sum(1)) == [300, 328, 3000, 2]


def test_a_batch_gives_each_example_the_features_it_has_alone():
    waves = _waves(1)
    feats, mask = log_mel_features(waves)
    for i, wave in enumerate(waves):
        alone, alone_mask = log_mel_features(wave)
        np.testing.assert_array_equal(feats[i], alone[0])
        np.testing.assert_array_equal(mask[i], alone_mask[0])


def test_long_audio_is_refused_by_name_or_truncated_as_transformers_does():
    long = np.random.default_rng(2).normal(0, 0.1, N_SAMPLES + 1600).astype(np.float32)
    with pytest.raises(ValueError, match="30.10 s.*long-form"):
        log_mel_features([long])
    feats, mask = log_mel_features([long], truncate=True)
    theirs = transformers.WhisperFeatureExtractor()([long], sampling_rate=SAMPLING_RATE,
                                                    return_tensors="np")
    np.testing.assert_allclose(feats, theirs["input_features"], atol=1e-4, rtol=0)
    assert mask.all()


@pytest.mark.parametrize("audio, words", [
    ([np.zeros((2, 100), np.float32)], ["audio 0", "1-D"]),
    ([np.zeros(0, np.float32)], ["audio 0", "no samples"]),
    ([np.array([0.0, np.nan])], ["NaN"]),
    ([], ["at least one"]),
])
def test_bad_audio_is_refused_by_name(audio, words):
    with pytest.raises(ValueError) as info:
        log_mel_features(audio)
    for word in words:
        assert word in str(info.value)


def test_another_sampling_rate_is_refused_by_name():
    with pytest.raises(ValueError, match="sampling_rate=8000"):
        log_mel_features([np.zeros(100, np.float32)], sampling_rate=8000)


@pytest.mark.parametrize("fmt, subtype", [("WAV", "PCM_16"), ("FLAC", "PCM_16"),
                                          ("WAV", "FLOAT")])
def test_a_16khz_mono_file_reads_to_its_samples(fmt, subtype, tmp_path):
    wave = _waves()[1][:8000]
    path = str(tmp_path / f"a.{fmt.lower()}")
    soundfile.write(path, wave, SAMPLING_RATE, format=fmt, subtype=subtype)
    got = read_audio(path)
    assert got.dtype == np.float32 and got.shape == wave.shape
    atol = 0 if subtype == "FLOAT" else 1 / 2 ** 15
    np.testing.assert_allclose(got, wave, atol=atol, rtol=0)


def test_stereo_is_averaged_and_other_rates_are_resampled(tmp_path):
    t = np.arange(44_100) / 44_100
    left = 0.5 * np.sin(2 * np.pi * 300 * t)
    right = 0.1 * np.sin(2 * np.pi * 300 * t)
    path = str(tmp_path / "stereo.wav")
    soundfile.write(path, np.stack([left, right], 1).astype(np.float32), 44_100,
                    subtype="FLOAT")
    got = read_audio(path)
    assert got.shape == (16_000,)
    want = 0.3 * np.sin(2 * np.pi * 300 * np.arange(16_000) / 16_000)
    np.testing.assert_allclose(got[200:-200], want[200:-200], atol=1e-3)   # edges: the filter


def test_missing_and_unreadable_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="nope.wav.*does not exist"):
        read_audio(str(tmp_path / "nope.wav"))
    junk = tmp_path / "junk.wav"
    junk.write_bytes(b"RIFF not really a wave file")
    with pytest.raises(ValueError, match="cannot read audio file.*junk.wav"):
        read_audio(str(junk))
    empty = str(tmp_path / "empty.wav")
    soundfile.write(empty, np.zeros(0, np.float32), SAMPLING_RATE)
    with pytest.raises(ValueError, match="no samples"):
        read_audio(empty)


def _with_junk_chunk(raw: bytes) -> bytes:
    """A WAV with an odd-sized chunk (3 bytes and its pad byte) before its data chunk."""
    i = raw.index(b"data")
    out = raw[:i] + b"JUNK" + struct.pack("<I", 3) + b"abc\0" + raw[i:]
    return out[:4] + struct.pack("<I", len(out) - 8) + out[8:]


@pytest.mark.parametrize("subtype, channels, junk", [("PCM_16", 1, False), ("FLOAT", 2, True)],
                         ids=["pcm16-mono", "float-stereo-junk-chunk"])
def test_a_wav_cut_short_is_refused_naming_the_file_and_both_frame_counts(subtype, channels,
                                                                           junk, tmp_path):
    """A truncated download: the header promises 12000 frames, the file holds fewer (which
    libsndfile alone reads without a word)."""
    wave = np.tile(_waves()[1][:12_000, None], (1, channels))
    full = tmp_path / "full.wav"
    soundfile.write(str(full), wave, SAMPLING_RATE, subtype=subtype)
    raw = full.read_bytes()
    raw = _with_junk_chunk(raw) if junk else raw
    whole = tmp_path / "whole.wav"
    whole.write_bytes(raw)
    np.testing.assert_array_equal(read_audio(str(whole)), read_audio(str(full)))  # reads whole
    cut = tmp_path / "cut.wav"
    cut.write_bytes(raw[:len(raw) // 2 + 1])
    frame_bytes = channels * (2 if subtype == "PCM_16" else 4)
    held = (len(raw) // 2 + 1 - raw.index(b"data") - 8) // frame_bytes
    assert soundfile.info(str(cut)).frames == held                # what libsndfile would read
    with pytest.raises(UserError, match=rf"audio file '{cut}' is cut short: its header "
                                        rf"promises 12000 frames, it holds {held} "):
        read_audio(str(cut))


def test_a_flac_cut_short_is_refused_naming_the_file_and_both_frame_counts(tmp_path):
    full = tmp_path / "full.flac"
    soundfile.write(str(full), _waves()[1][:12_000], SAMPLING_RATE, format="FLAC")
    cut = tmp_path / "cut.flac"
    cut.write_bytes(full.read_bytes()[:full.stat().st_size // 2])
    with pytest.raises(UserError, match=rf"audio file '{cut}' is cut short: its header "
                                        r"promises 12000 frames, the first \d+ were read "
                                        r"before the reader failed"):
        read_audio(str(cut))


def test_a_wav_of_unknown_length_as_a_pipe_writes_it_reads_whole(tmp_path):
    """ffmpeg writing to a pipe cannot seek back: its data size says 0xFFFFFFFF."""
    path = tmp_path / "streamed.wav"
    wave = _waves()[1][:12_000]
    soundfile.write(str(path), wave, SAMPLING_RATE, subtype="FLOAT")
    raw = bytearray(path.read_bytes())
    i = raw.index(b"data")
    raw[4:8] = raw[i + 4:i + 8] = struct.pack("<I", 0xFFFFFFFF)
    path.write_bytes(bytes(raw))
    assert wav_header_frames(str(path)) is None
    np.testing.assert_array_equal(read_audio(str(path)), wave)
