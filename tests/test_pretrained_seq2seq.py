"""models.load / models.save of the encoder-decoder families (BART, Marian, M2M-100, T5,
mT5) against transformers, as tests/test_pretrained_decoders.py does for the decoder-only
ones.

Tiny random checkpoints (tests/pretrained_helpers.py, SEQ2SEQ_CASES) on a ragged batch of
sources (junk past their lengths): a loaded model gives transformers' encoder output and
teacher-forced logits (fp32, highest matmul precision, eager attention), and the same logits
through init_cache, a prefill and cached steps, looped or scanned; the cross-attention
keys/values are projected once per source and shared by beams; `models.save` of what was
loaded gives files transformers loads to the same tensors bit for bit; config values a
family cannot compute are refused by name; greedy decoding equals transformers' `generate`
token for token, and beam search finds the same best beams or better-scoring ones.
"""

from __future__ import annotations

import functools
import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import decode
import models
from models.cache import layer_shape
from models.pretrained import FAMILIES, read_config
from models.pretrained.family import Inexpressible
from models.pretrained.mapping import parameter_shapes
from tests import pretrained_helpers as ph
from tests.helpers import fns, tiny
from tests.pretrained_helpers import (
    ATOL,
    N_NEW,
    SEQ2SEQ_CASES,
    B,
    S,
    T,
    assert_same_params,
    assert_same_tensors,
    copy_dir,
    edit_config,
    hf_generate,
    hf_seq2seq_load,
    hf_seq2seq_logits,
    stack_layers,
    their_new_tokens,
    torch,
)

seq2seq_ckpt, highest_precision = ph.seq2seq_ckpt, ph.highest_precision   # shared fixtures
decoding_ckpt = ph.decoding_ckpt
safetensors_torch = pytest.importorskip("safetensors.torch")

PREFILL = 4                        # decoder inputs prefilled; the other T - 4 are steps
CACHE_LEN = 16


def _source_mask(c) -> np.ndarray:
    return np.arange(S)[None, :] < c.src_lens[:, None]


def _hf_encoder_output(c) -> np.ndarray:
    with torch.no_grad():
        return c.model.get_encoder()(
            input_ids=torch.as_tensor(c.src, dtype=torch.long),
            attention_mask=torch.as_tensor(_source_mask(c), dtype=torch.long),
        ).last_hidden_state.float().numpy()


@functools.cache
def _encode_fn(model):
    return jax.jit(lambda p, src, n: model.apply({"params": p}, src, lengths=n, method="encode"))


@functools.cache
def _beam_cache_fn(model, beams: int):
    return jax.jit(lambda p, src, n: model.apply({"params": p}, src, CACHE_LEN, beams,
                                                 src_lengths=n, method="init_cache"))


# ---------------------------------------------------------------------------------------------
# 1-2. The loaded config, the encoder output and the teacher-forced logits.

@pytest.mark.parametrize("name", SEQ2SEQ_CASES)
def test_loaded_model_gives_transformers_encoder_output_and_logits(
        name, seq2seq_ckpt, highest_precision):
    c = seq2seq_ckpt(name)
    pre = models.load(c.path)
    cfg = pre.config
    assert pre.model_type == c.model_type and pre.tokenizer is None
    for field, value in c.expect.items():
        assert getattr(cfg, field) == value, field
    hf = c.model.config
    assert (cfg.bos_id, cfg.eos_id, cfg.pad_id) == (
        hf.decoder_start_token_id, hf.eos_token_id, hf.pad_token_id)
    assert cfg.is_encoder_decoder and cfg.param_dtype == jnp.float32
    chex.assert_tree_all_finite(pre.params)
    assert pre.model == models.build(cfg)

    src, lens = jnp.asarray(c.src), jnp.asarray(c.src_lens)
    encoded = np.asarray(_encode_fn(pre.model)(pre.params, src, lens))
    theirs = _hf_encoder_output(c)
    for b, n in enumerate(c.src_lens):
        np.testing.assert_allclose(encoded[b, :n], theirs[b, :n], atol=ATOL, rtol=0,
                                   err_msg=f"encoder output of row {b}")
    logits = fns(cfg).forward(pre.params, src, jnp.asarray(c.tgt_in), src_lengths=lens)
    np.testing.assert_allclose(logits, c.logits, atol=ATOL, rtol=0)
    print(f"{name}: max |logits - transformers'| = {np.abs(logits - c.logits).max():.2e}")


# ---------------------------------------------------------------------------------------------
# 3. init_cache, a prefill, then cached steps: the same logits, looped or scanned.

@pytest.mark.parametrize("scan", [False, True], ids=["looped", "scanned"])
@pytest.mark.parametrize("name", SEQ2SEQ_CASES)
def test_init_cache_prefill_then_steps_give_transformers_logits(
        name, scan, seq2seq_ckpt, highest_precision):
    c = seq2seq_ckpt(name)
    pre = models.load(c.path, scan_layers=scan)
    assert pre.config.scan_layers == scan
    f = fns(pre.config)
    tgt = jnp.asarray(c.tgt_in)
    cache = f.init_cache(pre.params, B, CACHE_LEN, src=jnp.asarray(c.src),
                         src_lengths=jnp.asarray(c.src_lens))
    logits, cache = f.prefill(pre.params, tgt[:, :PREFILL], jnp.full((B,), PREFILL, jnp.int32),
                              cache)
    np.testing.assert_allclose(logits, c.logits[:, :PREFILL], atol=ATOL, rtol=0)
    for i in range(PREFILL, T):
        step_logits, cache = f.step(pre.params, tgt[:, i], cache)
        np.testing.assert_allclose(step_logits, c.logits[:, i], atol=ATOL, rtol=0,
                                   err_msg=f"step at position {i}")
    np.testing.assert_array_equal(cache.lengths, np.full((B,), T))


# ---------------------------------------------------------------------------------------------
# 4. Round trips.

@pytest.mark.parametrize("name", SEQ2SEQ_CASES)
def test_load_then_save_gives_files_transformers_loads_to_the_same_tensors(
        name, seq2seq_ckpt, tmp_path):
    c = seq2seq_ckpt(name)
    pre = models.load(c.path)
    same = str(tmp_path / "same")
    assert models.save(same, pre.config, pre.params, model_type=pre.model_type,
                       generation=pre.generation) == c.model_type
    with open(os.path.join(same, "config.json")) as f:
        assert json.load(f)["model_type"] == c.model_type
    again = hf_seq2seq_load(same)
    assert type(again) is type(c.model)
    assert_same_tensors(c.state, again)
    np.testing.assert_array_equal(
        hf_seq2seq_logits(again, c.src, c.src_lens, c.tgt_in), c.logits)
    cfg_again = again.config
    assert (cfg_again.decoder_start_token_id, cfg_again.eos_token_id,
            cfg_again.pad_token_id) == (pre.config.bos_id, pre.config.eos_id, pre.config.pad_id)
    # Saved without a model_type: the first type that expresses the config (mt5 saves as
    # t5, the same computation), which transformers loads to the same tensors and logits.
    default = str(tmp_path / "default")
    written = models.save(default, pre.config, pre.params)
    if written == c.model_type:
        with open(os.path.join(same, "model.safetensors"), "rb") as a, open(
                os.path.join(default, "model.safetensors"), "rb") as b:
            assert a.read() == b.read()
    else:
        assert (name, written) == ("mt5", "t5")
        theirs = hf_seq2seq_load(default)
        np.testing.assert_array_equal(
            hf_seq2seq_logits(theirs, c.src, c.src_lens, c.tgt_in), c.logits)
    # Ours reads its own files back to the same parameters, also for a scanned model, and
    # a scanned model saves the same file.
    assert_same_params(models.load(same).params, pre.params)
    scanned = models.load(c.path, scan_layers=True)
    assert scanned.config == pre.config.replace(scan_layers=True)
    assert_same_params(scanned.params, stack_layers(pre.params))
    models.save(str(tmp_path / "scanned"), scanned.config, scanned.params,
                model_type=pre.model_type)
    with open(os.path.join(same, "model.safetensors"), "rb") as a, open(
            tmp_path / "scanned" / "model.safetensors", "rb") as b:
        assert a.read() == b.read()


def test_encoder_decoders_no_hf_class_expresses_fall_through_to_the_projects_own_type(
        seq2seq_ckpt, tmp_path):
    bart_cfg = models.load(seq2seq_ckpt("bart").path).config
    unexpressed = {
        "transformer-tiny": tiny("encoder_decoder", pad_id=1, eos_id=2, bos_id=3),
        "bart-pre-norm": bart_cfg.replace(norm_position="pre"),
        "bart-separate-embeddings": bart_cfg.replace(share_embeddings=False),
        "bart-untied-head": bart_cfg.replace(tie_embeddings=False),
        "bart-no-logits-bias": bart_cfg.replace(logits_bias=False),
        "bart-gqa": bart_cfg.replace(num_kv_heads=2),
        "bart-rmsnorm": bart_cfg.replace(norm="rmsnorm"),
        "bart-eps": bart_cfg.replace(norm_eps=1e-6),
        "bart-swiglu": bart_cfg.replace(activation="swiglu"),
        "marian-offset": bart_cfg.replace(embedding_norm=False),
        "marian-embedding-norm": bart_cfg.replace(positions="sinusoidal_paper",
                                                  position_offset=0),
    }
    for what, cfg in unexpressed.items():
        for model_type in ("bart", "marian"):
            with pytest.raises(Inexpressible):
                FAMILIES[model_type].config_to_hf(cfg)
                pytest.fail(f"{model_type} expresses {what}")
    cfg = unexpressed["bart-untied-head"]
    assert models.save(str(tmp_path / "untied"), cfg, _random_params(cfg)) == (
        "jax_transformer_zoo")
    # BART made pre-norm (with a final norm closing each stack) is mBART.
    cfg = unexpressed["bart-pre-norm"]
    assert models.save(str(tmp_path / "pre-norm"), cfg, _random_params(cfg)) == "mbart"
    # What they do express, each saves as (and loads back).
    marian_cfg = bart_cfg.replace(positions="sinusoidal_paper", position_offset=0,
                                  embedding_norm=False, activation="silu",
                                  share_embeddings=False)
    for cfg, model_type in ((bart_cfg, "bart"), (marian_cfg, "marian")):
        path = str(tmp_path / model_type)
        params = _random_params(cfg)
        assert models.save(path, cfg, params) == model_type
        again = models.load(path)
        assert again.config == cfg
        assert_same_params(again.params, params)


def _random_params(cfg: models.TransformerConfig, seed: int = 0) -> dict:
    """Random values of every parameter of an unscanned model (shapes as loading checks)."""
    rng = np.random.default_rng(seed)
    tree: dict = {}
    for path, shape in parameter_shapes(cfg).items():
        *parents, leaf = path.split("/")
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = jnp.asarray(rng.normal(size=shape), cfg.param_dtype)
    return tree


# ---------------------------------------------------------------------------------------------
# 5. Cross-attention keys/values: projected once per source, shared by its beams.

@pytest.mark.parametrize("name", SEQ2SEQ_CASES)
def test_cross_keys_values_are_projected_once_per_source_and_shared_by_beams(
        name, seq2seq_ckpt):
    """After init_cache, steps never touch the cross-attention projection: with its
    parameters poisoned (NaN), the steps of a one-beam cache and of a two-beam cache (whose
    cross part keeps one row per source) give the unpoisoned logits."""
    c = seq2seq_ckpt(name)
    pre = models.load(c.path)
    f = fns(pre.config)
    src, lens = jnp.asarray(c.src), jnp.asarray(c.src_lens)
    one = f.init_cache(pre.params, B, CACHE_LEN, src=src, src_lengths=lens)
    two = _beam_cache_fn(pre.model, 2)(pre.params, src, lens)
    assert layer_shape(two.cross_k) == layer_shape(one.cross_k) and two.batch_size == 2 * B
    poisoned = {**pre.params, "cross_kv": jax.tree.map(lambda x: jnp.full_like(x, jnp.nan),
                                                       pre.params["cross_kv"])}
    tokens = jnp.full((B,), pre.config.bos_id, jnp.int32)
    for _ in range(3):
        want, one_next = f.step(pre.params, tokens, one)
        got, one = f.step(poisoned, tokens, one)
        np.testing.assert_array_equal(got, want)
        chex.assert_tree_all_finite(want)
        beams, two = f.step(poisoned, jnp.repeat(tokens, 2), two)
        np.testing.assert_allclose(beams, np.repeat(np.asarray(want), 2, axis=0), atol=1e-5,
                                   rtol=0)
        tokens = jnp.argmax(want, -1).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------
# 6. What cannot be loaded exactly is refused by name.

_set = ph.set_fields


REFUSED = {
    "bart-quick-gelu": ("bart", _set(activation_function="quick_gelu"),
                        ["activation_function", "quick_gelu"]),
    "bart-layerdrop": ("bart", _set(encoder_layerdrop=0.1), ["encoder_layerdrop", "0.1"]),
    "bart-decoder-layerdrop": ("bart", _set(decoder_layerdrop=0.2), ["decoder_layerdrop"]),
    "bart-head-counts": ("bart", _set(decoder_attention_heads=2),
                         ["decoder_attention_heads", "encoder_attention_heads=4"]),
    "bart-ffn-dims": ("bart", _set(decoder_ffn_dim=64), ["decoder_ffn_dim", "64"]),
    "bart-pre-norm": ("bart", _set(normalize_before=True), ["normalize_before"]),
    "bart-final-norm": ("bart", _set(add_final_layer_norm=True), ["add_final_layer_norm"]),
    "bart-no-embedding-norm": ("bart", _set(normalize_embedding=False),
                               ["normalize_embedding"]),
    "bart-untied": ("bart", _set(tie_word_embeddings=False), ["tie_word_embeddings"]),
    "bart-unknown-field": ("bart", _set(foo_bar=3), ["foo_bar", "3"]),
    "marian-decoder-vocab": ("marian-shared", _set(decoder_vocab_size=70),
                             ["decoder_vocab_size", "70", "vocab_size=66"]),
    "marian-head-counts": ("marian-separate", _set(encoder_attention_heads=8),
                           ["decoder_attention_heads", "encoder_attention_heads=8"]),
    "marian-learned-positions": ("marian-shared", _set(static_position_embeddings=False),
                                 ["static_position_embeddings"]),
    "marian-gelu-fast": ("marian-shared", _set(activation_function="gelu_fast"),
                         ["activation_function", "gelu_fast"]),
    "m2m100-untied": ("m2m100", _set(tie_word_embeddings=False), ["tie_word_embeddings"]),
    "m2m100-head-counts": ("m2m100", _set(decoder_attention_heads=2),
                           ["decoder_attention_heads", "encoder_attention_heads=4"]),
    "mbart-post-norm": ("mbart", _set(normalize_before=False), ["normalize_before"]),
    "mbart-untied": ("mbart", _set(tie_word_embeddings=False), ["tie_word_embeddings"]),
    "mbart-ffn-dims": ("mbart", _set(decoder_ffn_dim=64), ["decoder_ffn_dim", "64"]),
    "pegasus-learned-positions": ("pegasus", _set(static_position_embeddings=False),
                                  ["static_position_embeddings"]),
    "pegasus-quick-gelu": ("pegasus", _set(activation_function="quick_gelu"),
                           ["activation_function", "quick_gelu"]),
}


@pytest.mark.parametrize("case", REFUSED)
def test_config_values_a_family_cannot_compute_are_refused_by_name(case, seq2seq_ckpt,
                                                                  tmp_path):
    name, edit, words = REFUSED[case]
    ph.assert_refused_by_name(edit_config(copy_dir(seq2seq_ckpt(name).path, tmp_path / "m"),
                                          edit), words)


def test_legacy_fields_at_the_values_bart_and_marian_compute_with_load(seq2seq_ckpt,
                                                                      tmp_path):
    legacy = dict(normalize_before=False, add_final_layer_norm=False, add_bias_logits=False,
                  classif_dropout=0.0, _num_labels=3, output_past=True,
                  gradient_checkpointing=False)
    for name, own in (("bart", dict(normalize_embedding=True, static_position_embeddings=False,
                                    extra_pos_embeddings=2)),
                      ("marian-shared", dict(normalize_embedding=False, extra_pos_embeddings=66,
                                             static_position_embeddings=True,
                                             num_hidden_layers=2, bos_token_id=0))):
        c = seq2seq_ckpt(name)
        path = edit_config(copy_dir(c.path, tmp_path / name), _set(**legacy, **own))
        assert read_config(path)[1] == models.load(c.path).config


def _rewrite_weights(path: str, edit) -> str:
    file = os.path.join(path, "model.safetensors")
    tensors = safetensors_torch.load_file(file)
    edit(tensors)
    safetensors_torch.save_file(tensors, file, metadata={"format": "pt"})
    return path


def test_tied_embedding_copies_are_read_wherever_they_are_and_must_agree(seq2seq_ckpt,
                                                                        tmp_path):
    """transformers ties BART's shared table, each stack's embed_tokens and the head: a file
    may hold any of them (older ones hold all four). Loaded from any, the same parameters;
    copies that differ are refused (transformers would untie them)."""
    c = seq2seq_ckpt("bart")
    want = models.load(c.path).params
    table = c.state["model.shared.weight"]
    copies = ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight",
              "lm_head.weight")

    def all_copies(t):
        t.update({k: table.clone() for k in copies})

    def only_the_decoders(t):
        del t["model.shared.weight"]
        t["model.decoder.embed_tokens.weight"] = table.clone()

    for i, edit in enumerate((all_copies, only_the_decoders)):
        path = _rewrite_weights(copy_dir(c.path, tmp_path / f"ok{i}"), edit)
        assert_same_params(models.load(path).params, want)

    def a_different_head(t):
        t["lm_head.weight"] = table + 1.0

    path = _rewrite_weights(copy_dir(c.path, tmp_path / "bad"), a_different_head)
    with pytest.raises(ValueError, match=r"lm_head\.weight and model\.shared\.weight differ"):
        models.load(path)


def test_marian_position_tables_in_a_file_must_be_the_sinusoids_we_regenerate(
        seq2seq_ckpt, tmp_path):
    """transformers does not save Marian's tables but uses them when a file has them."""
    c = seq2seq_ckpt("marian-separate")
    want = models.load(c.path).params
    keys = ("model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight")
    # transformers' own tables (kept, not randomised, by the helpers).
    path = _rewrite_weights(copy_dir(c.path, tmp_path / "stored"),
                            lambda t: t.update({k: c.state[k].clone() for k in keys}))
    assert_same_params(models.load(path).params, want)

    def shifted(t):
        t.update({k: c.state[k].clone() for k in keys})
        t[keys[1]][3] += 1e-3

    path = _rewrite_weights(copy_dir(c.path, tmp_path / "shifted"), shifted)
    with pytest.raises(ValueError, match=r"model\.decoder\.embed_positions\.weight"):
        models.load(path)


def test_pegasus_tables_are_checked_kept_and_written_back_and_a_missing_bias_is_zeros(
        seq2seq_ckpt, tmp_path):
    """PEGASUS's files hold their sinusoid tables (transformers saves them): a table off by
    1e-3 is refused by name, one within rounding is kept and written back as it was. A file
    without `final_logits_bias` (transformers makes it zeros) loads so, with a warning."""
    c = seq2seq_ckpt("pegasus")
    key = "model.decoder.embed_positions.weight"
    pre = models.load(c.path)
    nudged = c.state[key].clone()
    nudged[5, 0] = float(np.nextafter(np.float32(nudged[5, 0]), np.float32(2)))   # 1 ulp
    path = _rewrite_weights(copy_dir(c.path, tmp_path / "ulp"), lambda t: t.update({key: nudged}))
    kept = models.load(path)
    models.save(str(tmp_path / "again"), kept.config, kept.params, model_type="pegasus",
                tables=kept.tables)
    again = safetensors_torch.load_file(str(tmp_path / "again" / "model.safetensors"))
    assert torch.equal(again[key], nudged)
    path = _rewrite_weights(copy_dir(c.path, tmp_path / "shifted"),
                            lambda t: t[key].__setitem__(3, t[key][3] + 1e-3))
    with pytest.raises(ValueError, match=r"model\.decoder\.embed_positions\.weight"):
        models.load(path)
    path = _rewrite_weights(copy_dir(c.path, tmp_path / "no-bias"),
                            lambda t: t.pop("final_logits_bias"))
    with pytest.warns(UserWarning, match="final_logits_bias"):
        unbiased = models.load(path)
    np.testing.assert_array_equal(unbiased.params["logits_bias"], 0)
    assert_same_params({k: v for k, v in unbiased.params.items() if k != "logits_bias"},
                       {k: v for k, v in pre.params.items() if k != "logits_bias"})


def test_an_mbart_without_a_decoder_start_starts_from_bos_as_generate_does(seq2seq_ckpt,
                                                                          tmp_path):
    c = seq2seq_ckpt("mbart")
    path = edit_config(copy_dir(c.path, tmp_path / "m"),
                       _set(decoder_start_token_id=None, bos_token_id=0))
    os.remove(os.path.join(path, "generation_config.json"))    # config.json's ids alone
    theirs = hf_generate(hf_seq2seq_load(path), c.src, c.src_lens).numpy()
    assert read_config(path)[1].bos_id == 0
    np.testing.assert_array_equal(theirs[:, 0], 0)


# ---------------------------------------------------------------------------------------------
# 7-8. Decoding against transformers' `generate`.
#
# The decoding checkpoints (`pretrained_helpers.decoding_ckpt`) are the cases' with their
# end token's logit bias raised, so that sequences end after 1 to N_NEW tokens.


@pytest.mark.parametrize("name", SEQ2SEQ_CASES)
def test_greedy_generate_on_a_ragged_batch_equals_transformers_generate(
        name, decoding_ckpt, highest_precision):
    """The ragged sources, with the options the checkpoint's generation config gives (its
    end token, forced last token, ...); transformers' rows start with the decoder start
    token and pad after the end."""
    d = decoding_ckpt(name)
    pre = models.load(d.path)
    request = decode.DecodeRequest.from_generation(pre.generation, pre.config)
    options = {**request.replace(strategy="greedy").generate_options(), "max_new_tokens": N_NEW}
    eos = list(pre.generation.eos_ids or ())
    ours = decode.generate(pre.model, pre.params, d.src, d.src_lens, **options)
    theirs = hf_generate(d.model, d.src, d.src_lens, num_beams=1).numpy()
    assert np.all(theirs[:, 0] == pre.config.bos_id)
    for b in range(len(d.src)):
        n = int(ours.lengths[b])
        np.testing.assert_array_equal(np.asarray(ours.tokens[b, :n]),
                                      their_new_tokens(theirs[b], pre.config.pad_id, eos),
                                      err_msg=f"row {b}")
        assert np.all(np.asarray(ours.tokens[b, n:]) == pre.config.pad_id)
    print(f"{name}: greedy lengths {np.asarray(ours.lengths).tolist()}")


BEAM = 3
ALPHAS = (0.0, 1.0, 2.0)


def _our_scores(pre, src, lens, seqs: list[np.ndarray], alpha: float, options: dict) -> list:
    """Length-normalised (log-prob / length ** alpha) scores of new-token sequences (one per
    source, then one per source again) under our model, teacher-forced, summed as beam
    search sums them: a forced token adds 0."""
    cfg = pre.config
    rows = np.full((len(seqs), N_NEW + 1), cfg.bos_id, np.int32)
    for i, seq in enumerate(seqs):
        rows[i, 1:1 + len(seq)] = seq
    copies = len(seqs) // src.shape[0]
    logits = fns(cfg).forward(pre.params, jnp.asarray(np.tile(src, (copies, 1))),
                              jnp.asarray(rows[:, :-1]),
                              src_lengths=jnp.asarray(np.tile(lens, copies)))
    logprobs = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    forced = {0: options.get("forced_bos_id"), N_NEW - 1: options.get("forced_eos_id")}
    scores = []
    for i, seq in enumerate(seqs):
        total = sum(0.0 if forced.get(t) == tok else float(logprobs[i, t, tok])
                    for t, tok in enumerate(seq))
        scores.append(total / len(seq) ** alpha)
    return scores


@pytest.mark.parametrize("name", SEQ2SEQ_CASES)
def test_beam_search_finds_transformers_best_beams_or_better_scoring_ones(
        name, decoding_ckpt, highest_precision, record_property):
    """transformers' `early_stopping=True` stops a source once W beams have finished; ours
    with "never" stops when no alive beam can still win, so where the best beams differ
    ours must score at least as high (both scored by our model). (Each rule against its
    own transformers' counterpart: tests/test_beam_stopping.py.)"""
    d = decoding_ckpt(name)
    pre = models.load(d.path)
    request = decode.DecodeRequest.from_generation(pre.generation, pre.config)
    options = request.replace(strategy="beam").beam_options()
    assert not options.get("renormalize_logits"), "the scorer below sums raw log-probs"
    eos = list(pre.generation.eos_ids or ())
    agree = total = 0
    rows = len(d.src)
    for alpha in ALPHAS:
        ours = decode.beam_search(pre.model, pre.params, d.src, d.src_lens, **{
            **options, "beam_size": BEAM, "max_new_tokens": N_NEW, "length_penalty": alpha,
            "length_normalization": "hf", "early_stopping": "never"})
        theirs = hf_generate(d.model, d.src, d.src_lens, num_beams=BEAM, length_penalty=alpha,
                              early_stopping=True).numpy()
        best = [np.asarray(ours.tokens[b, 0, :int(ours.lengths[b, 0])]) for b in range(rows)]
        their_best = [their_new_tokens(theirs[b], pre.config.pad_id, eos) for b in range(rows)]
        scores = _our_scores(pre, d.src, d.src_lens, best + their_best, alpha, options)
        # The scorer agrees with beam search's own scores of its best beams.
        np.testing.assert_allclose(scores[:rows], ours.scores[:, 0], atol=1e-4, rtol=1e-5)
        for b in range(rows):
            total += 1
            if np.array_equal(best[b], their_best[b]):
                agree += 1
            else:
                assert scores[b] >= scores[rows + b] - 1e-4, (
                    f"alpha {alpha}, row {b}: ours {best[b]} scores {scores[b]}, "
                    f"transformers' {their_best[b]} scores {scores[rows + b]}")
    record_property("beam_agreement", f"{agree}/{total}")
    print(f"{name}: best beams equal to transformers' in {agree} of {total}")


# The published config.json files (the fields that change the computation):
# facebook/m2m100_418M, facebook/nllb-200-distilled-600M, facebook/mbart-large-50 (with the
# switches of transformers 3 it still holds) and google/pegasus-large.
_M2M100_LARGE = dict(d_model=1024, encoder_layers=12, decoder_layers=12,
                     encoder_attention_heads=16, decoder_attention_heads=16,
                     encoder_ffn_dim=4096, decoder_ffn_dim=4096, max_position_embeddings=1024,
                     scale_embedding=True, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                     decoder_start_token_id=2, dropout=0.1, activation_dropout=0.0)
PUBLISHED = {
    "m2m100-418m": dict(_M2M100_LARGE, vocab_size=128112, activation_function="relu",
                        encoder_layerdrop=0.05, decoder_layerdrop=0.05, attention_dropout=0.1,
                        model_type="m2m_100"),
    "nllb-200-600m": dict(_M2M100_LARGE, vocab_size=256206, activation_function="relu",
                          encoder_layerdrop=0, decoder_layerdrop=0, attention_dropout=0.1,
                          tokenizer_class="NllbTokenizer", model_type="m2m_100"),
    "mbart-large-50": dict(_M2M100_LARGE, vocab_size=250054, activation_function="gelu",
                           attention_dropout=0.0, forced_eos_token_id=2, normalize_before=True,
                           add_final_layer_norm=True, add_bias_logits=False,
                           normalize_embedding=True, static_position_embeddings=False,
                           extra_pos_embeddings=2, tokenizer_class="MBart50Tokenizer",
                           model_type="mbart"),
    "pegasus-large": dict(_M2M100_LARGE, vocab_size=96103, encoder_layers=16,
                          decoder_layers=16, activation_function="relu", pad_token_id=0,
                          eos_token_id=1, decoder_start_token_id=0, attention_dropout=0.1,
                          activation_dropout=0.1, normalize_before=True,
                          add_final_layer_norm=True, normalize_embedding=False,
                          static_position_embeddings=True, extra_pos_embeddings=1,
                          length_penalty=0.8, num_beams=8, max_length=256,
                          model_type="pegasus"),
}
_LEGACY_KEYS = ("model_type", "tokenizer_class", "normalize_before", "add_final_layer_norm",
                "add_bias_logits", "normalize_embedding", "static_position_embeddings",
                "extra_pos_embeddings")


@pytest.mark.parametrize("preset", PUBLISHED)
def test_a_preset_is_the_published_config_with_transformers_parameter_count(preset):
    """Counted as transformers counts its trainable parameters, plus the logits bias (a
    buffer there, a parameter here); PEGASUS's frozen position tables are no parameter of
    ours."""
    import math
    published = PUBLISHED[preset]
    model_type = published["model_type"]
    cfg = models.get_config(preset)
    assert FAMILIES[model_type].config_from_hf(dict(published)).replace(
        dropout_rate=0.0, attention_dropout_rate=0.0, mlp_dropout_rate=0.0) == cfg
    fields = {k: v for k, v in published.items() if k not in _LEGACY_KEYS}
    config_class = getattr(ph.transformers, ph.CONFIG_CLASSES[model_type])
    with torch.device("meta"):
        theirs = ph.transformers.AutoModelForSeq2SeqLM.from_config(config_class(**fields))
    their_count = sum(p.numel() for p in theirs.parameters() if p.requires_grad) + sum(
        b.numel() for name, b in theirs.named_buffers() if name == "final_logits_bias")
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    shapes = jax.eval_shape(models.build(cfg).init, jax.random.key(0), tokens, tokens)
    assert sum(math.prod(x.shape) for x in jax.tree.leaves(shapes["params"])) == their_count


@pytest.mark.parametrize("name", ["m2m100", "mbart", "pegasus", "t5gemma"])
def test_a_bfloat16_checkpoint_loads_exactly(name, seq2seq_ckpt, tmp_path):
    """The translators of this round in bfloat16: loaded as float32 and as bfloat16 with
    the same values, saved back to the tensors transformers wrote."""
    ph.assert_bfloat16_loads_exactly(seq2seq_ckpt(name), tmp_path,
                                     reload=ph.transformers.AutoModelForSeq2SeqLM,
                                     model_type=seq2seq_ckpt(name).model_type)
