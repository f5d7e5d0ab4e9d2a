"""The encoder-only objectives in the train step: masked LM and classification.

pmap and shard_map over 4 devices equal one device (the masks are drawn per global row),
the loss is the cross-entropy at the chosen positions over their global count, evaluation
masks are fixed, and F1 follows its formula.
"""

import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from tests.helpers import tiny
from tests.train_helpers import tiny_train_config
from train import losses, parallel, state as state_lib
from train.masking import Masking
from train.objectives import Classification, MaskedLM, fit
from train.run_config import RunConfig
from train.settings import ObjectiveSettings
from train.step import Steps

W, V, MASK = 12, 64, 63
SPECIALS = (0, 1, 2, 3, MASK)
MLM = MaskedLM(mask_id=MASK, vocab_size=V, special_ids=SPECIALS, masking=Masking(rate=0.3))
CLASSIFY = Classification()


def _rows(seed, rows, name):
    """Packed rows of two segments each (then two padding slots), BOS first, EOS last."""
    r = np.random.default_rng(seed)
    tok = r.integers(4, MASK, (rows, W)).astype(np.int32)
    seg = np.ones((rows, W), np.int32)
    pos = np.tile(np.arange(W, dtype=np.int32), (rows, 1))
    labels = np.zeros((rows, W), np.int32)
    for i, c in enumerate(r.integers(3, W - 4, rows)):
        seg[i, c:], pos[i, c:] = 2, np.arange(W - c)
        seg[i, W - 2:], pos[i, W - 2:], tok[i, W - 2:] = 0, 0, 0
        tok[i, [0, c]], tok[i, [c - 1, W - 3]] = 2, 1
        labels[i, [0, c]] = r.integers(0, 3, 2)
    out = {name: tok, f"{name}_segmentation": seg, f"{name}_position": pos}
    if name == "inputs":
        out["labels"] = labels
    return out


def _setup(num_labels):
    run = RunConfig.from_config(tiny_train_config("", adam_eps=1e-6, label_smoothing=0.0))
    cfg = tiny("encoder_only", vocab_size=V, max_len=W, num_labels=num_labels, use_bias=False)
    model = models.build(cfg)
    params = model.init(jax.random.key(0), jnp.zeros((1, W), jnp.int32),
                        method="classify" if num_labels else None)["params"]
    tx, schedule = state_lib.make_optimizer(run.optimizer, run.loop.num_train_steps)
    return model, state_lib.TrainState.create(params, tx, 0), schedule


def _run(kind, devices, batches, objective, num_labels):
    model, state, schedule = _setup(num_labels)
    train_fn, eval_fn = Steps(model, objective, schedule).functions()
    dp = parallel.DataParallel(kind, train_fn, eval_fn)
    if devices == 1:
        step = jax.pmap(train_fn, axis_name="batch", devices=jax.devices()[:1])
        s = parallel.replicate(state, jax.devices()[:1])
    else:
        step, s = dp.train_step, dp.put_state(state)
    sums = []
    for b in batches:
        s, m = step(s, jax.tree.map(lambda x: x.reshape(devices, -1, W), b))
        sums.append(dp.metrics(m))
    return dp.host_state(s).params, sums


@pytest.mark.parametrize("objective,name,labels", [(MLM, "targets", 0),
                                                    (CLASSIFY, "inputs", 3)],
                         ids=["mlm", "classify"])
def test_pmap_and_shard_map_over_4_devices_equal_one_device(objective, name, labels):
    batches = [_rows(i, 8, name) for i in range(3)]
    one, one_sums = _run("pmap", 1, batches, objective, labels)
    for kind in ("pmap", "shard_map"):
        params, sums = _run(kind, 4, batches, objective, labels)
        chex.assert_trees_all_close(params, one, atol=2e-5)
        for a, b in zip(sums, one_sums, strict=True):       # the same positions scored
            assert a["weight"] == b["weight"] > 0
            np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5)


def test_masked_lm_scores_only_the_chosen_real_tokens_and_normalises_by_their_count():
    model, state, _ = _setup(0)
    batch = jax.tree.map(jnp.asarray, _rows(5, 8, "targets"))
    task = MLM.prepare(batch, key=jax.random.key(3), row_ids=jnp.arange(8))
    chosen = np.asarray(task["weights"]) > 0
    tokens = np.asarray(batch["targets"])
    assert chosen.any() and not np.isin(tokens[chosen], SPECIALS).any()
    assert not chosen[np.asarray(batch["targets_segmentation"]) == 0].any()
    unchosen = ~chosen
    np.testing.assert_array_equal(np.asarray(task["inputs"])[unchosen], tokens[unchosen])
    logits = model.apply({"params": state.params}, task["inputs"],
                         segment_ids=batch["targets_segmentation"],
                         positions=batch["targets_position"])
    log_p = jax.nn.log_softmax(logits)
    nll = -np.take_along_axis(np.asarray(log_p), tokens[..., None], -1)[..., 0]
    sums = MLM.loss_sums(model, state.params, batch, task, dropout_rng=jax.random.key(0),
                         sample_rng=jax.random.key(1), step=0, train=False)
    np.testing.assert_allclose(sums["loss"] / sums["weight"], nll[chosen].mean(), rtol=1e-5)
    assert sums["weight"] == chosen.sum()


def test_evaluation_masks_each_example_alike_whatever_its_row_and_device():
    model, state, schedule = _setup(0)
    _, eval_fn = Steps(model, MLM, schedule).functions()
    batch = _rows(9, 8, "targets")
    batch["example_index"] = np.arange(8, dtype=np.int32)[::-1].copy()
    shuffled = jax.tree.map(lambda x: x[::-1], batch)          # rows in another order
    out = []
    for b, devices in ((batch, 1), (shuffled, 4)):
        dp = parallel.DataParallel("pmap", eval_fn, eval_fn) if devices == 4 else None
        run = (dp._eval if dp else jax.pmap(eval_fn, axis_name="batch",
                                            devices=jax.devices()[:1]))
        params = parallel.replicate(state.params, jax.devices()[:devices])
        split = {k: v.reshape(devices, -1, *v.shape[1:]) for k, v in b.items()}
        out.append(jax.tree.map(lambda x: np.asarray(x)[0], run(params, split)))
    assert out[0]["weight"] == out[1]["weight"] > 0
    np.testing.assert_allclose(out[0]["loss"], out[1]["loss"], rtol=1e-5)


def test_f1_of_each_class_follows_its_formula():
    logits = jnp.asarray(np.eye(3)[[0, 0, 1, 2, 2, 2]][None].astype(np.float32))
    labels = jnp.asarray([[0, 1, 1, 2, 2, 0]])
    weights = jnp.asarray([[1, 1, 1, 1, 1, 0]], jnp.float32)        # the last one unscored
    counts = losses.confusion(logits, labels, weights)
    np.testing.assert_array_equal(counts["true_positives"], [1, 1, 2])
    np.testing.assert_array_equal(counts["false_positives"], [1, 0, 0])
    np.testing.assert_array_equal(counts["false_negatives"], [0, 1, 0])
    f1 = losses.f1_scores(counts, ("a", "b", "c"))
    assert f1 == pytest.approx({"f1/a": 2 / 3, "f1/b": 2 / 3, "f1/c": 1.0,
                                "macro_f1": (2 / 3 + 2 / 3 + 1) / 3})


def test_masked_lm_without_a_mask_token_is_refused_by_name():
    from models.tokenizer import ByteTokenizer
    cfg = tiny("encoder_only", vocab_size=261)
    text = types.SimpleNamespace(name="toy_text", kind="text", label_names=())
    settings = ObjectiveSettings()
    with pytest.raises(ValueError, match=r"masked LM needs a mask token, and the tokenizer "
                                         r"\(byte\) has none"):
        fit(cfg, text, ByteTokenizer(), settings, model_name="tiny")
    assert fit(cfg, text, ByteTokenizer(mask=True), settings,
               model_name="tiny")[1].mask_id == 260
    labelled = types.SimpleNamespace(name="toy_classification", kind="classification",
                                     label_names=("a", "b"))
    _, objective = fit(cfg.replace(num_labels=2), labelled, ByteTokenizer(), settings,
                       model_name="tiny")
    assert isinstance(objective, Classification)
