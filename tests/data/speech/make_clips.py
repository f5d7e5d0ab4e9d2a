"""Rebuilds the speech clips of tests/test_whisper_finetune.py with eSpeak NG.

    apt-get install -y espeak-ng          # the clips were made with eSpeak NG 1.51
    python tests/data/speech/make_clips.py

Each clip is one phrase (`CLIPS`) spoken by espeak-ng's default English voice at 170 words
a minute, resampled from espeak's 22,050 Hz to 16 kHz mono (models.audio_files.resample),
followed by silence up to 1 s when shorter, and written as 16-bit FLAC beside this
script, with train.tsv (every clip) and validation.tsv (three of them again: the test
fine-tunes a tiny model until it transcribes what it trained on, so the validation clips
repeat training clips on purpose).
CI never runs espeak: the clips are committed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import numpy as np
import soundfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))

from models.audio_files import resample  # noqa: E402

CLIPS = {
    "yes.flac": "yes",
    "no.flac": "no",
    "hello.flac": "hello world",
    "numbers.flac": "one two three",
    "cat.flac": "the cat sat",
    "morning.flac": "good morning",
}
VALIDATION = ("hello.flac", "numbers.flac", "cat.flac")
MIN_SAMPLES = 16_000                    # a clip lasts at least 1 s


def main() -> None:
    version = subprocess.run(["espeak-ng", "--version"], capture_output=True, text=True,
                             check=True).stdout.strip()
    print(version)
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in CLIPS.items():
            wav = os.path.join(tmp, "clip.wav")
            subprocess.run(["espeak-ng", "-v", "en", "-s", "170", "-w", wav, text], check=True)
            wave, rate = soundfile.read(wav, dtype="float32")
            wave = resample(wave, int(rate))
            wave = np.pad(wave, (0, max(0, MIN_SAMPLES - len(wave))))     # silence after
            soundfile.write(os.path.join(HERE, name), wave, 16_000, subtype="PCM_16")
            print(f"{name}: {len(wave) / 16_000:.2f} s, {text!r}")
    with open(os.path.join(HERE, "train.tsv"), "w") as f:
        f.writelines(f"{name}\t{text}\n" for name, text in CLIPS.items())
    with open(os.path.join(HERE, "validation.tsv"), "w") as f:
        f.writelines(f"{name}\t{CLIPS[name]}\n" for name in VALIDATION)


if __name__ == "__main__":
    main()
