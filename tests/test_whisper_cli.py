"""`python -m decode --audio` end to end (in-process, through `main(argv)`): a tiny random
Whisper that reads real 30 s windows (1500 positions), with a word-level tokenizer, on WAV
files of synthetic tones written here. One line per file in order, the text transformers'
generate gives; files of different lengths batched give what each gives alone (greedy and
beam); each mistake is one `error:` line and exit 2.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import decode.__main__ as decode_cli
import models
from tests import pretrained_helpers as ph
from tests.test_pretrained_whisper import _ENGLISH, _GENERATION, random_whisper

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
soundfile = pytest.importorskip("soundfile")
highest_precision = ph.highest_precision

FIELDS = dict(vocab_size=96, d_model=32, encoder_attention_heads=4, decoder_attention_heads=4,
              encoder_ffn_dim=48, decoder_ffn_dim=48, max_target_positions=24,
              pad_token_id=0, bos_token_id=1, eos_token_id=11, decoder_start_token_id=2,
              begin_suppress_tokens=None, num_mel_bins=80, encoder_layers=1,
              decoder_layers=2, max_source_positions=1500)
# <|notimestamps|> is the last id: transformers reads every id after it as a timestamp
# (which would cut its output into segments).
NO_TIMESTAMPS = 95
GENERATION = dict(_GENERATION, no_timestamps_token_id=NO_TIMESTAMPS)
ENGLISH = dict(_ENGLISH, no_timestamps_token_id=NO_TIMESTAMPS,
               forced_decoder_ids=[[1, NO_TIMESTAMPS]])
SPECIAL = {0: "<|pad|>", 1: "<|bos|>", 2: "<|startoftranscript|>", 11: "<|endoftext|>",
           50: "<|en|>", 51: "<|fr|>", 52: "<|de|>", 60: "<|transcribe|>",
           61: "<|translate|>", NO_TIMESTAMPS: "<|notimestamps|>"}


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers
    vocab = {SPECIAL.get(i, f"w{i}"): i for i in range(FIELDS["vocab_size"])}
    raw = Tokenizer(tok_models.WordLevel(vocab, unk_token="<|pad|>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.decoder = decoders.WordPiece(prefix="##")        # words joined by spaces
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, pad_token="<|pad|>", bos_token="<|bos|>",
        eos_token="<|endoftext|>", unk_token="<|pad|>",
        additional_special_tokens=[t for i, t in SPECIAL.items() if i not in (0, 1, 11)])


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    """(transformers model, its directory with a tokenizer, an English-only copy, a
    directory of WAV files: tones of 0.6 s to 3 s, one at 22.05 kHz in stereo)."""
    root = tmp_path_factory.mktemp("whisper_cli")
    model = random_whisper(FIELDS, seed=1, scale=0.5)
    model.generation_config = transformers.GenerationConfig(**GENERATION)
    path = str(root / "model")
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    english = ph.copy_dir(path, root / "english")
    with open(os.path.join(english, "generation_config.json"), "w") as f:
        json.dump(ENGLISH, f)
    files = []
    for i, (seconds, hz, rate, channels) in enumerate(
            [(0.6, 440, 16000, 1), (3.0, 1250, 16000, 1), (1.7, 300, 22050, 2),
             (2.2, 2000, 16000, 1)]):
        t = np.arange(int(seconds * rate)) / rate
        wave = 0.5 * np.sin(2 * np.pi * hz * t) * np.exp(-t)
        wave = np.stack([wave, 0.5 * wave], 1) if channels == 2 else wave
        files.append(str(root / f"tone{i}.wav"))
        soundfile.write(files[-1], wave.astype(np.float32), rate)
    return model, path, english, files


def _lines(capsys, argv) -> list[str]:
    assert decode_cli.main(argv) == 0
    return capsys.readouterr().out.split("\n")[:-1]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_audio_files_batched_give_each_files_text_alone_and_transformers(
        strategy, whisper, capsys, highest_precision):
    model, path, _, files = whisper
    argv = ["--model", path, "--no-compile-cache", "--strategy", strategy, "--beam-size", "3",
            "--audio"]
    batched = _lines(capsys, [*argv, *files, "--batch-size", "3"])
    alone = [_lines(capsys, [*argv, f, "--batch-size", "1"])[0] for f in files]
    assert batched == alone
    assert len(set(batched)) == len(files)                      # not one text for all
    feats = models.audio_features.log_mel_features(
        [models.audio_files.read_audio(f) for f in files])[0]
    with torch.no_grad():
        out = model.generate(torch.as_tensor(feats), num_beams=3 if strategy == "beam" else 1)
    assert batched == _tokenizer().batch_decode(out, skip_special_tokens=True)


@pytest.mark.slow
def test_language_and_task_set_the_prompt(whisper, capsys, highest_precision):
    model, path, _, files = whisper
    got = _lines(capsys, ["--model", path, "--audio", *files[:2], "--language", "de",
                          "--task", "translate", "--no-compile-cache"])
    feats = models.audio_features.log_mel_features(
        [models.audio_files.read_audio(f) for f in files[:2]])[0]
    with torch.no_grad():
        out = model.generate(torch.as_tensor(feats), language="de", task="translate")
    assert got == _tokenizer().batch_decode(out, skip_special_tokens=True)


def _error(capsys, argv) -> str:
    assert decode_cli.main([*argv, "--no-compile-cache"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_audio_mistakes_are_one_error_line_and_exit_2(whisper, capsys, tmp_path):
    _, path, english, files = whisper
    gpt = str(tmp_path / "gpt")
    cfg = models.get_config("gpt-tiny", num_layers=1)
    params = models.build(cfg).init(__import__("jax").random.key(0),
                                    np.zeros((1, 4), np.int32))["params"]
    models.save(gpt, cfg, params)
    garbage = tmp_path / "noise.wav"
    garbage.write_bytes(b"RIFF not really a wave file")
    long = str(tmp_path / "long.wav")
    soundfile.write(long, np.zeros(31 * 16000, np.float32), 16000)
    cases = [
        (["--model", gpt, "--audio", files[0]], ["--audio needs a Whisper model", gpt]),
        (["--model", path, "--audio", files[0], "--", "some text"], ["text inputs"]),
        (["--model", path, "--audio", str(tmp_path / "gone.wav")],
         ["gone.wav", "does not exist"]),
        (["--model", path, "--audio", str(garbage)], ["noise.wav", "cannot read"]),
        (["--model", path, "--audio", files[0], long], ["long.wav", "31.00 s", "--truncate"]),
        (["--model", path, "--audio", files[0], "--language", "xx"], ["language='xx'"]),
        (["--model", english, "--audio", files[0], "--task", "translate"],
         ["task='translate'", "task_to_id"]),
        (["--model", english, "--audio", files[0], "--language", "en"], ["English-only"]),
        (["--config", "whisper-tiny", "--audio", files[0]], ["--audio needs", "preset"]),
        (["--model", path, "--audio", files[0], "--temperature", "0.5"], ["--temperature"]),
        (["--model", path, "--language", "en", "x"], ["--language applies to --audio"]),
    ]
    for argv, words in cases:
        line = _error(capsys, argv)
        for word in words:
            assert word in line, (argv, line)


def test_a_model_with_a_shorter_window_reads_its_own_window(whisper, capsys, tmp_path,
                                                            highest_precision):
    """A model whose encoder reads 1 s (100 frames; a fine-tuned tiny model, say) gets the
    first second of each file's features, what transformers' generate gives on them; a
    longer file is refused naming that window, and --truncate keeps its first second."""
    fields = dict(FIELDS, max_source_positions=50)
    model = random_whisper(fields, seed=2, scale=0.5)
    model.generation_config = transformers.GenerationConfig(**GENERATION)
    path = str(tmp_path / "short")
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    files = whisper[3]
    got = _lines(capsys, ["--model", path, "--no-compile-cache", "--audio", files[0],
                          "--language", "en"])
    feats = models.audio_features.log_mel_features(
        [models.audio_files.read_audio(files[0])])[0][:, :, :100]
    with torch.no_grad():
        out = model.generate(torch.as_tensor(feats), language="en")
    assert got == _tokenizer().batch_decode(out, skip_special_tokens=True)
    line = _error(capsys, ["--model", path, "--audio", files[1], "--language", "en"])
    assert "3.00 s" in line and "1 s windows" in line and "--truncate" in line, line
    truncated = _lines(capsys, ["--model", path, "--no-compile-cache", "--audio", files[1],
                                "--language", "en", "--truncate"])
    feats = models.audio_features.log_mel_features(
        [models.audio_files.read_audio(files[1])[:16000]])[0][:, :, :100]
    with torch.no_grad():
        out = model.generate(torch.as_tensor(feats), language="en")
    assert truncated == _tokenizer().batch_decode(out, skip_special_tokens=True)
