"""What is particular to `t5` and `mt5` (models/pretrained/t5.py); the parity that every
encoder-decoder family shares is tests/test_pretrained_seq2seq.py's.

- Our relative position buckets are transformers' on every distance in [-300, 300], in
  both directions, for T5's (32, 128) and the tiny (8, 12).
- In cached decoding each step's query (at position p) is biased against every cache slot
  as transformers biases it with its own cache: a prefill then steps, across the
  logarithmic buckets and beyond max_distance, give its cached logits.
- The head: v1.0's tied, scaled head and v1.1's / mT5's untied, unscaled one load right from
  config.json as transformers v5 writes it and as v4 wrote it (tying settled by the
  tensors, as v5 does), with the per-stack embedding copies old files hold.
- Unsupported config values are refused by name; configs T5 cannot express are not saved
  as T5, and one it can is saved so that transformers computes the same logits.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import models
from models.pretrained import FAMILIES, read_config
from models.pretrained.family import Inexpressible
from models.relative import RelativePositionBias, relative_buckets
from tests import pretrained_helpers as ph
from tests.pretrained_helpers import (
    ATOL,
    assert_same_tensors,
    copy_dir,
    edit_config,
    hf_seq2seq_load,
    hf_seq2seq_logits,
    state_of,
    torch,
    transformers,
)

highest_precision = ph.highest_precision        # the shared fixture

T5Attention = transformers.models.t5.modeling_t5.T5Attention
_TINY = dict(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_heads=4,
             relative_attention_num_buckets=8, relative_attention_max_distance=12,
             dropout_rate=0.0, decoder_start_token_id=0)
S, T, PREFIX = 16, 20, 5                 # both beyond max_distance 12
SRC_LENS = np.array([16, 11], np.int32)
WEIGHTS = "model.safetensors"


def _tokens(seed: int, vocab: int = 64):
    rng = np.random.default_rng(seed)
    src = rng.integers(0, vocab, (2, S)).astype(np.int32)
    tgt = rng.integers(0, vocab, (2, T)).astype(np.int32)
    tgt[:, 0] = 0
    return src, tgt


class Original:
    """A tiny transformers T5 (random weights) saved by `save_pretrained`, with its logits."""

    def __init__(self, root: str, name: str, seed: int, untied: bool, **fields):
        hf_cfg = transformers.T5Config(**_TINY, **fields, attn_implementation="eager")
        torch.manual_seed(seed)
        self.model = transformers.AutoModelForSeq2SeqLM.from_config(hf_cfg)
        if untied:    # transformers v5 ties every T5 it builds; v1.1 / mT5 files are not tied
            self.model.lm_head.weight = torch.nn.Parameter(
                self.model.shared.weight.detach().clone())
        ph.randomize_seq2seq(self.model, seed)
        self.path = os.path.join(root, name)
        self.model.save_pretrained(self.path, safe_serialization=True)
        self.src, self.tgt = _tokens(seed)
        self.logits = hf_seq2seq_logits(self.model, self.src, SRC_LENS, self.tgt)


@functools.cache
def _original(kind: str, root: str) -> Original:
    if kind == "v1.0":
        return Original(root, kind, 0, untied=False, num_layers=2, feed_forward_proj="relu")
    return Original(root, kind, 1, untied=True, num_layers=2, num_decoder_layers=1,
                    feed_forward_proj="gated-gelu", tie_word_embeddings=False)


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("t5_originals"))
    return lambda kind: _original(kind, root)


def _our_logits(pre, src, tgt):
    return np.asarray(pre.model.apply({"params": pre.params}, jnp.asarray(src),
                                      jnp.asarray(tgt), src_lengths=jnp.asarray(SRC_LENS)))


# ---------------------------------------------------------------------------------------------
# 1. Buckets, and the bias of every cached step.

@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (8, 12)])
@pytest.mark.parametrize("bidirectional", [True, False], ids=["encoder", "decoder"])
def test_relative_buckets_are_transformers(num_buckets, max_distance, bidirectional):
    relative = np.arange(-300, 301)
    ours = relative_buckets(jnp.asarray(relative, jnp.int32)[None, None, :],
                            bidirectional=bidirectional, num_buckets=num_buckets,
                            max_distance=max_distance)[0, 0]
    theirs = T5Attention._relative_position_bucket(
        torch.as_tensor(relative), bidirectional=bidirectional, num_buckets=num_buckets,
        max_distance=max_distance).numpy()
    np.testing.assert_array_equal(np.asarray(ours), theirs)
    # Every bucket is reached (but an encoder's first key-after-query one: distance 0).
    assert len(set(theirs.tolist())) == num_buckets - bidirectional


def _hf_cached_logits(model, src, tgt) -> np.ndarray:
    """transformers' logits from a prefill of PREFIX tokens, then one token per call with
    its cache (`past_key_values`)."""
    mask = torch.as_tensor(np.arange(S)[None, :] < SRC_LENS[:, None], dtype=torch.long)
    tgt = torch.as_tensor(tgt, dtype=torch.long)
    with torch.no_grad():
        encoded = model.get_encoder()(input_ids=torch.as_tensor(src, dtype=torch.long),
                                      attention_mask=mask)
        out = model(encoder_outputs=encoded, attention_mask=mask,
                    decoder_input_ids=tgt[:, :PREFIX], use_cache=True)
        logits = [out.logits]
        for t in range(PREFIX, T):
            out = model(encoder_outputs=encoded, attention_mask=mask,
                        decoder_input_ids=tgt[:, t:t + 1], past_key_values=out.past_key_values,
                        use_cache=True)
            logits.append(out.logits)
    return torch.cat(logits, dim=1).float().numpy()


def test_each_cached_step_is_biased_as_transformers_biases_it(original, highest_precision):
    o = original("v1.0")
    pre = models.load(o.path)
    cfg = pre.config
    theirs = _hf_cached_logits(o.model, o.src, o.tgt)
    np.testing.assert_allclose(theirs, o.logits, atol=ATOL, rtol=0)   # their cache is right
    # The bias itself: the query at position p over the first p + 1 of 24 cache slots.
    table = {"params": {"embedding": pre.params["decoder"]["relative_bias"]["embedding"]}}
    slots = jnp.arange(24, dtype=jnp.int32)[None, :]
    attention = o.model.decoder.block[0].layer[0].SelfAttention
    for p in range(PREFIX, T):
        ours = RelativePositionBias(cfg, bidirectional=False).apply(
            table, jnp.full((1, 1), p, jnp.int32), slots).materialize()
        with torch.no_grad():
            want = attention.compute_bias(1, p + 1, past_seen_tokens=p).numpy()
        np.testing.assert_array_equal(np.asarray(ours)[..., :p + 1], want)
    # And through the model: prefill, then one token per step.
    params = pre.params
    cache = pre.model.apply({"params": params}, jnp.asarray(o.src), 24,
                            src_lengths=jnp.asarray(SRC_LENS), method="init_cache")
    logits, cache = pre.model.apply({"params": params}, jnp.asarray(o.tgt[:, :PREFIX]),
                                    jnp.full((2,), PREFIX, jnp.int32), cache, method="prefill")
    step = jax.jit(functools.partial(pre.model.apply, method="step"))
    got = [np.asarray(logits)]
    for t in range(PREFIX, T):
        logits, cache = step({"params": params}, jnp.asarray(o.tgt[:, t]), cache)
        got.append(np.asarray(logits)[:, None])
    np.testing.assert_allclose(np.concatenate(got, axis=1), theirs, atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------
# 2. The head: tied or not, scaled or not, from v5 and v4 config.json files.

def _v4_v10(path: str) -> None:
    """As t5-small's files: no tie/scale fields (v4: tied and scaled), n_positions, copies
    of the embedding in each stack and as the head, an old unused cross-attention table."""
    def edit(hf):
        for key in ("scale_decoder_outputs", "tie_word_embeddings", "dense_act_fn",
                    "is_gated_act"):
            hf.pop(key)
        hf.update(n_positions=512, output_past=True)
    edit_config(path, edit)
    file = os.path.join(path, WEIGHTS)
    tensors = load_file(file)
    for key in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"):
        tensors[key] = tensors["shared.weight"].copy()
    tensors["decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"] = (
        np.ones((8, 4), np.float32))
    save_file(tensors, file, metadata={"format": "pt"})


def _v4_v11(path: str) -> None:
    """As t5-v1_1 / flan-t5 files: tie_word_embeddings false, no scale field, no derived
    activation fields; the file holds its own head."""
    def edit(hf):
        for key in ("scale_decoder_outputs", "dense_act_fn", "is_gated_act"):
            hf.pop(key)
        hf["tie_word_embeddings"] = False
    edit_config(path, edit)


def _mt5(v4: bool):
    """The same weights as mt5: mt5 never scales; v4 files say tie false and may leave out
    feed_forward_proj (mt5's default is gated-gelu)."""
    def edit_path(path: str) -> None:
        def edit(hf):
            hf.pop("scale_decoder_outputs")
            hf.update(model_type="mt5", architectures=["MT5ForConditionalGeneration"])
            if v4:
                for key in ("dense_act_fn", "is_gated_act", "feed_forward_proj"):
                    hf.pop(key)
                hf["tie_word_embeddings"] = False
        edit_config(path, edit)
    return edit_path


def _tied_file_untied_config(path: str) -> None:
    """tie_word_embeddings false but no head in the file (what v5 saves for
    T5Config(tie_word_embeddings=False)): transformers v5 ties the head, unscaled."""
    def edit(hf):
        hf["scale_decoder_outputs"] = False
        hf["tie_word_embeddings"] = False
    edit_config(path, edit)


HEADS = {   # name -> (original, edit, (activation, tie_embeddings, scale_head_input))
    "v1.0-v5-config": ("v1.0", None, ("relu", True, True)),
    "v1.0-v4-config-with-copies": ("v1.0", _v4_v10, ("relu", True, True)),
    "v1.0-weights-head-untied-by-v5": ("v1.0", _tied_file_untied_config, ("relu", True, False)),
    "v1.1-v5-config": ("v1.1", None, ("geglu", False, False)),
    "v1.1-v4-config": ("v1.1", _v4_v11, ("geglu", False, False)),
    "mt5-v5-config": ("v1.1", _mt5(v4=False), ("geglu", False, False)),
    "mt5-v4-config": ("v1.1", _mt5(v4=True), ("geglu", False, False)),
}


@pytest.mark.parametrize("name", HEADS)
def test_head_tying_and_scaling_as_transformers_reads_them(name, original, tmp_path,
                                                           highest_precision):
    kind, edit, (activation, tied, scaled) = HEADS[name]
    o = original(kind)
    path = copy_dir(o.path, tmp_path / name)
    if edit is not None:
        edit(path)
    hf_model = hf_seq2seq_load(path)            # what transformers makes of the edited files
    assert (hf_model.lm_head.weight is hf_model.shared.weight) == tied
    pre = models.load(path)
    cfg = pre.config
    assert (cfg.activation, cfg.tie_embeddings, cfg.scale_head_input) == (activation, tied,
                                                                          scaled)
    assert read_config(path)[1] == cfg          # a fine-tuning run sees the same config
    assert ("head" in pre.params) != tied
    want = hf_seq2seq_logits(hf_model, o.src, SRC_LENS, o.tgt)
    np.testing.assert_allclose(_our_logits(pre, o.src, o.tgt), want, atol=ATOL, rtol=0)
    if name.endswith("v5-config"):              # saving gives back the same files
        out = str(tmp_path / "saved")
        models.save(out, cfg, pre.params, model_type=pre.model_type)
        assert_same_tensors(state_of(o.model), hf_seq2seq_load(out))


def test_embedding_read_from_stack_copies_and_differing_copies_refused(original, tmp_path,
                                                                      highest_precision):
    """A file without shared.weight (madlad400's layout) reads the embedding from the
    stacks' copies; a copy that differs is refused by name (transformers would untie it)."""
    o = original("v1.1")
    path = copy_dir(o.path, tmp_path / "stack-copies")
    file = os.path.join(path, WEIGHTS)
    tensors = load_file(file)
    shared = tensors.pop("shared.weight")
    tensors["encoder.embed_tokens.weight"] = shared
    tensors["decoder.embed_tokens.weight"] = shared.copy()
    save_file(tensors, file, metadata={"format": "pt"})
    pre = models.load(path)
    assert not pre.config.tie_embeddings
    np.testing.assert_allclose(_our_logits(pre, o.src, o.tgt), o.logits, atol=ATOL, rtol=0)
    tensors["decoder.embed_tokens.weight"] = shared + 1.0
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"decoder\.embed_tokens\.weight"):
        models.load(path)


# ---------------------------------------------------------------------------------------------
# 3. Config values refused by name, and saving.

_V5 = dict(_TINY, model_type="t5", num_layers=2, feed_forward_proj="relu")


@pytest.mark.parametrize("fields, match", [
    (dict(feed_forward_proj="gated-relu6"), r"feed_forward_proj='gated-relu6'"),
    (dict(feed_forward_proj="relu6"), r"feed_forward_proj='relu6'"),
    (dict(feed_forward_proj="gated-relu"), r"feed_forward_proj='gated-relu'"),
    (dict(feed_forward_proj="gated-gelu-new"), r"feed_forward_proj='gated-gelu-new'"),
    (dict(dense_act_fn="gelu_fast"), r"dense_act_fn='gelu_fast'"),
    (dict(feed_forward_proj="gated-gelu", dense_act_fn="gelu"), r"dense_act_fn='gelu'"),
    (dict(is_encoder_decoder=False), r"is_encoder_decoder=False"),
    (dict(decoder_start_token_id=None, pad_token_id=None), r"decoder_start_token_id=None"),
    (dict(relative_attention_bias_per_layer=True), r"relative_attention_bias_per_layer"),
    (dict(model_type="mt5", scale_decoder_outputs=True), r"scale_decoder_outputs=True"),
])
def test_unsupported_config_values_are_refused_by_name(fields, match):
    hf = {**_V5, **fields}
    with pytest.raises(ValueError, match=match):
        FAMILIES[hf["model_type"]].config_from_hf(hf)


def test_umt5_is_refused_by_name(tmp_path):
    """umT5 (a position table in every layer) is its own model_type, which load names."""
    (tmp_path / "config.json").write_text('{"model_type": "umt5", "d_model": 32}')
    with pytest.raises(ValueError, match=r"model_type 'umt5' is not supported"):
        models.load(str(tmp_path))


def test_configs_t5_cannot_express_fall_through_and_one_it_can_saves_as_t5(tmp_path,
                                                                           highest_precision):
    t5, mt5 = FAMILIES["t5"], FAMILIES["mt5"]
    project = models.get_config("transformer-tiny", vocab_size=64)
    with pytest.raises(Inexpressible, match="t5 cannot express"):
        t5.config_to_hf(project)
    assert models.save(str(tmp_path / "project"), project,
                       models.build(project).init(jax.random.key(0), *[jnp.ones((1, 3),
                                                  jnp.int32)] * 2)["params"]) != "t5"
    ours = models.TransformerConfig(
        architecture="encoder_decoder", vocab_size=64, d_model=32, num_heads=4, head_dim=6,
        mlp_dim=40, num_encoder_layers=1, num_decoder_layers=2, positions="relative",
        relative_buckets=8, relative_max_distance=12, norm="rmsnorm", use_bias=False,
        activation="swiglu", tie_embeddings=False, scale_attention=False,
        scale_head_input=True, max_len=64, pad_id=0, eos_id=1, bos_id=0)
    for wrong, field in ((dict(use_bias=True), "use_bias"), (dict(num_kv_heads=2), "num_kv_heads"),
                         (dict(activation="gelu_exact", norm="layernorm"), "norm")):
        with pytest.raises(Inexpressible, match=field):
            t5.config_to_hf(ours.replace(**wrong))
    with pytest.raises(Inexpressible, match="scale_head_input"):
        mt5.config_to_hf(ours)
    model = models.build(ours)
    src, tgt = _tokens(7)
    params = model.init(jax.random.key(1), jnp.asarray(src), jnp.asarray(tgt))["params"]
    params = jax.tree.map(lambda p: p + 0.1 * jax.random.normal(jax.random.key(2), p.shape),
                          params)                      # unit norms and zeros would hide bugs
    out = str(tmp_path / "ours")
    assert models.save(out, ours, params) == "t5"
    hf_model = hf_seq2seq_load(out)
    assert hf_model.config.scale_decoder_outputs and hf_model.lm_head.weight is not (
        hf_model.shared.weight)
    want = hf_seq2seq_logits(hf_model, src, SRC_LENS, tgt)
    got = model.apply({"params": params}, jnp.asarray(src), jnp.asarray(tgt),
                      src_lengths=jnp.asarray(SRC_LENS))
    np.testing.assert_allclose(np.asarray(got), want, atol=ATOL, rtol=0)
    assert models.load(out).config == ours


def test_a_t5_whose_dropout_a_run_changed_still_saves_as_t5(tmp_path):
    """Dropout is how a run trains: loading with other rates (as a fine-tune's
    model_overrides do) leaves the model saveable as t5, with its one rate written."""
    seq2seq_ckpt = ph.seq2seq_checkpoint("t5-v1.0", str(tmp_path / "src"))
    pre = models.load(seq2seq_ckpt.path, dropout_rate=0.0, mlp_dropout_rate=0.2)
    assert (pre.config.dropout_rate, pre.config.mlp_dropout_rate) == (0.0, 0.2)
    assert models.save(str(tmp_path / "out"), pre.config, pre.params) == "t5"
    assert models.load(str(tmp_path / "out")).config.dropout_rate == 0.0
