"""Speech data (`local_speech`): TSV files of `audio_path<TAB>transcript` lines, and the
clips' log-mel features, made on the host for each batch.

    train.tsv        clips/a.flac<TAB>hello world        (paths relative to the TSV's folder)
                     clips/b.wav<TAB>good morning

Every line is checked when the dataset is prepared, and a mistake is an error naming the
file and line (`train.tsv:2: ...`), not a skipped line: a line without exactly one tab, an
empty path or transcript, invalid UTF-8, an audio file that is missing, unreadable or
empty (`models.audio_files.read_audio` reads each clip whole), or longer than Whisper's
30 s window. Blank lines alone are skipped (and counted, as the other local files count
them). Files become splits as the other local data do (`train.data.local_files`): one file
90/5/5 by a hash of each line, two are train and validation (= test), three are train,
validation and test.

A prepared example is (transcript, the audio file's absolute path, "file:line"). The
pipeline tokenises the transcript (`train.data.kinds.TRANSCRIPT_ROLE`) and computes each
row's features from its file when the batch is made (`batch_features`): one clip a row, no
packing. Each run checks every clip's header against the model's window again
(`check_windows`: 30 s, or a tiny test model's shorter one), naming the file and line of
a clip edited or removed since.
"""

from __future__ import annotations

import os

import numpy as np

from models.audio_features import (
    CHUNK_SECONDS,
    SAMPLING_RATE,
    window_features,
    window_seconds,
)
from models.audio_files import read_audio
from models.errors import UserError
from train.data.local_files import BadLines, _assign_splits

FORMAT = "each line must be audio_path<TAB>transcript"


def read_speech_files(files: tuple[str, ...], bad: BadLines) -> dict[str, list]:
    """(transcript, audio path, "file:line") of every line of the TSV files, split as the
    module docstring says; every clip read once to check it.

    Raises:
        UserError: the first bad line, naming its file and line number and what is wrong.
    """
    sources = [list(_speech_lines(path, bad)) for path in files]
    return _assign_splits(sources, key=lambda example: f"{example[1]}\t{example[0]}")


def _speech_lines(path: str, bad: BadLines):
    folder = os.path.dirname(os.path.abspath(path))
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError:
                raise UserError(f"{where}: not valid UTF-8") from None
            if not line.strip():
                bad.add(path, number, "blank line")
                continue
            fields = line.split("\t")
            if len(fields) != 2:
                raise UserError(f"{where}: {FORMAT}; this one has {len(fields) - 1} tabs: "
                                f"{line[:60]!r}")
            audio, text = fields[0].strip(), fields[1].strip()
            if not audio or not text:
                raise UserError(f"{where}: {FORMAT}; the "
                                f"{'audio path' if not audio else 'transcript'} is empty")
            full = os.path.abspath(os.path.join(folder, audio))
            _check_clip(full, where)
            yield text, full, where


def _check_clip(path: str, where: str) -> None:
    """Reads the clip whole: missing, unreadable, empty or over 30 s is an error."""
    try:
        wave = read_audio(path)
    except UserError as e:
        raise UserError(f"{where}: {e}") from None
    seconds = wave.size / SAMPLING_RATE
    if seconds > CHUNK_SECONDS:
        raise UserError(f"{where}: audio file {path!r} is {seconds:.2f} s long, over "
                        f"Whisper's {CHUNK_SECONDS} s window (split it into clips of at most "
                        f"{CHUNK_SECONDS} s, each with its own transcript)")


def check_windows(clips, audio) -> None:
    """Refuses clips longer than the window of a model with `audio` (an `AudioInput`; 30 s
    for every Whisper checkpoint, less for a tiny test model), reading each file's header
    alone, every time a run starts: a clip edited or removed since the data were prepared
    is named here, not in the middle of training. `clips` are (path, "file:line") pairs.

    Raises:
        UserError: naming the first such clip's file and line, its length and the window,
            or a clip that can no longer be read.
    """
    import soundfile
    limit = window_seconds(audio)
    for path, where in clips:
        try:
            info = soundfile.info(path)
        except (RuntimeError, soundfile.LibsndfileError, TypeError, ValueError) as e:
            raise UserError(f"{where}: cannot read audio file {path!r}: {e}") from None
        seconds = info.frames / info.samplerate
        if seconds > limit:
            raise UserError(f"{where}: audio file {path!r} is {seconds:.2f} s long, over the "
                            f"model's window of {limit:g} s ({audio.num_frames} frames)")


def batch_features(paths: list[str | None], audio) -> np.ndarray:
    """float32 [len(paths), num_mel_bins, num_frames]: each clip's features in the window
    of a model with `audio` (`models.audio_features.window_features`); zeros for a row
    without a clip (None: padding)."""
    out = np.zeros((len(paths), audio.num_mel_bins, audio.num_frames), np.float32)
    real = [i for i, p in enumerate(paths) if p is not None]
    if real:
        feats, _ = window_features([read_audio(paths[i]) for i in real], audio=audio)
        out[real] = feats
    return out
