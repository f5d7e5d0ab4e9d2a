"""The train step: loss formula, pmap = shard_map = one device, accumulation, scheduled sampling."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from tests.helpers import tiny
from tests.train_helpers import next_token_steps, tiny_train_config
from train import losses, parallel, state as state_lib
from train.objectives.next_token import shift_right
from train.objectives.scheduled_sampling import ScheduledSampling, mix_predictions
from train.run_config import RunConfig
from train.settings import OptimizerSettings

W = 12


def _batch(rng, rows, packed=True):
    """Random enc-dec rows; packed ones hold two segments of different lengths."""
    r = np.random.default_rng(rng)
    out = {}
    for side in ("inputs", "targets"):
        tok = r.integers(4, 61, (rows, W)).astype(np.int32)
        seg = np.ones((rows, W), np.int32)
        pos = np.tile(np.arange(W, dtype=np.int32), (rows, 1))
        if packed:
            cut = r.integers(3, W - 3, rows)
            for i, c in enumerate(cut):
                seg[i, c:] = 2
                pos[i, c:] = np.arange(W - c)
                seg[i, W - 2:] = 0                       # two padding slots
                pos[i, W - 2:] = 0
                tok[i, W - 2:] = 0
        out[side] = tok
        out[f"{side}_segmentation"] = seg
        out[f"{side}_position"] = pos
    return out


def _setup(**overrides):
    # adam_eps 1e-6 rather than 1e-9: adam's first update is lr * g / (|g| + eps), which for
    # eps << |rounding error| turns float32 summation-order noise in near-zero gradients
    # into full-size steps; the comparisons are about gradients, not that amplifier.
    config = tiny_train_config("", **{"adam_eps": 1e-6, **overrides})
    # No biases: a key bias gets a mathematically zero gradient (softmax ignores it), and
    # adam turns that rounding noise into full-size, order-dependent updates.
    model = models.build(tiny("encoder_decoder", max_len=W, use_bias=False,
                              num_encoder_layers=1, num_decoder_layers=1))
    params = model.init(jax.random.key(0), jnp.zeros((1, W), jnp.int32),
                        jnp.zeros((1, W), jnp.int32))["params"]
    steps, tx = next_token_steps(model, config)
    return steps, state_lib.TrainState.create(params, tx, 0)


def _run(kind, devices, batches, **overrides):
    steps, state = _setup(**overrides)
    train_fn, eval_fn = steps.functions()
    if devices == 1:
        dp = parallel.DataParallel("pmap", train_fn, eval_fn)
        one = jax.pmap(train_fn, axis_name="batch", devices=jax.devices()[:1])
        s = parallel.replicate(state, jax.devices()[:1])
        for b in batches:
            s, _ = one(s, jax.tree.map(lambda x: x.reshape(1, -1, W), b))
        return dp.host_state(s).params
    dp = parallel.DataParallel(kind, train_fn, eval_fn)
    s = dp.put_state(state)
    for b in batches:
        s, m = dp.train_step(s, jax.tree.map(lambda x: x.reshape(devices, -1, W), b))
    return dp.host_state(s).params


def test_label_smoothing_matches_its_formula():
    r = np.random.default_rng(0)
    logits = r.normal(size=(2, 5, 7)).astype(np.float32)
    targets = r.integers(0, 7, (2, 5))
    weights = (r.random((2, 5)) > 0.3).astype(np.float32)
    eps, z = 0.1, 1e-3
    got = losses.cross_entropy(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights),
                               label_smoothing=eps, z_loss=z)
    log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    q = np.full(logits.shape, eps / 6)
    np.put_along_axis(q, targets[..., None], 1 - eps, axis=-1)
    kl = (q * (np.log(q) - log_p)).sum(-1)          # cross-entropy minus the target entropy
    zz = z * np.log(np.exp(logits).sum(-1)) ** 2
    np.testing.assert_allclose(got["loss"], ((kl + zz) * weights).sum(), rtol=1e-5)
    nll = -np.take_along_axis(log_p, targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(got["nll"], (nll * weights).sum(), rtol=1e-5)
    assert got["weight"] == weights.sum()


def test_pmap_and_shard_map_over_4_devices_equal_one_device():
    batches = [_batch(i, 8) for i in range(3)]
    one = _run("pmap", 1, batches)
    # Tolerance: float32 sums in a different order across devices; 3 adam steps.
    for kind in ("pmap", "shard_map"):
        chex.assert_trees_all_close(_run(kind, 4, batches), one, atol=2e-5)


def test_accumulating_k_micro_batches_equals_one_batch_k_times_larger():
    big = _batch(7, 8, packed=False)               # full rows: equal token counts per half
    halves = [jax.tree.map(lambda x: x[:4], big), jax.tree.map(lambda x: x[4:], big)]
    chex.assert_trees_all_close(_run("pmap", 4, halves, grad_accum_steps=2),
                                _run("pmap", 4, [big]), atol=1e-5)   # float32 re-association


def test_scheduled_sampling_at_rate_0_is_teacher_forcing_and_at_1_feeds_predictions():
    batches = [_batch(i, 4) for i in range(2)]
    plain = _run("pmap", 4, batches)
    ss = tiny_train_config("").scheduled_sampling
    ss.update(enabled=True, max_rate=0.0)
    # Same inputs, same loss; but the rate-0 program still runs the first pass, so XLA
    # fuses (and rounds) differently: last-bit gradient differences, which adam's second
    # update turns into up to ~2e-8 in a parameter near a zero gradient, are allowed; far
    # below what a single replaced decoder input does to the parameters (> 1e-4).
    chex.assert_trees_all_close(_run("pmap", 4, batches, scheduled_sampling=ss), plain,
                                atol=1e-7, rtol=1e-6)
    ss.update(max_rate=0.5, ramp_steps=1)            # rate 0.5 from step 1 on
    mixed = _run("pmap", 4, batches, scheduled_sampling=ss)
    assert any(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(mixed),
                                                     jax.tree.leaves(plain), strict=True))
    b = _batch(3, 2)
    dec_in = shift_right(b["targets"], b["targets_position"], b["targets_segmentation"], 2)
    logits = jax.random.normal(jax.random.key(1), (2, W, 61))
    pred = np.asarray(jnp.argmax(logits, -1))
    args = (b["targets_position"], b["targets_segmentation"])
    all_pred = np.asarray(mix_predictions(dec_in, logits, *args, rate=1.0, rng=jax.random.key(2)))
    inner = (b["targets_position"] > 0) & (b["targets_segmentation"] > 0)
    np.testing.assert_array_equal(all_pred[:, 1:][inner[:, 1:]], pred[:, :-1][inner[:, 1:]])
    np.testing.assert_array_equal(all_pred[~inner], np.asarray(dec_in)[~inner])   # BOS, pads
    none = mix_predictions(dec_in, logits, *args, rate=0.0, rng=jax.random.key(2))
    np.testing.assert_array_equal(none, dec_in)


def test_sampling_schedules_rise_from_zero_to_the_maximum():
    for name, k in (("linear", 1.0), ("exponential", 0.99), ("inverse_sigmoid", 50.0)):
        schedule = ScheduledSampling(schedule=name, k=k, max_rate=0.4, ramp_steps=100)
        rates = [float(schedule.rate(s)) for s in (0, 50, 100, 10_000)]
        assert rates == sorted(rates) and rates[0] < 0.05 and abs(rates[-1] - 0.4) < 1e-3, name
    with pytest.raises(ValueError, match="schedule='cubic' must be"):
        ScheduledSampling(schedule="cubic")


def test_shift_right_restarts_each_packed_segment_behind_bos():
    t = jnp.array([[5, 6, 1, 7, 1, 0]])
    pos = jnp.array([[0, 1, 2, 0, 1, 0]])
    seg = jnp.array([[1, 1, 1, 2, 2, 0]])
    np.testing.assert_array_equal(shift_right(t, pos, seg, 2), [[2, 5, 6, 2, 7, 0]])


@pytest.mark.parametrize("decay", ["rsqrt", "cosine", "constant"])
def test_every_warmup_starts_above_zero_and_reaches_the_peak(decay):
    """The first update moves the parameters (a warmup from 0 made step 0 a no-op)."""
    schedule = state_lib.learning_rate_schedule(2e-3, 100, decay, 1000)
    lrs = [float(schedule(s)) for s in (0, 1, 50, 100)]
    assert lrs[0] == pytest.approx(2e-3 / 100, rel=1e-5)       # float32 schedules
    assert lrs == sorted(lrs) and lrs[-1] == pytest.approx(2e-3, rel=1e-5)


def test_bad_optimiser_settings_are_named():
    with pytest.raises(ValueError, match="lr_decay='linear' must be"):
        RunConfig.from_config(tiny_train_config("", lr_decay="linear"))
    with pytest.raises(ValueError, match="lr_decay='linear' must be"):
        state_lib.learning_rate_schedule(1e-3, 10, "linear", 100)
    with pytest.raises(ValueError, match="grad_accum_steps=0 must be an int >= 1"):
        OptimizerSettings(grad_accum_steps=0)
    with pytest.raises(ValueError, match="parallel='pjit' must be"):
        parallel.DataParallel("pjit", None, None)


@pytest.mark.parametrize("kind", ["pmap", "shard_map"])
def test_the_wrapped_step_compiles_once_for_all_steps(kind):
    """State comes back from a donated step with the sharding it went in with, so step 2
    reuses step 1's executable (a replicated state on a mesh whose axis pmap does not name
    used to cost a second full compilation)."""
    steps, state = _setup()
    dp = parallel.DataParallel(kind, *steps.functions())
    s = dp.put_state(state)
    compiles = []

    def listener(event, seconds, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(seconds)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for i in range(3):
            s, m = dp.train_step(s, jax.tree.map(lambda x: x.reshape(4, -1, W), _batch(i, 8)))
            dp.metrics(m)
        dp.host_state(s)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert len(compiles) == 1
