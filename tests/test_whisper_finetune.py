"""Fine-tuning Whisper on transcribed clips (`local_speech`, `finetune_speech`).

A tiny random Whisper is built with transformers here (1 + 1 layers, d_model 32, 16 mel
bins, a 1.28 s window of 128 frames) with a tiny byte-level BPE Whisper tokenizer and a
multilingual generation config, saved to a temporary directory; the clips are the espeak-ng
ones of tests/data/speech (six training clips; validation repeats three of them). Checked:
the batches (features, prompt, scored positions), a 40-step run through
`train_and_evaluate` whose loss falls and whose export loads and transcribes to the run's
WER, `freeze_encoder` leaving the encoder bit for bit, WER and CER against a hand-worked
case, and every data and config mistake refused by name.
"""

from __future__ import annotations

import os
import types

import jax
import numpy as np
import pytest
import soundfile

import models
from models.audio_features import window_features
from models.audio_files import read_audio
from models.errors import UserError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CLIPS = os.path.join(os.path.dirname(__file__), "data", "speech")
TRAIN, VALIDATION = (os.path.join(CLIPS, f) for f in ("train.tsv", "validation.tsv"))
SPECIALS = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|fr|>", "<|translate|>",
            "<|transcribe|>", "<|notimestamps|>"]          # ids 0 .. 6
PROMPT = [1, 2, 5, 6]          # <|startoftranscript|> <|en|> <|transcribe|> <|notimestamps|>
GENERATION = dict(decoder_start_token_id=1, eos_token_id=0, pad_token_id=0, bos_token_id=0,
                  lang_to_id={"<|en|>": 2, "<|fr|>": 3},
                  task_to_id={"translate": 4, "transcribe": 5}, no_timestamps_token_id=6,
                  is_multilingual=True, max_length=24)


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models as m, pre_tokenizers, trainers
    texts = [line.split("\t")[1].strip() for line in open(TRAIN)]
    bpe = Tokenizer(m.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts * 5, trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    end = "<|endoftext|>"
    return transformers.WhisperTokenizerFast(tokenizer_object=bpe, unk_token=end,
                                             bos_token=end, eos_token=end, pad_token=end)


@pytest.fixture(scope="module")
def whisper_dir(tmp_path_factory) -> str:
    """A tiny random Whisper with its tokenizer and generation config, saved."""
    tok = _tokenizer()
    config = transformers.WhisperConfig(
        vocab_size=len(tok), d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, num_mel_bins=16, max_source_positions=64,
        max_target_positions=32, pad_token_id=0, bos_token_id=0, eos_token_id=0,
        decoder_start_token_id=1, begin_suppress_tokens=None, suppress_tokens=None)
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(config)
    model.generation_config = transformers.GenerationConfig(**GENERATION)
    path = str(tmp_path_factory.mktemp("whisper") / "tiny")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def speech_config(whisper_dir: str, data_dir: str, **overrides):
    from train import configs
    c = configs.get("finetune_speech")
    c.init_from, c.language, c.data_dir = whisper_dir, "en", data_dir
    c.data_files = f"{TRAIN},{VALIDATION}"
    c.per_device_batch_size, c.eval_per_device_batch_size = 1, 1   # 4 rows on 4 devices
    c.max_target_length, c.max_decode_length = 16, 12
    c.learning_rate, c.warmup_steps = 3e-3, 5
    c.log_every_steps, c.eval_every_steps = 5, 1000
    for key, value in overrides.items():
        c[key] = value
    return c


def test_batches_hold_each_clips_features_and_its_transcript_behind_the_prompt(
        whisper_dir, data_dir):
    from train import data
    from train.objectives.speech import Speech
    pre = models.load(whisper_dir)
    ds = data.load_dataset("local_speech", data_dir, data_files=(TRAIN, VALIDATION))
    assert ds.kind == "speech" and len(ds.split("train")) == 6
    cfg = data.PipelineConfig(per_device_batch_size=1, max_target_length=16, packing=False,
                              target_prefix=tuple(PROMPT[1:]), audio=pre.config.audio)
    batches, _ = data.eval_batches(ds, pre.tokenizer, cfg, "validation")
    batch = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), batches[0])
    text, path, origin = ds.example("validation", 0)
    assert (text, os.path.basename(path), origin) == ("hello world", "hello.flac",
                                                      f"{VALIDATION}:1")
    want, _ = window_features([read_audio(path)], audio=pre.config.audio)
    np.testing.assert_array_equal(batch["inputs"][0], want[0])          # [16, 128]
    np.testing.assert_array_equal(batch["inputs"][3], 0)                 # a padding row
    pieces = pre.tokenizer.encode("hello world")
    row = [*PROMPT[1:], *pieces, 0]
    assert batch["targets"][0, :len(row)].tolist() == row
    objective = Speech(bos_id=1, encoder_decoder=True, prompt=tuple(PROMPT))
    weights = objective.prepare(batch, key=None, row_ids=None)["weights"][0]
    # Scored: the transcript's tokens and the end token, not the language, task and
    # <|notimestamps|> (positions 0-2), nor the padding.
    assert np.asarray(weights).tolist() == [0, 0, 0] + [1] * (len(pieces) + 1) + [0] * (
        16 - len(row))


def test_the_same_clips_in_another_folder_are_their_own_dataset(data_dir, tmp_path):
    """A speech example holds its clip's absolute path and its `file:line`: a copy of the
    same files elsewhere (the first one since deleted, say) must not be read from the first
    one's prepared dataset."""
    import shutil

    from train import data
    first = data.load_dataset("local_speech", data_dir, data_files=(TRAIN, VALIDATION))
    copy = shutil.copytree(CLIPS, tmp_path / "speech")
    files = tuple(str(copy / f) for f in ("train.tsv", "validation.tsv"))
    second = data.load_dataset("local_speech", data_dir, data_files=files)
    text, path, origin = second.example("validation", 0)
    assert (text, path, origin) == ("hello world", str(copy / "hello.flac"), f"{files[1]}:1")
    assert first.example("validation", 0)[2] == f"{VALIDATION}:1"
    assert second.digest == first.digest          # the same contents: the same digest


@pytest.mark.slow
def test_fine_tuning_lowers_the_loss_and_the_export_transcribes(whisper_dir, data_dir,
                                                                tmp_path):
    """40 steps on the six clips (about 30 s on 2 cores): the validation loss ends below
    0.6 ln V (a random model's is ln V = 5.70; measured here 5.70 at step 0 and 2.92 at
    step 40), the logged training loss falls, and the export transcribes the validation
    clips to the run's own WER."""
    import json

    from decode.whisper import transcribe
    from train.objectives import speech_eval
    from train.trainer import train_and_evaluate
    summary = train_and_evaluate(speech_config(whisper_dir, data_dir, num_train_steps=40),
                                 str(tmp_path / "run"))
    vocab = models.load(whisper_dir).config.vocab_size
    val = summary["validation"]
    assert val["loss"] < 0.6 * np.log(vocab), val
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        train_losses = [r["loss"] for r in map(json.loads, f) if r["split"] == "train"]
    assert train_losses[-1] < train_losses[0] - 1.0, train_losses
    assert set(val) >= {"wer", "cer"} and set(summary["test"]) == {"wer", "cer"}

    pre = models.load(summary["model"])
    assert pre.model_type == "whisper"
    paths = [os.path.join(CLIPS, line.split("\t")[0]) for line in open(VALIDATION)]
    feats, _ = window_features([read_audio(p) for p in paths], audio=pre.config.audio)
    out = transcribe(pre, feats, language="en", max_new_tokens=12)
    assert np.asarray(out.prompts).tolist() == [PROMPT] * 3
    hyps = [pre.tokenizer.decode(np.asarray(out.tokens)[i, :int(out.lengths[i])])
            for i in range(3)]
    refs = [line.split("\t")[1].strip() for line in open(VALIDATION)]
    assert speech_eval.error_rates(refs, hyps) == pytest.approx(
        {"wer": val["wer"], "cer": val["cer"]})


@pytest.mark.slow
def test_freeze_encoder_keeps_the_encoder_bit_for_bit_while_the_decoder_trains(
        whisper_dir, data_dir, tmp_path):
    from train.checkpoint import restore_model
    from train.trainer import train_and_evaluate
    config = speech_config(whisper_dir, data_dir, num_train_steps=3, freeze_encoder=True,
                           num_eval_decode=0, num_test_decode=0, warmup_steps=1)
    train_and_evaluate(config, str(tmp_path / "run"))
    start = jax.device_get(models.load(whisper_dir).params)
    end = restore_model(str(tmp_path / "run")).params
    for part in ("src_embed", "encoder"):              # the front end and the layers
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), end[part],
                     start[part])
    for part in ("decoder", "cross_kv", "tgt_tokens"):
        assert any(not np.array_equal(a, b) for a, b in zip(
            jax.tree.leaves(end[part]), jax.tree.leaves(start[part]), strict=True)), part


def test_a_frozen_encoder_gets_no_gradient(whisper_dir):
    """With freeze_encoder the backward pass stops at the encoder's output: its parameters'
    gradients are exactly zero (the decoder's are not)."""
    from train.objectives.speech import ENCODER_PARTS, Speech
    pre = models.load(whisper_dir)
    r = np.random.default_rng(0)
    targets = np.asarray([[2, 5, 6, 9, 10, 0, 0]], np.int32)
    batch = {"inputs": r.normal(size=(1, 16, 128)).astype(np.float32), "targets": targets,
             "targets_segmentation": (np.arange(7) < 6).astype(np.int32)[None],
             "targets_position": np.arange(7, dtype=np.int32)[None]}
    for frozen in (True, False):
        objective = Speech(bos_id=1, encoder_decoder=True, prompt=tuple(PROMPT),
                           freeze_encoder=frozen)
        task = objective.prepare(batch, key=None, row_ids=None)
        grads = jax.jit(jax.grad(lambda p, o=objective, t=task: o.loss_sums(
            pre.model, p, batch, t, dropout_rng=None, sample_rng=None, step=0,
            train=False)["loss"]))(pre.params)
        encoder = [np.abs(g).max() for k in ENCODER_PARTS for g in jax.tree.leaves(grads[k])]
        assert (max(encoder) == 0) == frozen, (frozen, max(encoder))
        assert max(np.abs(g).max() for g in jax.tree.leaves(grads["decoder"])) > 0


def test_a_frozen_encoder_has_no_optimiser_state(whisper_dir):
    from train.objectives.speech import ENCODER_PARTS
    from train.settings import OptimizerSettings
    from train.state import make_optimizer
    params = models.load(whisper_dir).params

    def stored(frozen):
        tx, _ = make_optimizer(OptimizerSettings(), 10, frozen=frozen)
        return sum(x.size for x in jax.tree.leaves(tx.init(params)))

    def size(tree):
        return sum(x.size for x in jax.tree.leaves(tree))

    encoder = size({k: params[k] for k in ENCODER_PARTS})
    # adam's two moments of every trained parameter, plus a step counter or two
    assert 0 <= stored(ENCODER_PARTS) - 2 * (size(params) - encoder) <= 4
    assert stored(()) - stored(ENCODER_PARTS) == 2 * encoder


def test_wer_and_cer_are_jiwers_on_a_hand_worked_case():
    from train.objectives.speech_eval import error_rates
    # Words: "sat" -> "sad" (1 substitution), "world" deleted: 2 errors in 5 words.
    # Characters: t -> d (1), " world" deleted (6): 7 errors in 11 + 11 characters.
    got = error_rates(["the cat sat", "hello world"], ["the cat sad", " hello "])
    assert got == pytest.approx({"wer": 2 / 5, "cer": 7 / 22})
    assert error_rates(["a b"], [""]) == {"wer": 1.0, "cer": 1.0}


def _tsv(tmp_path, lines: list[str], name: str = "bad.tsv") -> str:
    path = tmp_path / name
    path.write_bytes(b"".join(line.encode() if isinstance(line, str) else line
                              for line in lines))
    return str(path)


@pytest.mark.parametrize("lines, words", [
    (["{clip}\thello\n", "{clip} hello\n"], ["bad.tsv:2", "audio_path<TAB>transcript",
                                             "0 tabs"]),
    (["{clip}\thello\tworld\n"], ["bad.tsv:1", "2 tabs"]),
    (["{clip}\t \n"], ["bad.tsv:1", "transcript is empty"]),
    (["\thello\n"], ["bad.tsv:1", "audio path is empty"]),
    (["\n", "missing.flac\thello\n"], ["bad.tsv:2", "missing.flac", "does not exist"]),
    (["notaudio.flac\thello\n"], ["bad.tsv:1", "notaudio.flac", "cannot read"]),
    (["long.flac\thello\n"], ["bad.tsv:1", "long.flac", "31.00 s", "30 s"]),
    ([b"{clip}\thell\xff\n"], ["bad.tsv:1", "UTF-8"]),
])
def test_each_data_mistake_is_an_error_naming_the_file_and_line(lines, words, tmp_path):
    from train.data.local_files import BadLines
    from train.data.speech import read_speech_files
    clip = os.path.join(CLIPS, "yes.flac")
    (tmp_path / "notaudio.flac").write_text("not audio")
    soundfile.write(tmp_path / "long.flac", np.zeros(31 * 16_000, np.float32), 16_000)
    lines = [line.replace("{clip}", clip) if isinstance(line, str)
             else line.replace(b"{clip}", clip.encode()) for line in lines]
    with pytest.raises(UserError) as info:
        read_speech_files((_tsv(tmp_path, lines),), BadLines())
    for word in words:
        assert word in str(info.value)


def test_clips_longer_than_the_models_window_or_gone_are_refused_by_file_and_line():
    from models.audio import AudioInput
    from train.data.speech import check_windows
    clips = [(os.path.join(CLIPS, "yes.flac"), "t.tsv:1"),
             (os.path.join(CLIPS, "numbers.flac"), "t.tsv:2")]
    check_windows(clips, AudioInput(16, 64))                     # 1.28 s: both fit
    with pytest.raises(UserError, match=r"t.tsv:2: .*numbers.flac.* 1.10 s .* 1.04 s"):
        check_windows(clips, AudioInput(16, 52))                 # 1.04 s
    with pytest.raises(UserError, match=r"t.tsv:3: cannot read audio file .*gone.flac"):
        check_windows([*clips, (os.path.join(CLIPS, "gone.flac"), "t.tsv:3")],
                      AudioInput(16, 64))


@pytest.mark.parametrize("overrides, words", [
    (dict(packing=True), ["packing", "one clip"]),
    (dict(dataset="local_translation", freeze_encoder=True), ["freeze_encoder",
                                                              "local_speech"]),
    (dict(dataset="local_translation", language="en"), ["language", "local_speech"]),
    (dict(task="summarize"), ["task", "summarize"]),
])
def test_speech_settings_that_cannot_work_are_refused_by_name(overrides, words,
                                                              whisper_dir, data_dir):
    from train.run_config import RunConfig
    config = speech_config(whisper_dir, data_dir, **overrides)
    with pytest.raises(UserError) as info:
        RunConfig.from_config(config)
    for word in words:
        assert word in str(info.value)


def _fit(model_config, kind: str, *, language="en", generation=None, tok=None):
    from train.objectives.registry import fit
    from train.settings import ObjectiveSettings
    settings = ObjectiveSettings(language=language)
    dataset = types.SimpleNamespace(kind=kind, name=f"local_{kind}", label_names=())
    tok = tok or types.SimpleNamespace(eos_id=0)
    return fit(model_config, dataset, tok, settings, model_name="m", generation=generation)


def test_models_and_data_that_do_not_fit_are_refused_by_name(whisper_dir):
    pre = models.load(whisper_dir)
    _, objective = _fit(pre.config, "speech", generation=pre.generation)
    assert objective.prompt == tuple(PROMPT)
    assert objective.pipeline_options()["target_prefix"] == tuple(PROMPT[1:])
    text_model = models.get_config("transformer-tiny", vocab_size=300)
    with pytest.raises(UserError, match="Whisper model .*reads tokens"):
        _fit(text_model, "speech", generation=pre.generation)
    with pytest.raises(UserError, match="reads audio .*local_speech"):
        _fit(pre.config, "translation")
    with pytest.raises(UserError, match="does not fit dataset .*speech needs a Whisper"):
        _fit(models.get_config("gpt-tiny", vocab_size=300), "speech")
    with pytest.raises(UserError, match="no generation defaults"):
        _fit(pre.config, "speech", generation=None)
    with pytest.raises(UserError, match="multilingual .*set language"):
        _fit(pre.config, "speech", language="", generation=pre.generation)


def test_a_frozen_encoders_state_is_made_into_its_shards(whisper_dir):
    """parallel='sharded' derives the state's shardings from the parameters' logical axes
    (traced on boxed parameters): a frozen encoder's missing moments have none to take."""
    from models.axes import DEFAULT_RULES
    from train import sharding
    from train.objectives.speech import ENCODER_PARTS, Speech
    from train.settings import OptimizerSettings
    from train.state import TrainState, make_optimizer
    from train.step import Steps
    pre = models.load(whisper_dir)
    tx, schedule = make_optimizer(OptimizerSettings(), 10, frozen=ENCODER_PARTS)
    objective = Speech(bos_id=1, encoder_decoder=True, prompt=tuple(PROMPT),
                       freeze_encoder=True)
    wrapper = sharding.for_model(Steps(pre.model, objective, schedule), tx,
                                 mesh=sharding.make_mesh((1, -1, 1)),
                                 rules=sharding.check_rules(DEFAULT_RULES))
    state = wrapper.init_state(lambda p: TrainState.create(p, tx, 0), pre.params)
    moments = sum(x.size for x in jax.tree.leaves(state.opt_state))
    trained = sum(x.size for k, v in pre.params.items() if k not in ENCODER_PARTS
                  for x in jax.tree.leaves(v))
    assert 0 <= moments - 2 * trained <= 4
