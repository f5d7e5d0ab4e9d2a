"""Tiny random transformers checkpoints and what the tests of `models.load` / `models.save`
share (tests/test_pretrained_decoders.py, tests/test_pretrained_files.py).

Every checkpoint is a transformers model with random weights (normal, not its zero biases
and unit norms, so a swapped or misplaced tensor shows), saved with `save_pretrained` once
per test process, with its logits (fp32, eager attention) on a fixed batch of tokens.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import decode
import models
from tests import helpers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ATOL = 1e-4
B, T = 2, 10                       # T is longer than the sliding window (4)
PROMPT_LENS = np.array([3, 6])     # the ragged prefill: row 0 gets 3 tokens, row 1 gets 6
SPECIAL = dict(pad_token_id=4, bos_token_id=1, eos_token_id=2)   # none of ours (0, 2, 1)
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
_LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=32, rms_norm_eps=1e-5, **SPECIAL)
_GPT2 = dict(n_embd=32, n_layer=2, n_head=4, n_inner=48, n_positions=32, **SPECIAL)

# name -> (model_type, the transformers config's fields, what the loaded config must say:
# so a field transformers ignored, or one the loader dropped, cannot pass unnoticed).
CASES = {
    "gpt2-tied": ("gpt2", dict(_GPT2, vocab_size=64), dict(
        tie_embeddings=True, activation="gelu", positions="learned")),
    "gpt2-untied-exact-gelu": ("gpt2", dict(_GPT2, vocab_size=97, tie_word_embeddings=False,
                                            activation_function="gelu"), dict(
        tie_embeddings=False, activation="gelu_exact", vocab_size=97)),
    "llama-mha-untied-bias": ("llama", dict(_LLAMA, num_key_value_heads=4, attention_bias=True,
                                            mlp_bias=True), dict(
        num_kv_heads=4, tie_embeddings=False, use_bias=True, rope_scaling=None,
        rope_theta=10_000.0)),
    "llama-gqa-tied-llama3-head-dim": ("llama", dict(
        _LLAMA, vocab_size=80, num_key_value_heads=2, head_dim=12, tie_word_embeddings=True,
        rope_theta=5_000.0, rope_scaling=LLAMA3), dict(
        num_kv_heads=2, head_dim=12, tie_embeddings=True, rope_theta=5_000.0,
        rope_scaling=models.Llama3RopeScaling(4.0, 1.0, 4.0, 16))),
    "mistral-gqa-window-4": ("mistral", dict(_LLAMA, num_key_value_heads=2, sliding_window=4),
                             dict(num_kv_heads=2, sliding_window=4)),
    "mistral-no-window": ("mistral", dict(_LLAMA, num_key_value_heads=2, sliding_window=None),
                          dict(sliding_window=None)),
    "qwen2-gqa": ("qwen2", dict(_LLAMA, vocab_size=72, num_key_value_heads=2), dict(
        num_kv_heads=2, qkv_bias=True, use_bias=False, tie_embeddings=False)),
    "qwen2-mqa-tied": ("qwen2", dict(_LLAMA, num_key_value_heads=1, tie_word_embeddings=True),
                       dict(num_kv_heads=1, qkv_bias=True, tie_embeddings=True)),
}
CONFIG_CLASSES = {"gpt2": "GPT2Config", "llama": "LlamaConfig", "mistral": "MistralConfig",
                  "qwen2": "Qwen2Config"}


def assert_ragged_prefill_then_steps(f, params, c, atol: float = ATOL) -> None:
    """A ragged prefill (rows of PROMPT_LENS tokens, junk after them) then cached steps of
    `f` (`tests.helpers.fns`) give checkpoint `c`'s transformers logits at every position
    (within `atol`)."""
    cfg, tokens = f.cfg, jnp.asarray(c.tokens)
    P = int(PROMPT_LENS.max())
    junk = jnp.asarray(random_tokens(cfg.vocab_size, seed=99)[:, :P])
    prompt = jnp.where(jnp.arange(P)[None, :] < PROMPT_LENS[:, None], tokens[:, :P], junk)
    cache = models.KVCache.create(cfg, B, 16)
    logits, cache = f.prefill(params, prompt, jnp.asarray(PROMPT_LENS, jnp.int32), cache)
    for b, n in enumerate(PROMPT_LENS):
        np.testing.assert_allclose(logits[b, :n], c.logits[b, :n], atol=atol, rtol=0)
    for i in range(T - P):
        at = PROMPT_LENS + i
        step_logits, cache = f.step(params, tokens[np.arange(B), at], cache)
        np.testing.assert_allclose(step_logits, c.logits[np.arange(B), at], atol=atol, rtol=0,
                                   err_msg=f"step {i} at positions {at}")
    np.testing.assert_array_equal(cache.lengths, PROMPT_LENS + T - P)


def randomize(model, seed: int):
    """Every parameter random: norm scales near 1, everything else (biases too) near 0."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_scale = p.ndim == 1 and ("norm" in name or ".ln_" in name) and "weight" in name
            p.copy_(torch.randn_like(p) * 0.15 + (1.0 if is_scale else 0.0))
        for name, b in model.named_buffers():       # DeepSeek-V3's expert selection bias
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.3)
    return model.eval()


def random_tokens(vocab_size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab_size, (B, T)).astype(np.int32)


def hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


def state_of(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_tensors(expected: dict, model) -> None:
    got = model.state_dict()
    assert sorted(got) == sorted(expected)
    for k, v in expected.items():
        assert got[k].dtype == v.dtype, k
        assert torch.equal(got[k], v), f"{k} differs"


def assert_same_params(got, want) -> None:
    """The same tree, shapes, dtypes and values, bit for bit; `got`'s leaves jax arrays."""
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(got))
    chex.assert_trees_all_equal_dtypes(got, want)
    chex.assert_trees_all_equal(got, want, strict=True)


def hf_load(path: str):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", output_loading_info=True)
    assert not any(info.values()), info      # no missing, unexpected or mismatched tensors
    return model.eval()


class Checkpoint:
    """One tiny transformers causal LM with random weights, saved: `model_type`, `expect`
    (what the loaded config must say), `path`, `model`, `tokens`, `logits`, `state`.

    Args:
        case: (model_type, the transformers config class's name, its fields, expect).
        path: the directory it is saved to.
        seed: the seed of its weights and tokens.
    """

    def __init__(self, case: tuple, path: str, seed: int):
        self.model_type, class_name, fields, self.expect = case
        hf_cfg = getattr(transformers, class_name)(
            **copy.deepcopy(fields), attn_implementation="eager")   # it edits dicts given
        torch.manual_seed(seed)
        self.model = randomize(transformers.AutoModelForCausalLM.from_config(hf_cfg), seed)
        assert self.model.config._attn_implementation == "eager"
        self.path = path
        self.model.save_pretrained(self.path, safe_serialization=True)
        self.tokens = random_tokens(hf_cfg.vocab_size, seed)
        self.logits = hf_logits(self.model, self.tokens)
        self.state = state_of(self.model)


def checkpoints(cases: dict, folder: str, first_seed: int = 0):
    """A table of cases as (the session fixture `ckpt`, `build`): `ckpt(name)` is case
    `name`'s `Checkpoint` under the session's `folder`, and `build(name, root)` the same
    under `root`; each is built once per test process, seeded `first_seed` + the case's
    index (tests only read it: one that edits a file edits a copy).

    Args:
        cases: name -> (model_type, config class name, fields, expect), as `Checkpoint`.
        folder: the folder under pytest's base temporary directory.
        first_seed: the first case's seed.
    """

    @functools.cache
    def build(name: str, root: str) -> Checkpoint:
        return Checkpoint(cases[name], os.path.join(root, name),
                          seed=first_seed + list(cases).index(name))

    @pytest.fixture(scope="session")
    def ckpt(tmp_path_factory):
        root = str(tmp_path_factory.getbasetemp() / folder)
        return lambda name: build(name, root)

    return ckpt, build


ckpt, checkpoint = checkpoints(
    {name: (model_type, CONFIG_CLASSES[model_type], fields, expect)
     for name, (model_type, fields, expect) in CASES.items()}, "hf_checkpoints")


def assert_loads_with_transformers_logits(c: Checkpoint, atol: float = ATOL, **options):
    """Loads checkpoint `c` (with `models.load`'s `options`) and checks its model type, the
    fields `c.expect` names, the special ids of `SPECIAL`, finite weights and transformers'
    teacher-forced logits within `atol`. Returns (the loaded model, its `helpers.fns`)."""
    pre = models.load(c.path, **options)
    assert pre.model_type == c.model_type
    for field, value in c.expect.items():
        assert getattr(pre.config, field) == value, field
    assert (pre.config.pad_id, pre.config.bos_id, pre.config.eos_id) == (4, 1, 2)
    chex.assert_tree_all_finite(pre.params)
    f = helpers.fns(pre.config)
    np.testing.assert_allclose(f.forward(pre.params, jnp.asarray(c.tokens)), c.logits,
                               atol=atol, rtol=0)
    return pre, f


highest_precision = helpers.highest_precision      # re-exported: the files that import it


def copy_dir(src: str, dst) -> str:
    dst = str(dst)
    shutil.copytree(src, dst)
    return dst


def edit_config(path: str, edit) -> str:
    file = os.path.join(path, "config.json")
    with open(file) as f:
        hf = json.load(f)
    edit(hf)
    with open(file, "w") as f:
        json.dump(hf, f)
    return path


def set_fields(**fields):
    """A config.json edit (for `edit_config`) that sets `fields`."""
    return lambda hf: hf.update(fields)


def assert_refused_by_name(path: str, words) -> None:
    """Reading the directory's config raises a ValueError whose message holds every word."""
    with pytest.raises(ValueError) as info:
        models.pretrained.read_config(path)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def assert_bfloat16_loads_exactly(c, root, reload=None, **save_options) -> None:
    """Checkpoint `c` (any case's: its transformers `model`) saved in bfloat16 by
    transformers loads exactly: as float32, and as bfloat16 (every leaf) with the same
    values; saved again (`save_options`: `models.save`'s) it gives transformers the tensors
    it wrote, bit for bit (read back by `reload`'s from_pretrained; default: the causal LM
    auto class)."""
    bf16 = copy.deepcopy(c.model).to(torch.bfloat16)
    bf16.save_pretrained(os.path.join(root, "bf16"), safe_serialization=True)
    as_f32 = models.load(os.path.join(root, "bf16"))
    as_bf16 = models.load(os.path.join(root, "bf16"), param_dtype="bfloat16")
    assert {x.dtype for x in jax.tree.leaves(as_bf16.params)} == {jnp.dtype(jnp.bfloat16)}
    assert_same_params(as_bf16.params,
                       jax.tree.map(lambda x: x.astype(jnp.bfloat16), as_f32.params))
    models.save(os.path.join(root, "again"), as_bf16.config, as_bf16.params, **save_options)
    reload = reload or transformers.AutoModelForCausalLM
    again = reload.from_pretrained(os.path.join(root, "again"))
    # As transformers reads its own file (it keeps some modules in float32: DeepSeek-V3's
    # router).
    assert_same_tensors(state_of(reload.from_pretrained(os.path.join(root, "bf16"))), again)


def assert_saves_back_bit_for_bit(c, model_type: str, root) -> None:
    """Checkpoint `c` loaded, then saved under `root`: written as `model_type`, read by
    transformers as the same class with the tensors it wrote, bit for bit, and its logits;
    read back by us as the same config and parameters. A stack of one MLP kind (and no
    linear layers, which run looped) also loads scanned, its layers stacked."""
    pre = models.load(c.path)
    out = os.path.join(str(root), "again")
    assert models.save(out, pre.config, pre.params) == model_type
    again = hf_load(out)
    assert type(again) is type(c.model)
    assert_same_tensors(c.state, again)
    np.testing.assert_array_equal(hf_logits(again, c.tokens), c.logits)
    assert models.load(out).config == pre.config
    assert_same_params(models.load(out).params, pre.params)
    if not pre.config.moe_layers and not pre.config.has_linear_layers:
        scanned = models.load(c.path, scan_layers=True)
        assert_same_params(scanned.params, stack_layers(pre.params))


def stack_layers(tree):
    """An unscanned parameter tree in the scanned layout: layer_0 .. layer_{L-1} of a stack
    become one `layers` subtree whose leaves have a leading L axis."""
    if not isinstance(tree, dict):
        return tree
    layers = sorted((k for k in tree if k.startswith("layer_")), key=lambda k: int(k[6:]))
    out = {k: stack_layers(v) for k, v in tree.items() if k not in layers}
    if layers:
        assert layers == [f"layer_{i}" for i in range(len(layers))]
        out["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *[tree[k] for k in layers])
    return out


# ---------------------------------------------------------------------------------------------
# Encoder-decoder checkpoints (BART, Marian, M2M-100, T5, mT5): the same idea with a ragged batch of
# sources (lengths SRC_LENS, junk after them, masked by transformers' attention_mask) and
# decoder inputs that start with the config's decoder start token.

S = 9                              # source width
SRC_LENS = np.array([9, 5])        # row 1 is padded
_BART = dict(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2,
             encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48,
             decoder_ffn_dim=48, max_position_embeddings=32, dropout=0.0,
             attention_dropout=0.0, activation_dropout=0.0)
_T5 = dict(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
           relative_attention_num_buckets=8, relative_attention_max_distance=12,
           dropout_rate=0.0)

SEQ2SEQ_CASES = {
    "bart": ("bart", dict(_BART, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                          decoder_start_token_id=2, forced_eos_token_id=2,
                          scale_embedding=False), dict(
        positions="learned", position_offset=2, embedding_norm=True, norm_position="post",
        activation="gelu_exact", logits_bias=True, bos_id=2, pad_id=1, eos_id=2)),
    "bart-scaled-3-layers": ("bart", dict(_BART, vocab_size=70, encoder_layers=3,
                                          decoder_layers=1, scale_embedding=True,
                                          pad_token_id=1, bos_token_id=0, eos_token_id=2,
                                          decoder_start_token_id=2), dict(
        scale_embeddings=True, num_encoder_layers=3, num_decoder_layers=1)),
    "marian-shared": ("marian", dict(_BART, vocab_size=66, pad_token_id=65, eos_token_id=0,
                                     decoder_start_token_id=65, forced_eos_token_id=0,
                                     activation_function="swish", scale_embedding=True,
                                     share_encoder_decoder_embeddings=True), dict(
        positions="sinusoidal_paper", activation="silu", share_embeddings=True,
        scale_embeddings=True, logits_bias=True, pad_id=65, bos_id=65, eos_id=0)),
    "marian-separate": ("marian", dict(_BART, vocab_size=66, pad_token_id=65, eos_token_id=0,
                                       decoder_start_token_id=65,
                                       activation_function="swish", scale_embedding=True,
                                       share_encoder_decoder_embeddings=False), dict(
        share_embeddings=False, tie_embeddings=True)),
    "t5-v1.0": ("t5", dict(_T5, feed_forward_proj="relu", tie_word_embeddings=True,
                           decoder_start_token_id=0), dict(
        positions="relative", scale_attention=False, norm="rmsnorm", use_bias=False,
        activation="relu", tie_embeddings=True, scale_head_input=True, bos_id=0, pad_id=0,
        eos_id=1)),
    "t5-v1.1": ("t5", dict(_T5, num_decoder_layers=3, feed_forward_proj="gated-gelu",
                           tie_word_embeddings=False, decoder_start_token_id=0), dict(
        activation="geglu", tie_embeddings=False, scale_head_input=False,
        num_decoder_layers=3)),
    "mt5": ("mt5", dict(_T5, vocab_size=72, feed_forward_proj="gated-gelu",
                        tie_word_embeddings=False, decoder_start_token_id=0), dict(
        activation="geglu", tie_embeddings=False, vocab_size=72)),
    # Last: each case's seed is its index, and earlier cases keep theirs.
    "m2m100": ("m2m_100", dict(_BART, vocab_size=68, pad_token_id=1, bos_token_id=0,
                               eos_token_id=2, decoder_start_token_id=2, scale_embedding=True,
                               activation_function="relu", encoder_layerdrop=0.05,
                               decoder_layerdrop=0.05), dict(
        positions="sinusoidal", position_offset=2, norm_position="pre", embedding_norm=False,
        logits_bias=False, scale_embeddings=True, activation="relu", share_embeddings=True,
        tie_embeddings=True, pad_id=1, bos_id=2, eos_id=2)),
    # mBART-50's ids; the decoder starts from eos (2), as its published files say (a
    # vocabulary of 76: with fewer, this random model's first token is already the end).
    "mbart": ("mbart", dict(_BART, vocab_size=76, pad_token_id=1, bos_token_id=0,
                            eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=2,
                            scale_embedding=True), dict(
        positions="learned", position_offset=2, embedding_norm=True, norm_position="pre",
        activation="gelu_exact", logits_bias=True, scale_embeddings=True, bos_id=2, pad_id=1,
        eos_id=2)),
    "pegasus": ("pegasus", dict(_BART, vocab_size=66, pad_token_id=0, eos_token_id=1,
                                decoder_start_token_id=0, forced_eos_token_id=1,
                                activation_function="relu", scale_embedding=True), dict(
        positions="sinusoidal_paper", norm_position="pre", embedding_norm=False,
        logits_bias=True, scale_embeddings=True, activation="relu", share_embeddings=True,
        tie_embeddings=True, pad_id=0, bos_id=0, eos_id=1)),
    # Gemma 2's layers in both stacks: sliding (a window of 3: both sides in the encoder)
    # and full, GQA, soft-caps low enough to bend the logits, the stacks' own token tables.
    "t5gemma": ("t5gemma", dict(
        vocab_size=64, decoder_start_token_id=2, **{stack: dict(
            vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            max_position_embeddings=32, sliding_window=3, query_pre_attn_scalar=8,
            attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
            for stack in ("encoder", "decoder")}), dict(
        positions="rope", layer_types=("sliding", "full"), sliding_window=3, num_kv_heads=2,
        share_embeddings=False, tie_embeddings=True, sublayer_output_norm=True,
        norm_scale_offset=1.0, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
        query_pre_attn_scalar=8.0, activation="geglu", pad_id=0, eos_id=1, bos_id=2)),
}
CONFIG_CLASSES.update(bart="BartConfig", marian="MarianConfig", m2m_100="M2M100Config",
                      mbart="MBartConfig", pegasus="PegasusConfig",
                      t5="T5Config", mt5="MT5Config", t5gemma="T5GemmaConfig")


def randomize_seq2seq(model, seed: int):
    """`randomize`, and the logits bias buffer of BART and Marian (zeros as made). Frozen
    parameters (Marian's sinusoidal position tables, which transformers neither saves nor
    loads but regenerates) keep their values: randomised, the model would compute with
    tables that its saved files do not hold."""
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    randomize(model, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in frozen:
                p.copy_(frozen[name])
        for name, buf in model.named_buffers():
            if name.endswith("final_logits_bias"):
                buf.copy_(torch.randn_like(buf) * 0.5)
    return model


def hf_seq2seq_logits(model, src, src_lens, tgt_in) -> np.ndarray:
    mask = np.arange(src.shape[1])[None, :] < np.asarray(src_lens)[:, None]
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(src, dtype=torch.long),
                     attention_mask=torch.as_tensor(mask, dtype=torch.long),
                     decoder_input_ids=torch.as_tensor(tgt_in, dtype=torch.long),
                     ).logits.float().numpy()


def hf_seq2seq_load(path: str):
    model, info = transformers.AutoModelForSeq2SeqLM.from_pretrained(
        path, attn_implementation="eager", output_loading_info=True)
    assert not any(info.values()), info
    return model.eval()


class Seq2SeqCheckpoint:
    """One tiny transformers encoder-decoder, saved: `path`, `model`, `src` (ragged, junk
    past SRC_LENS), `tgt_in` (starting with the decoder start token), `logits`, `state`."""

    def __init__(self, name: str, root: str, seed: int):
        model_type, fields, self.expect = SEQ2SEQ_CASES[name]
        self.model_type = model_type
        hf_cfg = getattr(transformers, CONFIG_CLASSES[model_type])(
            **copy.deepcopy(fields), attn_implementation="eager")
        torch.manual_seed(seed)
        model = transformers.AutoModelForSeq2SeqLM.from_config(hf_cfg)
        if fields.get("tie_word_embeddings") is False and model_type in ("t5", "mt5"):
            # transformers v5 builds every T5 tied (the flag only drops the head's input
            # scale); published v1.1 / mT5 checkpoints hold a head of their own: so this.
            model.lm_head.weight = torch.nn.Parameter(model.shared.weight.detach().clone())
        self.model = randomize_seq2seq(model, seed)
        assert self.model.config._attn_implementation == "eager"
        self.path = os.path.join(root, name)
        self.model.save_pretrained(self.path, safe_serialization=True)
        rng = np.random.default_rng(seed)
        vocab = hf_cfg.vocab_size
        self.src = rng.integers(0, vocab, (B, S)).astype(np.int32)
        self.src_lens = SRC_LENS.astype(np.int32)
        self.tgt_in = rng.integers(0, vocab, (B, T)).astype(np.int32)
        self.tgt_in[:, 0] = hf_cfg.decoder_start_token_id
        self.logits = hf_seq2seq_logits(self.model, self.src, self.src_lens, self.tgt_in)
        self.state = state_of(self.model)


@functools.cache
def seq2seq_checkpoint(name: str, root: str) -> Seq2SeqCheckpoint:
    return Seq2SeqCheckpoint(name, root, seed=100 + list(SEQ2SEQ_CASES).index(name))


@pytest.fixture(scope="session")
def seq2seq_ckpt(tmp_path_factory):
    """seq2seq_ckpt(name): the encoder-decoder case's checkpoint, built once."""
    root = str(tmp_path_factory.getbasetemp() / "hf_seq2seq_checkpoints")
    return lambda name: seq2seq_checkpoint(name, root)


# ---------------------------------------------------------------------------------------------
# Decoding checkpoints (greedy and beam search against transformers' `generate`).
#
# A random tied model mostly repeats its last token and never ends before a forced end, so
# every search would agree trivially. Each decoding checkpoint is the case's with its end
# token's logit bias raised to the 10th percentile of the end token's shortfall along
# transformers' greedy paths: sequences then end after 1 to N_NEW tokens, and the length
# penalty changes which beam wins. (T5 has no logits bias: its checkpoints decode as they
# are.)

N_NEW = 8


@dataclasses.dataclass(frozen=True)
class Decoding:
    """A decoding checkpoint: `path`, the transformers `model`, and a ragged batch of four
    sources `src` (the case's two and two others of the same lengths), lengths `src_lens`."""

    path: str
    model: object
    src: np.ndarray
    src_lens: np.ndarray


def hf_generate(model, src, src_lens, **options):
    """transformers' `generate` without its cache: the same tokens, and transformers 5.23's
    decoder cache is built for `num_layers` (the encoder's) layers, too few for a T5 with a
    deeper decoder (t5-v1.1 here)."""
    mask = np.arange(src.shape[1])[None, :] < np.asarray(src_lens)[:, None]
    with torch.no_grad():
        return model.generate(
            input_ids=torch.as_tensor(src, dtype=torch.long),
            attention_mask=torch.as_tensor(mask, dtype=torch.long),
            do_sample=False, max_new_tokens=N_NEW, use_cache=False, **options)


@functools.cache
def decoding_checkpoint(c, path: str) -> Decoding:
    model = copy.deepcopy(c.model)
    other = np.random.default_rng(7).integers(0, model.config.vocab_size, c.src.shape)
    src = np.concatenate([c.src, other.astype(np.int32)])
    src_lens = np.tile(c.src_lens, 2)
    bias = getattr(model, "final_logits_bias", None)
    if bias is not None:
        eos = model.generation_config.eos_token_id
        out = hf_generate(model, src, src_lens, num_beams=1, output_scores=True,
                           return_dict_in_generate=True)
        scores = torch.stack(out.scores[:-1])                # before the forced end
        shortfall = (scores.max(-1).values - scores[..., eos]).flatten().numpy()
        with torch.no_grad():
            bias[0, eos] += float(np.percentile(shortfall, 10))
    model.save_pretrained(path, safe_serialization=True)
    return Decoding(path, model, src, src_lens)


@pytest.fixture(scope="session")
def decoding_ckpt(seq2seq_ckpt, tmp_path_factory):
    """decoding_ckpt(name): the encoder-decoder case's decoding checkpoint, built once."""
    root = tmp_path_factory.getbasetemp() / "hf_seq2seq_decoding"
    return lambda name: decoding_checkpoint(seq2seq_ckpt(name), str(root / name))


def their_new_tokens(row: np.ndarray, pad_id: int, eos_ids) -> np.ndarray:
    """One row of transformers' output without its decoder start token and the padding
    after its end (pad ids; its beam search pads with the end id where the pad id is 0,
    Pegasus's)."""
    new = row[1:]
    ends = np.flatnonzero(np.isin(new, eos_ids))
    if len(ends):
        after = new[ends[0] + 1:]
        assert np.all(after == pad_id) or np.all(np.isin(after, eos_ids)), row
        new = new[:ends[0] + 1]
    return new


# ---------------------------------------------------------------------------------------------
# Encoder-only checkpoints (BERT, RoBERTa): a masked-LM model or a sequence classifier, on a
# ragged batch (real tokens never a special id, the pad id after ENCODER_LENS, masked by
# transformers' attention_mask) with token types (sentence B from position 3) where the
# checkpoint has two.

ENCODER_LENS = np.array([10, 6])   # row 1 is padded
_MODERNBERT = dict(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=4,
                   num_attention_heads=4, max_position_embeddings=40, local_attention=4,
                   pad_token_id=4, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                   sep_token_id=2,
                   rope_parameters={"full_attention": {"rope_type": "default",
                                                       "rope_theta": 1000.0},
                                    "sliding_attention": {"rope_type": "default",
                                                          "rope_theta": 50.0}})
_ENCODER = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=48, max_position_embeddings=40)

# name -> (model_type, transformers class, its config's fields, what the loaded config says)
ENCODER_CASES = {
    "bert-mlm": ("bert", "BertForMaskedLM", dict(_ENCODER, type_vocab_size=2), dict(
        num_labels=0, num_token_types=2, positions="learned", position_offset=0,
        embedding_norm=True, norm_position="post", activation="gelu_exact", norm_eps=1e-12,
        max_len=40, pad_id=0, eos_id=None, bos_id=None, dropout_rate=0.1)),
    "bert-classifier-gelu-new": ("bert", "BertForSequenceClassification", dict(
        _ENCODER, type_vocab_size=2, hidden_act="gelu_new", layer_norm_eps=1e-7,
        pad_token_id=5, id2label={0: "neg", 1: "neutral", 2: "pos"},
        label2id={"neg": 0, "neutral": 1, "pos": 2}), dict(
        num_labels=3, label_names=("neg", "neutral", "pos"), activation="gelu",
        norm_eps=1e-7, pad_id=5)),
    "roberta-mlm": ("roberta", "RobertaForMaskedLM", dict(
        _ENCODER, type_vocab_size=1, layer_norm_eps=1e-5), dict(
        num_labels=0, num_token_types=1, position_offset=2, max_len=38, norm_eps=1e-5,
        activation="gelu_exact", pad_id=1, bos_id=0, eos_id=2)),
    "roberta-classifier-3-layers-relu": ("roberta", "RobertaForSequenceClassification", dict(
        _ENCODER, num_hidden_layers=3, type_vocab_size=1, num_labels=2, hidden_act="relu",
        pad_token_id=3), dict(
        num_labels=2, num_layers=3, activation="relu", position_offset=4, max_len=36, pad_id=3)),
    # Global, local, global layers (local: 2 positions on either side), RoPE bases of each
    # kind, the first layer without its attention norm, GeGLU with erf GELU, no biases.
    "modernbert-mlm": ("modernbert", "ModernBertForMaskedLM", dict(
        _MODERNBERT, num_hidden_layers=3, global_attn_every_n_layers=2), dict(
        num_labels=0, layer_types=("full", "sliding", "full"), sliding_window=2,
        head_bias=False,
        rope_theta=1000.0, rope_local_theta=50.0, activation="geglu_exact", norm_bias=False,
        first_attention_norm=False, use_bias=False, pad_id=4, bos_id=1, eos_id=2)),
    # A classifier pooling the mean of each row's real tokens, biases everywhere.
    "modernbert-classifier-mean-biases": ("modernbert", "ModernBertForSequenceClassification",
                                          dict(_MODERNBERT, classifier_pooling="mean",
                                               attention_bias=True, mlp_bias=True,
                                               classifier_bias=True, num_labels=3), dict(
        num_labels=3, classifier_pooling="mean", classifier_head="transform", use_bias=True,
        head_bias=True,
        layer_types=("full", "sliding", "sliding", "full"))),
}
CONFIG_CLASSES.update(bert="BertConfig", roberta="RobertaConfig",
                      modernbert="ModernBertConfig")


def randomize_encoder(model, seed: int):
    """`randomize`, with BERT's "LayerNorm" scales (which its name test misses) near 1."""
    randomize(model, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("LayerNorm.weight"):
                p.add_(1.0)
    return model


def hf_encoder_logits(model, tokens, lengths, token_types=None) -> np.ndarray:
    mask = np.arange(tokens.shape[1])[None, :] < np.asarray(lengths)[:, None]
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(tokens, dtype=torch.long),
                     attention_mask=torch.as_tensor(mask, dtype=torch.long),
                     **({} if token_types is None else dict(token_type_ids=torch.as_tensor(
                         token_types, dtype=torch.long)))).logits.float().numpy()


def hf_encoder_load(path: str, class_name: str):
    model, info = getattr(transformers, class_name).from_pretrained(
        path, attn_implementation="eager", output_loading_info=True)
    assert not any(info.values()), info
    return model.eval()


class EncoderCheckpoint:
    """One tiny transformers encoder-only model, saved: `path`, `model`, `class_name`,
    `tokens` (ragged: the pad id past `lengths`), `token_types` (None for one type),
    `logits` (per token for a masked-LM model, per row for a classifier), `state`."""

    def __init__(self, name: str, root: str, seed: int):
        model_type, self.class_name, fields, self.expect = ENCODER_CASES[name]
        self.model_type = model_type
        hf_cfg = getattr(transformers, CONFIG_CLASSES[model_type])(
            **copy.deepcopy(fields), attn_implementation="eager")
        torch.manual_seed(seed)
        self.model = randomize_encoder(getattr(transformers, self.class_name)(hf_cfg), seed)
        assert self.model.config._attn_implementation == "eager"
        self.path = os.path.join(root, name)
        self.model.save_pretrained(self.path, safe_serialization=True)
        rng = np.random.default_rng(seed)
        self.lengths = ENCODER_LENS.astype(np.int32)
        # Real tokens above every special id; the pad id after each row's length.
        self.tokens = rng.integers(6, hf_cfg.vocab_size, (B, T)).astype(np.int32)
        self.tokens[np.arange(T)[None, :] >= self.lengths[:, None]] = hf_cfg.pad_token_id
        self.token_types = None
        if getattr(hf_cfg, "type_vocab_size", 1) > 1:
            self.token_types = (np.arange(T)[None, :] >= 3).astype(np.int32).repeat(B, 0)
        self.logits = hf_encoder_logits(self.model, self.tokens, self.lengths, self.token_types)
        self.state = state_of(self.model)


@functools.cache
def encoder_checkpoint(name: str, root: str) -> EncoderCheckpoint:
    return EncoderCheckpoint(name, root, seed=200 + list(ENCODER_CASES).index(name))


@pytest.fixture(scope="session")
def encoder_ckpt(tmp_path_factory):
    """encoder_ckpt(name): the encoder-only case's checkpoint, built once."""
    root = str(tmp_path_factory.getbasetemp() / "hf_encoder_checkpoints")
    return lambda name: encoder_checkpoint(name, root)


def assert_greedy_equals_generate(pre, c, *, filler: int, n_new: int = 10) -> None:
    """Ours decodes `c`'s first two prompts (PROMPT_LENS tokens) in one right-padded batch,
    the padding `filler`; transformers' `generate` decodes each alone, unpadded (its left
    padding would count pad slots in a sliding window). Both stop at end token 2; ours
    fills with pad 4 after it."""
    prompts = np.where(np.arange(T)[None, :] < PROMPT_LENS[:, None], c.tokens, filler)[:, :8]
    ours = decode.generate(pre.model, pre.params, prompts, PROMPT_LENS.astype(np.int32),
                           max_new_tokens=n_new)
    for b, n in enumerate(PROMPT_LENS):
        with torch.no_grad():
            theirs = c.model.generate(
                torch.as_tensor(c.tokens[b:b + 1, :n], dtype=torch.long),
                attention_mask=torch.ones((1, int(n)), dtype=torch.long),
                max_new_tokens=n_new, do_sample=False, num_beams=1, eos_token_id=2,
                pad_token_id=4)[0, n:].numpy()
        length = int(ours.lengths[b])
        np.testing.assert_array_equal(np.asarray(ours.tokens[b, :length]), theirs,
                                      err_msg=f"row {b}")
        assert np.all(np.asarray(ours.tokens[b, length:]) == 4)          # the config's pad


def assert_every_decoder_gives_greedy(cfg, model_type: str, *, seed: int,
                                      speculative: bool = True):
    """A tiny model of `cfg` with every weight moved off its initial value (sinks, biases
    and norms not zero or one): greedy decoding of a ragged batch gives each prompt's tokens
    alone; the serving engine (paged cache, chunked prefill, preemption) gives them too;
    with `speculative`, so does the model drafting for itself (every draft accepted, both
    caches rolled forward by lengths); beam search of width 1 gives greedy's. Returns
    (model, params, padded prompts, lengths, greedy output) for further checks."""
    import serve
    from models.pretrained import GenerationDefaults, Pretrained
    from serve.engine import Engine
    model = models.build(cfg)
    params = jax.tree.map(lambda x: x + 0.3 * jnp.sin(jnp.arange(x.size).reshape(x.shape)),
                          helpers.fns(cfg).init(0))
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(4, cfg.vocab_size, size=n).tolist() for n in (3, 13, 7, 1)]
    padded, lengths = decode.pad_prompts(prompts)
    greedy = decode.generate(model, params, padded, lengths, max_new_tokens=10, eos_id=None)
    alone = [np.asarray(greedy.tokens[b, :10]).tolist() for b in range(len(prompts))]
    for b, p in enumerate(prompts):     # the batch's rows are each prompt's alone
        one, n = decode.pad_prompts([p])
        assert decode.generate(model, params, one, n, max_new_tokens=10,
                               eos_id=None).tokens[0, :10].tolist() == alone[b]
    pre = Pretrained(model=model, config=cfg, params=params, tokenizer=None,
                     generation=GenerationDefaults(), model_type=model_type)
    engine = Engine(pre, max_slots=3, page_size=4, num_pages=10, max_tokens_per_step=8,
                    prefill_chunk=4).start(warmup=False)
    request = decode.DecodeRequest(max_new_tokens=10, eos_id=None)
    handles = [engine.submit(serve.Submission(tuple(p), request)) for p in prompts]
    assert [h.result()[1] for h in handles] == alone
    engine.stop()
    if speculative:
        drafted = decode.generate(model, params, padded, lengths, max_new_tokens=10,
                                  eos_id=None, draft_model=model, draft_params=params,
                                  draft_tokens=3)
        np.testing.assert_array_equal(drafted.tokens[:, :10], greedy.tokens[:, :10])
    beam = decode.beam_search(model, params, padded, lengths, beam_size=1, max_new_tokens=10,
                              eos_id=None)
    np.testing.assert_array_equal(np.asarray(beam.tokens)[:, 0, :10], greedy.tokens[:, :10])
    return model, params, padded, lengths, greedy
