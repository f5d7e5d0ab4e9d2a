"""The loss in slices of the sequence (`train.chunked_loss`, `loss_chunks`): the same sums
and the same gradients as the plain loss for every head the objectives train (tied and
untied, soft-capped, scaled, biased, masked LM's), never a whole [T, V] array, the same
train step, and bad settings refused by name."""

import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models.errors import UserError
from models.pretrained import GenerationDefaults
from models.tokenizer import ByteTokenizer
from tests.helpers import tiny
from train import chunked_loss, losses
from train.objectives import fit
from train.run_config import RunConfig, base_config
from train.settings import ObjectiveSettings, SequenceSettings

TOK = ByteTokenizer(mask=True)
W = 10              # positions; 3 slices of 4 (the last one half padding)
CHUNKS = 3
SMOOTH_Z = dict(label_smoothing=0.1, z_loss=1e-2)


def _rows(cfg, rows: int = 3) -> dict:
    """Packed rows of two segments, the last two positions padding (weight 0)."""
    r = np.random.default_rng(0)
    out = {}
    for side in ("inputs", "targets"):
        tok = r.integers(4, TOK.vocab_size - 1, (rows, W)).astype(np.int32)
        seg = np.ones((rows, W), np.int32)
        pos = np.tile(np.arange(W, dtype=np.int32), (rows, 1))
        seg[:, 5:], pos[:, 5:] = 2, np.arange(W - 5)
        seg[:, -2:], pos[:, -2:], tok[:, -2:] = 0, 0, 0
        out.update({side: tok, f"{side}_segmentation": seg, f"{side}_position": pos})
    if not cfg.is_encoder_decoder and cfg.architecture != "encoder_only":
        del out["inputs"], out["inputs_segmentation"], out["inputs_position"]
    if cfg.audio is not None:             # a clip's features [mel, frames] instead of tokens
        del out["inputs_segmentation"], out["inputs_position"]
        out["inputs"] = r.normal(size=(rows, cfg.audio.num_mel_bins, cfg.audio.num_frames)
                                 ).astype(np.float32)
    return jax.tree.map(jnp.asarray, out)


# An English-only Whisper's generation defaults: its prompt is start (2), <|notimestamps|>.
WHISPER_GENERATION = GenerationDefaults.from_dict(
    {"decoder_start_token_id": 2, "eos_token_id": 1, "no_timestamps_token_id": 7,
     "forced_decoder_ids": [[1, 7]]}, TOK.vocab_size)


def _objective(cfg, kind: str, chunks: int):
    settings = ObjectiveSettings(loss_chunks=chunks, **SMOOTH_Z)
    data = types.SimpleNamespace(name="d", kind=kind, label_names=())
    generation = WHISPER_GENERATION if kind == "speech" else None
    return fit(cfg, data, TOK, settings, model_name="m", generation=generation)[1]


def _loss_and_grad(cfg, kind: str, chunks: int):
    """The objective's training sums and the gradient of its loss w.r.t. every parameter."""
    objective, model, batch = _objective(cfg, kind, chunks), models.build(cfg), _rows(cfg)
    args, method = objective.init_inputs(batch)
    params = model.init(jax.random.key(0), *args, method=method)["params"]
    task = objective.prepare(batch, key=jax.random.key(1), row_ids=jnp.arange(3))

    def loss(params):
        sums = objective.loss_sums(model, params, batch, task, dropout_rng=jax.random.key(2),
                                   sample_rng=jax.random.key(3), step=0, train=True)
        return sums["loss"], sums

    (_, sums), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return sums, grads


def _assert_close(want, got, rtol=1e-5):
    """Every leaf within rtol of its own largest magnitude."""
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got),
                            strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = max(float(np.max(np.abs(a))), 1e-30)
        assert float(np.max(np.abs(a - b))) <= rtol * scale, jax.tree_util.keystr(path)


# No biases in the layers: a key bias's gradient is exactly zero in theory, rounding noise in
# practice, and noise is not relative to anything.
HEADS = {
    "decoder-untied-softcapped-biased": ("decoder_only", "text", dict(
        tie_embeddings=False, final_logit_softcapping=5.0, logits_bias=True)),
    "decoder-tied": ("decoder_only", "text", dict(tie_embeddings=True)),
    "encdec-shared-scaled": ("encoder_decoder", "translation", dict(
        tie_embeddings=True, share_embeddings=True, scale_head_input=True)),
    "masked-lm": ("encoder_only", "text", dict()),
    "whisper-untied": ("encoder_decoder", "speech", dict(
        tie_embeddings=False, share_embeddings=False,
        audio=dict(num_mel_bins=4, max_source_positions=W // 2))),
}


@pytest.mark.parametrize("name", HEADS)
def test_sliced_loss_and_gradients_equal_the_plain_ones(name):
    architecture, kind, head = HEADS[name]
    cfg = tiny(architecture, vocab_size=TOK.vocab_size, max_len=W, use_bias=False,
               num_layers=1, num_encoder_layers=1, num_decoder_layers=1, **head)
    plain_sums, plain_grads = _loss_and_grad(cfg, kind, 0)
    sliced_sums, sliced_grads = _loss_and_grad(cfg, kind, CHUNKS)
    assert float(plain_sums["weight"]) > 0 and float(plain_sums["z_loss"]) > 0
    _assert_close(plain_sums, sliced_sums)
    _assert_close(plain_grads, sliced_grads)


def test_the_function_alone_equals_the_plain_loss_for_every_output_and_input():
    """Cotangents of every sum (not only `loss`) reach the head, the states and the weights."""
    r = np.random.default_rng(1)
    x_BTD = jnp.asarray(r.normal(size=(2, 7, 5)), jnp.float32)
    head = {"w": jnp.asarray(r.normal(size=(5, 11)), jnp.float32)}
    targets_BT = jnp.asarray(r.integers(0, 11, (2, 7)), jnp.int32)
    weights_BT = jnp.asarray(r.random((2, 7)), jnp.float32)

    def head_fn(h, x):
        return jnp.tanh(x @ h["w"]) * 3.0

    def total(sums):
        return sums["loss"] + 0.5 * sums["nll"] + 2.0 * sums["z_loss"]

    def plain(h, x, w):
        return total(losses.cross_entropy(head_fn(h, x), targets_BT, w, **SMOOTH_Z))

    want = jax.jit(jax.value_and_grad(plain, argnums=(0, 1, 2)))(head, x_BTD, weights_BT)
    for chunks in (3, 100):                    # slices of 3 (2 padded positions), of 1
        def sliced(h, x, w, chunks=chunks):
            return total(chunked_loss.chunked_cross_entropy(
                head_fn, h, x, targets_BT, w, chunks=chunks, **SMOOTH_Z))

        _assert_close(want, jax.jit(jax.value_and_grad(sliced, argnums=(0, 1, 2)))(
            head, x_BTD, weights_BT))


def test_slices_cover_the_sequence_without_a_slice_of_padding_alone():
    assert chunked_loss.slices(10, 4) == (3, 4)       # [0:3] [3:6] [6:9] [9:10] + 2 padded
    assert chunked_loss.slices(10, 16) == (1, 10)
    assert chunked_loss.slices(12, 3) == (4, 3)
    assert chunked_loss.slices(5, 1) == (5, 1)


def test_the_compiled_gradient_holds_no_whole_logits_array():
    """At T 1024, V 2048 one [T, V] float32 array is 8 MiB: the plain gradient's scratch
    holds several, the sliced one (8 slices) less than one."""
    T, D, V = 1024, 16, 2048
    x_BTD = jax.ShapeDtypeStruct((1, T, D), jnp.float32)
    head = {"w": jax.ShapeDtypeStruct((D, V), jnp.float32)}
    targets_BT = jax.ShapeDtypeStruct((1, T), jnp.int32)
    weights_BT = jax.ShapeDtypeStruct((1, T), jnp.float32)

    def head_fn(h, x):
        return x @ h["w"]

    def temp_bytes(chunks):
        def loss(h, x, t, w):
            if chunks:
                return chunked_loss.chunked_cross_entropy(head_fn, h, x, t, w,
                                                          chunks=chunks)["loss"]
            return losses.cross_entropy(head_fn(h, x), t, w)["loss"]
        grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
        compiled = grad.lower(head, x_BTD, targets_BT, weights_BT).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    logits_bytes = T * V * 4
    assert temp_bytes(0) >= 2 * logits_bytes
    assert temp_bytes(8) < logits_bytes


def test_one_train_step_with_slices_equals_one_without():
    from tests.test_train_step import _batch, _setup
    from train import parallel
    batch = jax.tree.map(lambda x: x.reshape(1, -1, x.shape[-1]), _batch(0, 4))

    def one_step(chunks):
        # adam_eps 1 and lr 1 from the first step: the first update is g / (|g| + 1), so
        # the updates compare as the gradients do (a small eps would make it lr * sign(g),
        # which turns rounding in a near-zero gradient into a whole step).
        steps, state = _setup(loss_chunks=chunks, z_loss=1e-3, adam_eps=1.0,
                              learning_rate=1.0, warmup_steps=0, grad_clip_norm=0.0)
        assert steps.objective.loss_chunks == chunks
        train_fn, eval_fn = steps.functions()
        dp = parallel.DataParallel("pmap", train_fn, eval_fn)
        one = jax.pmap(train_fn, axis_name="batch", devices=jax.devices()[:1])
        s, metrics = one(parallel.replicate(state, jax.devices()[:1]), batch)
        return dp.host_state(s).params, jax.tree.map(lambda m: m[0], metrics)

    plain_params, plain_metrics = one_step(0)
    sliced_params, sliced_metrics = one_step(5)
    assert float(plain_metrics["z_loss"]) > 0
    _assert_close(plain_metrics, sliced_metrics)            # loss, z_loss, grad_norm, ...
    # Parameters of magnitude up to ~1, moved by updates up to ~0.5: float32 rounding.
    chex.assert_trees_all_close(sliced_params, plain_params, atol=1e-6, rtol=0)


def test_bad_settings_are_refused_by_name():
    with pytest.raises(UserError, match=r"loss_chunks=-1 must be an int >= 0"):
        ObjectiveSettings(loss_chunks=-1)
    with pytest.raises(UserError, match=r"loss_chunks=2.5 must be an int >= 0"):
        ObjectiveSettings(loss_chunks=2.5)
    values = base_config().to_dict()
    values["loss_chunks"] = "four"
    with pytest.raises(UserError, match=r"loss_chunks='four' must be an int >= 0"):
        RunConfig.from_config(values)
    x, t, w = jnp.zeros((1, 4, 2)), jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4))
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(UserError, match=rf"chunks={bad!r} must be an int >= 1"):
            chunked_loss.chunked_cross_entropy(lambda h, x: x, {}, x, t, w, chunks=bad)
    with pytest.raises(UserError, match=r"hidden states \(1, 4\) must be \[B, T, D\]"):
        chunked_loss.chunked_cross_entropy(lambda h, x: x, {}, x[..., 0], t, w, chunks=2)


def test_objectives_without_a_vocabulary_loss_refuse_loss_chunks():
    settings = ObjectiveSettings(loss_chunks=4)
    classes = types.SimpleNamespace(name="d", kind="classification", label_names=("a", "b"))
    cfg = tiny("encoder_only", vocab_size=TOK.vocab_size, max_len=W, num_labels=2)
    with pytest.raises(UserError, match=r"loss_chunks=4 slices a loss over the vocabulary "
                                        r"at every position, which the classification "
                                        r"objective does not compute"):
        fit(cfg, classes, TOK, settings, model_name="m")
    sequence = ObjectiveSettings(loss_chunks=4, sequence=SequenceSettings(objective="mrt"))
    pairs = types.SimpleNamespace(name="d", kind="translation", label_names=())
    cfg = tiny("encoder_decoder", vocab_size=TOK.vocab_size, max_len=W)
    with pytest.raises(UserError, match=r"which the sequence level objective does not"):
        fit(cfg, pairs, TOK, sequence, model_name="m")
