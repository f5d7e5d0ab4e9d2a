"""models.load / models.save of `whisper` against transformers' WhisperForConditionalGeneration.

Tiny random checkpoints built here (two shapes: 8 mel bins and as many decoder layers as
encoder layers; 12 mel bins and fewer decoder layers, as distil and turbo have) on random
features: a loaded model gives transformers' encoder output and teacher-forced logits (fp32,
highest matmul precision, eager attention), and the same logits through init_cache, a
prefill and cached steps, looped or scanned; `models.save` writes files transformers loads
to the same tensors bit for bit; every published Whisper size's config loads, and values
the project cannot compute are refused by name.
"""

from __future__ import annotations

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models.audio import AudioInput, whisper_sinusoids
from models.pretrained import FAMILIES, read_config
from tests import pretrained_helpers as ph
from tests.pretrained_helpers import assert_same_params, assert_same_tensors, stack_layers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
safetensors_numpy = pytest.importorskip("safetensors.numpy")
highest_precision = ph.highest_precision                     # the shared fixture

ATOL = 1e-4
B, T, PREFILL, CACHE_LEN = 2, 7, 3, 16
_SMALL = dict(vocab_size=96, d_model=32, encoder_attention_heads=4, decoder_attention_heads=4,
              encoder_ffn_dim=48, decoder_ffn_dim=48, max_target_positions=24,
              pad_token_id=0, bos_token_id=1, eos_token_id=1, decoder_start_token_id=2,
              begin_suppress_tokens=None)
CASES = {
    "tiny": dict(_SMALL, num_mel_bins=8, encoder_layers=2, decoder_layers=2,
                 max_source_positions=12),
    "distil-12-mels": dict(_SMALL, num_mel_bins=12, encoder_layers=3, decoder_layers=1,
                           max_source_positions=10),
}


def random_whisper(fields: dict, seed: int = 0, scale: float = 0.15):
    """A transformers Whisper with random weights (norm scales near 1, the rest near 0) and
    the encoder position table we compute (so a round trip is bit for bit)."""
    model = transformers.WhisperForConditionalGeneration(
        transformers.WhisperConfig(**fields)).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("encoder.embed_positions.weight"):
                p.copy_(torch.as_tensor(whisper_sinusoids(*p.shape)))
                continue
            is_scale = p.ndim == 1 and "layer_norm" in name and name.endswith("weight")
            p.copy_(torch.randn_like(p) * scale + (1.0 if is_scale else 0.0))
    return model


def random_features(fields: dict, batch: int = B, seed: int = 0) -> np.ndarray:
    shape = (batch, fields["num_mel_bins"], 2 * fields["max_source_positions"])
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def hf_logits(model, features, tgt_in) -> np.ndarray:
    with torch.no_grad():
        return model(input_features=torch.as_tensor(features),
                     decoder_input_ids=torch.as_tensor(tgt_in, dtype=torch.long)
                     ).logits.float().numpy()


def hf_load(path: str):
    model, info = transformers.WhisperForConditionalGeneration.from_pretrained(
        path, attn_implementation="eager", output_loading_info=True)
    assert not any(info.values()), info          # no missing, unexpected or mismatched tensors
    return model.eval()


class Case:
    def __init__(self, name: str, root: str):
        self.fields = CASES[name]
        self.model = random_whisper(self.fields)
        self.path = os.path.join(root, name)
        self.model.save_pretrained(self.path)
        self.model = hf_load(self.path)                     # eager attention
        self.state = ph.state_of(self.model)
        self.features = random_features(self.fields)
        self.tgt_in = np.random.default_rng(1).integers(
            0, self.fields["vocab_size"], (B, T)).astype(np.int32)
        self.tgt_in[:, 0] = self.fields["decoder_start_token_id"]
        self.logits = hf_logits(self.model, self.features, self.tgt_in)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    made = {}

    def get(name: str) -> Case:
        if name not in made:
            made[name] = Case(name, str(tmp_path_factory.mktemp("whisper")))
        return made[name]

    return get


@pytest.mark.parametrize("name", list(CASES))
def test_loaded_model_gives_transformers_encoder_output_and_logits(name, case,
                                                                   highest_precision):
    c = case(name)
    pre = models.load(c.path)
    assert pre.model_type == "whisper"
    assert pre.config.audio == AudioInput(c.fields["num_mel_bins"],
                                                 c.fields["max_source_positions"])
    assert pre.config.num_decoder_layers == c.fields["decoder_layers"]
    with torch.no_grad():
        want = c.model.get_encoder()(torch.as_tensor(c.features)).last_hidden_state.numpy()
    got = pre.model.apply({"params": pre.params}, jnp.asarray(c.features), method="encode")
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    logits = pre.model.apply({"params": pre.params}, jnp.asarray(c.features),
                             jnp.asarray(c.tgt_in))
    np.testing.assert_allclose(logits, c.logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("scan", [False, True])
def test_init_cache_prefill_then_steps_give_transformers_logits(scan, case, highest_precision):
    c = case("distil-12-mels")
    pre = models.load(c.path, scan_layers=scan)
    apply = pre.model.apply
    v = {"params": pre.params}
    cache = apply(v, jnp.asarray(c.features), CACHE_LEN, method="init_cache")
    lens = jnp.full((B,), PREFILL, jnp.int32)
    logits, cache = apply(v, jnp.asarray(c.tgt_in[:, :PREFILL]), lens, cache, method="prefill")
    np.testing.assert_allclose(logits, c.logits[:, :PREFILL], atol=ATOL, rtol=0)
    for t in range(PREFILL, T):
        step, cache = apply(v, jnp.asarray(c.tgt_in[:, t]), cache, method="step")
        np.testing.assert_allclose(step, c.logits[:, t], atol=ATOL, rtol=0, err_msg=f"step {t}")
    np.testing.assert_array_equal(cache.lengths, [T, T])


@pytest.mark.slow
def test_load_then_save_gives_files_transformers_loads_to_the_same_tensors(case, tmp_path):
    c = case("tiny")
    pre = models.load(c.path)
    same = str(tmp_path / "same")
    assert models.save(same, pre.config, pre.params, generation=pre.generation) == "whisper"
    with open(os.path.join(same, "config.json")) as f:
        written = json.load(f)
    assert written["model_type"] == "whisper"
    assert written["architectures"] == ["WhisperForConditionalGeneration"]
    # <|endoftext|> as bos_token_id, as published configs hold it (not transformers' default)
    assert written["bos_token_id"] == written["eos_token_id"] == pre.config.eos_id
    again = hf_load(same)
    assert_same_tensors(c.state, again)
    np.testing.assert_array_equal(hf_logits(again, c.features, c.tgt_in), c.logits)
    assert_same_params(models.load(same).params, pre.params)
    scanned = models.load(c.path, scan_layers=True)
    assert_same_params(scanned.params, stack_layers(pre.params))
    models.save(str(tmp_path / "scanned"), scanned.config, scanned.params)
    with open(os.path.join(same, "model.safetensors"), "rb") as a, open(
            tmp_path / "scanned" / "model.safetensors", "rb") as b:
        assert a.read() == b.read()


def test_a_bfloat16_checkpoint_loads_close_to_the_float32_logits(case, tmp_path,
                                                                 highest_precision):
    c = case("tiny")
    path = str(tmp_path / "bf16")
    c.model.to(torch.bfloat16).save_pretrained(path)
    c.model.to(torch.float32)
    pre = models.load(path, param_dtype="bfloat16")
    assert {x.dtype for x in jax.tree.leaves(pre.params)} == {jnp.dtype("bfloat16")}
    logits = pre.model.apply({"params": pre.params}, jnp.asarray(c.features),
                             jnp.asarray(c.tgt_in))
    np.testing.assert_allclose(logits, c.logits, atol=0.1, rtol=0)


def _edited(c: Case, tmp_path, edit) -> str:
    path = ph.copy_dir(c.path, tmp_path / "edited")
    return ph.edit_config(path, edit)


@pytest.mark.parametrize("fields, words", [
    (dict(scale_embedding=True), ["scale_embedding", "True"]),
    (dict(encoder_layerdrop=0.1), ["encoder_layerdrop", "0.1"]),
    (dict(decoder_layerdrop=0.2), ["decoder_layerdrop", "0.2"]),
    (dict(use_weighted_layer_sum=True), ["use_weighted_layer_sum"]),
    (dict(decoder_attention_heads=2), ["decoder_attention_heads", "2"]),
    (dict(decoder_ffn_dim=64), ["decoder_ffn_dim", "64"]),
    (dict(activation_function="tanh"), ["activation_function", "tanh"]),
    (dict(tie_word_embeddings=False), ["tie_word_embeddings", "False"]),
    (dict(some_new_switch=1), ["some_new_switch"]),
])
def test_config_values_whisper_cannot_compute_are_refused_by_name(fields, words, case,
                                                                  tmp_path):
    ph.assert_refused_by_name(_edited(case("tiny"), tmp_path, ph.set_fields(**fields)), words)


def test_training_only_spec_augment_fields_are_accepted(case, tmp_path):
    path = _edited(case("tiny"), tmp_path, ph.set_fields(
        apply_spec_augment=True, mask_time_prob=0.3, mask_feature_prob=0.1,
        median_filter_width=5, classifier_proj_size=16))
    assert read_config(path)[1] == read_config(case("tiny").path)[1]


def _rewrite_positions(c: Case, tmp_path, table) -> str:
    path = ph.copy_dir(c.path, tmp_path / "positions")
    file = os.path.join(path, "model.safetensors")
    tensors = safetensors_torch.load_file(file)
    tensors["model.encoder.embed_positions.weight"] = torch.as_tensor(table)
    safetensors_torch.save_file(tensors, file, metadata={"format": "pt"})
    manifest = os.path.join(path, "zoo_integrity.json")
    if os.path.exists(manifest):
        os.remove(manifest)
    return path


def test_encoder_positions_must_be_whispers_sinusoids(case, tmp_path):
    c = case("tiny")
    from transformers.models.whisper.modeling_whisper import sinusoids
    torch_table = sinusoids(c.fields["max_source_positions"], c.fields["d_model"]).numpy()
    models.load(_rewrite_positions(c, tmp_path / "torch", torch_table))    # torch's own: loads
    wrong = torch_table.copy()
    wrong[3, 5] += 0.01
    with pytest.raises(ValueError, match="embed_positions.*is not Whisper.s sinusoids"):
        models.load(_rewrite_positions(c, tmp_path / "wrong", wrong))


POSITIONS = "model.encoder.embed_positions.weight"


def _tensors(path: str) -> dict[str, np.ndarray]:
    return safetensors_numpy.load_file(os.path.join(path, "model.safetensors"))


def test_load_then_save_of_transformers_own_file_is_bit_for_bit(tmp_path):
    """transformers' own init and save (torch's sinusoids, a few float32 units from the
    table we compute), our load, our save given the tables the load kept: every tensor of
    our file is transformers', bit for bit, its encoder positions included."""
    fields = CASES["tiny"]
    theirs_dir = str(tmp_path / "theirs")
    torch.manual_seed(0)
    transformers.WhisperForConditionalGeneration(
        transformers.WhisperConfig(**fields)).save_pretrained(theirs_dir)
    theirs = _tensors(theirs_dir)
    ours_table = whisper_sinusoids(fields["max_source_positions"], fields["d_model"])
    assert not np.array_equal(theirs[POSITIONS], ours_table)     # else this test proves nothing
    pre = models.load(theirs_dir)
    assert list(pre.tables) == [POSITIONS]
    ours_dir = str(tmp_path / "ours")
    models.save(ours_dir, pre.config, pre.params, generation=pre.generation, tables=pre.tables)
    ours = _tensors(ours_dir)
    assert sorted(ours) == sorted(theirs)
    for key, want in theirs.items():
        got = ours[key]
        assert (got.dtype, got.shape) == (want.dtype, want.shape), key
        assert got.tobytes() == want.tobytes(), f"{key} differs"
    # Without the tables: the table we compute, every other tensor the same.
    models.save(str(tmp_path / "computed"), pre.config, pre.params)
    computed = _tensors(str(tmp_path / "computed"))
    np.testing.assert_array_equal(computed.pop(POSITIONS), ours_table)
    for key, got in computed.items():
        assert got.tobytes() == theirs[key].tobytes(), f"{key} differs"


def test_save_refuses_tables_that_loading_would_refuse(case, tmp_path):
    c = case("tiny")
    pre = models.load(c.path)
    wrong = dict(pre.tables)
    wrong[POSITIONS] = wrong[POSITIONS].copy()
    wrong[POSITIONS][3, 5] += 0.01                          # not Whisper's sinusoids
    with pytest.raises(models.errors.UserError,
                       match="embed_positions.*is not Whisper.s sinusoids"):
        models.save(str(tmp_path / "wrong"), pre.config, pre.params, tables=wrong)
    longer = pre.config.replace(audio=AudioInput(c.fields["num_mel_bins"], 24))
    with pytest.raises(models.errors.UserError, match=r"shape \(12, 32\).*shape \(24, 32\)"):
        models.save(str(tmp_path / "other"), longer, pre.params, tables=pre.tables)
    with pytest.raises(models.errors.UserError,
                       match="tables= holds model.decoder.embed_tokens.weight, but whisper "
                             "writes only model.encoder.embed_positions.weight"):
        models.save(str(tmp_path / "unknown"), pre.config, pre.params,
                    tables={**pre.tables, "model.decoder.embed_tokens.weight": np.zeros(3)})
    assert not os.path.exists(tmp_path / "wrong") and not os.path.exists(tmp_path / "other")


def test_audio_encoder_refuses_wrong_features_and_source_masks(case):
    c = case("tiny")
    pre = models.load(c.path)
    v = {"params": pre.params}
    short = c.features[:, :, :-2]
    with pytest.raises(ValueError, match="frames=24"):
        pre.model.apply(v, jnp.asarray(short), jnp.asarray(c.tgt_in))
    with pytest.raises(ValueError, match="float array"):
        pre.model.apply(v, jnp.zeros((B, 8, 24), jnp.int32), jnp.asarray(c.tgt_in))
    with pytest.raises(ValueError, match="src_lengths"):
        pre.model.apply(v, jnp.asarray(c.features), jnp.asarray(c.tgt_in),
                        src_lengths=jnp.array([3, 4]))


# Published configs (their config.json's fields that matter), tiny to large-v3, distil and
# turbo: each loads.
_OPENAI = dict(vocab_size=51865, max_source_positions=1500, max_target_positions=448,
               pad_token_id=50257, bos_token_id=50257, eos_token_id=50257,
               decoder_start_token_id=50258, num_mel_bins=80)
PUBLISHED = {
    "tiny": dict(_OPENAI, d_model=384, encoder_layers=4, decoder_layers=4,
                 encoder_attention_heads=6, decoder_attention_heads=6, encoder_ffn_dim=1536,
                 decoder_ffn_dim=1536),
    "base": dict(_OPENAI, d_model=512, encoder_layers=6, decoder_layers=6,
                 encoder_attention_heads=8, decoder_attention_heads=8, encoder_ffn_dim=2048,
                 decoder_ffn_dim=2048),
    "small": dict(_OPENAI, d_model=768, encoder_layers=12, decoder_layers=12,
                  encoder_attention_heads=12, decoder_attention_heads=12,
                  encoder_ffn_dim=3072, decoder_ffn_dim=3072),
    "medium": dict(_OPENAI, d_model=1024, encoder_layers=24, decoder_layers=24,
                   encoder_attention_heads=16, decoder_attention_heads=16,
                   encoder_ffn_dim=4096, decoder_ffn_dim=4096),
    "large-v3": dict(_OPENAI, vocab_size=51866, num_mel_bins=128, d_model=1280,
                     encoder_layers=32, decoder_layers=32, encoder_attention_heads=20,
                     decoder_attention_heads=20, encoder_ffn_dim=5120, decoder_ffn_dim=5120),
    "large-v3-turbo": dict(_OPENAI, vocab_size=51866, num_mel_bins=128, d_model=1280,
                           encoder_layers=32, decoder_layers=4, encoder_attention_heads=20,
                           decoder_attention_heads=20, encoder_ffn_dim=5120,
                           decoder_ffn_dim=5120),
    "distil-large-v3": dict(_OPENAI, vocab_size=51866, num_mel_bins=128, d_model=1280,
                            encoder_layers=32, decoder_layers=2, encoder_attention_heads=20,
                            decoder_attention_heads=20, encoder_ffn_dim=5120,
                            decoder_ffn_dim=5120),
}
# What a config.json written by transformers 4 for these checkpoints holds besides.
_SAVED_ALONGSIDE = dict(
    architectures=["WhisperForConditionalGeneration"], model_type="whisper",
    torch_dtype="float32", use_cache=True, is_encoder_decoder=True, num_hidden_layers=None,
    activation_function="gelu", dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
    init_std=0.02, scale_embedding=False, encoder_layerdrop=0.0, decoder_layerdrop=0.0,
    apply_spec_augment=False, mask_time_prob=0.05, mask_time_length=10, mask_time_min_masks=2,
    mask_feature_prob=0.0, mask_feature_length=10, mask_feature_min_masks=0,
    median_filter_width=7, classifier_proj_size=256, use_weighted_layer_sum=False,
    max_length=448, forced_decoder_ids=[[1, 50259], [2, 50359], [3, 50363]],
    suppress_tokens=[1, 2, 7], begin_suppress_tokens=[220, 50257], transformers_version="4.x")


@pytest.mark.parametrize("size", list(PUBLISHED))
def test_every_published_whisper_config_loads(size):
    hf = {**_SAVED_ALONGSIDE, **PUBLISHED[size]}
    hf["num_hidden_layers"] = hf["encoder_layers"]
    cfg = FAMILIES["whisper"].config_from_hf(hf)
    assert cfg.audio.num_mel_bins == hf["num_mel_bins"]
    assert (cfg.num_encoder_layers, cfg.num_decoder_layers) == (
        hf["encoder_layers"], hf["decoder_layers"])
    assert (cfg.bos_id, cfg.eos_id, cfg.pad_id) == (50258, 50257, 50257)
    assert FAMILIES["whisper"].config_to_hf(cfg)["decoder_layers"] == hf["decoder_layers"]


def _our_count(cfg: models.TransformerConfig) -> int:
    args, _ = models.axes.init_args(cfg)
    shapes = jax.eval_shape(models.build(cfg).init, jax.random.key(0), *args)["params"]
    return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))


def _their_count(fields: dict) -> int:
    with torch.device("meta"):
        model = transformers.WhisperForConditionalGeneration(
            transformers.WhisperConfig(**fields))
    return sum(p.numel() for p in model.parameters())          # tied tensors once


@pytest.mark.parametrize("preset, size", [("whisper-tiny", "tiny"),
                                          ("whisper-large-v3", "large-v3")])
def test_whisper_presets_have_transformers_parameter_count(preset, size):
    """Ours has a key bias [D] in each self- and cross-attention (always zero for Whisper,
    see models.pretrained.whisper) and no parameter for the encoder's fixed positions
    [S, D], which transformers counts."""
    cfg = models.get_config(preset)
    ids = dict(pad_id=cfg.pad_id, eos_id=cfg.eos_id, bos_id=cfg.bos_id)   # the project's
    assert FAMILIES["whisper"].config_from_hf(
        {**PUBLISHED[size], "model_type": "whisper"}).replace(**ids) == cfg
    key_biases = cfg.d_model * (cfg.num_encoder_layers + 2 * cfg.num_decoder_layers)
    positions = cfg.audio.max_source_positions * cfg.d_model
    assert _our_count(cfg) - key_biases + positions == _their_count(PUBLISHED[size])


# Greedy generation (decode.whisper) against transformers' WhisperForConditionalGeneration
# .generate: a tiny model whose weights make it pick different languages and tokens per
# row, with a multilingual generation config (languages, tasks, <|notimestamps|>, tokens it
# would often pick suppressed, an end token it produces).
_GENERATION = dict(
    decoder_start_token_id=2, eos_token_id=11, pad_token_id=0, bos_token_id=1,
    lang_to_id={"<|en|>": 50, "<|fr|>": 51, "<|de|>": 52},
    task_to_id={"transcribe": 60, "translate": 61}, no_timestamps_token_id=62,
    suppress_tokens=[5, 74], begin_suppress_tokens=[8, 9],
    forced_decoder_ids=[[1, None], [2, 60]], is_multilingual=True, max_length=24)
_ENGLISH = dict(decoder_start_token_id=2, eos_token_id=11, pad_token_id=0, bos_token_id=1,
                no_timestamps_token_id=62, suppress_tokens=[5], begin_suppress_tokens=[8],
                forced_decoder_ids=[[1, 62]], max_length=20)


@pytest.fixture(scope="module")
def speaking(tmp_path_factory):
    """name -> (transformers model, its directory loaded) for both generation configs."""
    made = {}
    for name, gen in (("multilingual", _GENERATION), ("english", _ENGLISH)):
        model = random_whisper(CASES["tiny"], seed=0, scale=0.5)
        model.generation_config = transformers.GenerationConfig(**gen)
        path = str(tmp_path_factory.mktemp(name))
        model.save_pretrained(path)
        made[name] = (model, models.load(path))
    return made


def _their_output(model, features, **options) -> tuple[list[list[int]], list[list[int]]]:
    """transformers' decoder prompts and new tokens per row, up to its end token."""
    with torch.no_grad():
        out = model.generate(torch.as_tensor(features), return_dict_in_generate=True,
                             **options).sequences.numpy()
    eos = model.generation_config.eos_token_id
    P = 2 if not model.generation_config.to_dict().get("lang_to_id") else 4
    rows = [row[P:] for row in out.tolist()]
    return ([row[:P] for row in out.tolist()],
            [row[:row.index(eos) + 1] if eos in row else row for row in rows])


@pytest.mark.parametrize("name, options", [
    ("multilingual", {}), ("multilingual", dict(language="fr")),
    ("multilingual", dict(task="translate")),
    ("multilingual", dict(language="<|de|>", task="translate")),
    ("multilingual", dict(max_new_tokens=6)), ("english", {}),
])
def test_greedy_transcription_equals_transformers_generate(name, options, speaking,
                                                            highest_precision):
    from decode.whisper import transcribe
    model, pre = speaking[name]
    features = random_features(CASES["tiny"], batch=4, seed=5)
    out = transcribe(pre, features, **options)
    ours = [row[:n].tolist() for row, n in zip(np.asarray(out.tokens),
                                               np.asarray(out.lengths), strict=True)]
    prompts, tokens = _their_output(model, features, **options)
    assert np.asarray(out.prompts).tolist() == prompts
    assert ours == tokens
    assert len({len(row) for row in ours}) > 1        # rows end at different steps
    if name == "english":
        assert np.asarray(out.prompts).tolist() == [[2, 62]] * 4
    elif not options:           # detected per row: not one language for the whole batch
        with torch.no_grad():
            detected = model.detect_language(torch.as_tensor(features)).tolist()
        assert len(set(detected)) > 1
        assert np.asarray(out.prompts)[:, 1].tolist() == detected


def test_the_generation_configs_suppressed_tokens_change_what_is_generated(speaking):
    """The comparison above is not vacuous: without the suppressed tokens transformers
    generates other tokens."""
    model, _ = speaking["multilingual"]
    features = random_features(CASES["tiny"], batch=4, seed=5)
    assert _their_output(model, features)[1] != _their_output(
        model, features, suppress_tokens=[], begin_suppress_tokens=[])[1]


@pytest.mark.parametrize("options, words", [
    (dict(return_timestamps=True), ["timestamps"]),
    (dict(language="xx"), ["language='xx'"]),
    (dict(task="summarize"), ["task='summarize'"]),
    (dict(max_new_tokens=40), ["max_new_tokens=40"]),
])
def test_what_transcription_cannot_do_is_refused_by_name(options, words, speaking):
    assert_transcribe_refuses(speaking["multilingual"][1], options, words)


def assert_transcribe_refuses(pre, options: dict, words) -> None:
    """`transcribe(pre, ..., **options)` on one row raises a UserError naming `words`."""
    from decode.whisper import transcribe
    from models.errors import UserError
    with pytest.raises(UserError) as info:
        transcribe(pre, random_features(CASES["tiny"], batch=1), **options)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("fields, words", [
    (dict(architecture="decoder_only"), ["audio", "encoder_decoder"]),
    (dict(share_embeddings=True), ["audio", "share_embeddings"]),
    (dict(audio=dict(num_mel_bins=80, frames=3000)), ["audio", "frames"]),
    (dict(audio=dict(num_mel_bins=0)), ["audio.num_mel_bins"]),
])
def test_inconsistent_audio_configs_are_refused_by_name(fields, words):
    with pytest.raises(ValueError) as info:
        models.get_config("whisper-tiny", **fields)
    for word in words:
        assert word in str(info.value)


def test_an_audio_config_round_trips_through_a_dict():
    cfg = models.get_config("whisper-large-v3")
    assert cfg.audio == AudioInput(num_mel_bins=128, max_source_positions=1500)
    assert models.TransformerConfig.from_dict(cfg.to_dict()) == cfg


def test_an_audio_model_no_hf_class_expresses_saves_as_the_projects_own_type(tmp_path):
    cfg = models.get_config("whisper-tiny", vocab_size=64, d_model=32, num_heads=4,
                            mlp_dim=48, num_encoder_layers=1, num_decoder_layers=1,
                            max_len=16, pad_id=0, eos_id=1, bos_id=2, norm_position="post",
                            audio=dict(num_mel_bins=4, max_source_positions=6))
    model = models.build(cfg)
    features = jnp.asarray(np.random.default_rng(0).normal(size=(1, 4, 12)), jnp.float32)
    tgt = jnp.asarray([[2, 5, 9]])
    params = model.init(jax.random.key(0), features, tgt)["params"]
    written = models.save(str(tmp_path / "zoo"), cfg, params)
    assert written == "jax_transformer_zoo"
    again = models.load(str(tmp_path / "zoo"))
    assert again.config == cfg
    assert_same_params(again.params, params)
    np.testing.assert_array_equal(again.model.apply({"params": again.params}, features, tgt),
                                  model.apply({"params": params}, features, tgt))


@pytest.mark.parametrize("d_model", sorted({f["d_model"] for f in PUBLISHED.values()}))
def test_torchs_position_tables_of_published_sizes_pass_the_check(d_model):
    """Real checkpoints hold the table torch computed (float32 exp and sin, within about
    1e-4 of ours at 1500 positions): it loads, and a table off by 1e-3 does not."""
    from transformers.models.whisper.modeling_whisper import sinusoids

    from models.pretrained.whisper import _check_positions
    cfg = models.get_config("whisper-tiny", d_model=d_model, num_heads=d_model // 64)
    table = sinusoids(1500, d_model).numpy()
    assert _check_positions([table], cfg) == []
    table[1499, 0] += 1e-3
    with pytest.raises(ValueError, match="embed_positions"):
        _check_positions([table], cfg)
