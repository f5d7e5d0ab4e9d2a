"""Sequence-level training (`train.objectives.sequence*`): minimum risk training's risk and
gradient by hand, self-critical REINFORCE's baseline, duplicate candidates, host rewards,
the `sequence.*` keys' refusals, device splits equal to one device, exact resume, and a
teacher-forced run continued with `finetune_sequence`."""

import os
import signal

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

import decode
import models
from tests.helpers import tiny
from tests.train_helpers import straight_run, tiny_train_config, train_metric_rows
from train import checkpoint, configs, parallel, state as state_lib
from train.objectives.sequence import SequenceLevel
from train.objectives.sequence_candidates import Drawing, draw, row_keys
from train.objectives.sequence_rewards import HostRewards, reward_function, score
from train.objectives.sequence_risk import expected_risk, first_occurrences, self_critical
from train.objectives.sequence_settings import SequenceSettings
from train.run_config import RunConfig, check_config
from train.settings import ObjectiveSettings
from train.state import make_optimizer
from train.step import Steps, summarise
from train.trainer import train_and_evaluate

W = 10


# --- the losses, by hand ----------------------------------------------------------------


def test_the_risk_and_its_gradient_equal_the_hand_formula():
    logp = np.array([[-1.0, -2.0, -3.0]], np.float32)
    cost = np.array([[0.0, 0.5, 1.0]], np.float32)
    keep = np.array([[True, True, True]])
    alpha = 0.5
    # q_j = exp(alpha l_j) / sum_i exp(alpha l_i); risk = sum q_j c_j;
    # d risk / d l_j = alpha q_j (c_j - risk).
    e = np.exp(alpha * logp[0])
    q = e / e.sum()
    risk = float((q * cost[0]).sum())
    grad = alpha * q * (cost[0] - risk)

    def f(lp):
        return expected_risk(lp, jnp.asarray(cost), jnp.asarray(keep), alpha=alpha)[0]

    got, got_grad = jax.value_and_grad(f)(jnp.asarray(logp))
    np.testing.assert_allclose(got, risk, rtol=1e-6)
    np.testing.assert_allclose(got_grad[0], grad, rtol=1e-5, atol=1e-7)
    # The docstring's example: logp [-1, -2], cost [0, 1], alpha 1 -> risk 0.269.
    two = expected_risk(jnp.array([[-1.0, -2.0]]), jnp.array([[0.0, 1.0]]),
                        jnp.array([[True, True]]), alpha=1.0)
    np.testing.assert_allclose(two, [1 / (1 + np.e)], rtol=1e-6)


def test_a_dropped_candidate_leaves_the_risk_and_gets_no_gradient():
    logp = jnp.array([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]])
    cost = jnp.array([[0.0, 1.0, 0.3], [0.2, 0.4, 0.6]])
    keep = jnp.array([[True, True, False], [False, False, False]])
    risk, vjp = jax.vjp(lambda lp: expected_risk(lp, cost, keep, alpha=1.0), logp)
    np.testing.assert_allclose(risk[0], 1 / (1 + np.e), rtol=1e-6)    # as over two candidates
    assert float(risk[1]) == 0.0                                        # none kept: no risk
    (grad,) = vjp(jnp.ones(2))
    assert float(grad[0, 2]) == 0.0 and np.all(np.asarray(grad[1]) == 0.0)
    assert np.all(np.isfinite(np.asarray(grad)))


def test_a_cheaper_candidate_is_pushed_up_by_the_risk():
    grad = jax.grad(lambda lp: expected_risk(lp, jnp.array([[0.0, 1.0]]),
                                             jnp.array([[True, True]]), alpha=1.0)[0])(
        jnp.array([[-1.0, -1.0]]))
    assert float(grad[0, 0]) < 0 < float(grad[0, 1])    # descent raises the cheap one


def test_the_self_critical_baseline_zeroes_a_sample_as_good_as_greedy():
    logp = jnp.array([[-1.0, -2.0, -3.0]])
    reward = jnp.array([[0.5, 0.9, 0.1]])
    baseline = jnp.array([0.5])                      # the greedy output's reward
    keep = jnp.array([[True, True, True]])
    loss, grad = jax.value_and_grad(
        lambda lp: self_critical(lp, reward, baseline, keep)[0])(logp)
    # loss = -(1/3) sum_j (r_j - b) logp_j; d loss / d logp_j = -(r_j - b) / 3.
    np.testing.assert_allclose(loss, -((0.4 * -2.0) + (-0.4 * -3.0)) / 3, rtol=1e-6)
    np.testing.assert_allclose(grad[0], [0.0, -0.4 / 3, 0.4 / 3], rtol=1e-5, atol=1e-7)
    assert float(grad[0, 0]) == 0.0                  # equal to greedy: no gradient
    assert float(grad[0, 1]) < 0 < float(grad[0, 2])  # better pushed up, worse down
    # The reward carries no gradient of its own.
    g_reward = jax.grad(lambda r: self_critical(logp, r, baseline, keep)[0])(reward)
    assert np.all(np.asarray(g_reward) == 0.0)


def test_first_occurrences_keep_each_distinct_candidate_once():
    tokens = jnp.array([[[5, 1, 0], [5, 1, 0], [6, 1, 0]],
                        [[5, 1, 9], [5, 1, 7], [5, 1, 0]]])     # equal up to their lengths
    lengths = jnp.array([[2, 2, 2], [2, 2, 3]])
    np.testing.assert_array_equal(first_occurrences(tokens, lengths),
                                  [[True, False, True], [True, False, True]])


# --- host rewards -----------------------------------------------------------------------


class NumberTokenizer:
    """Ids as text: "5 6 7", up to the end token 1 (pad 0 and start 2 dropped)."""

    def decode(self, ids):
        out = []
        for i in ids:
            if i == 1:
                break
            if i not in (0, 2):
                out.append(str(i))
        return " ".join(out)


def test_built_in_rewards_are_sacrebleus_sentence_scores_over_100():
    for name in ("bleu", "chrf"):
        fn = reward_function(name)
        assert fn("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(1.0)
        assert 0.0 <= fn("a dog", "the cat sat on the mat") < 0.5
    rewards = HostRewards(reward_function("chrf"), NumberTokenizer(), "chrf")
    cand = np.array([[5, 6, 7, 1, 0], [9, 9, 1, 0, 0], [5, 6, 7, 1, 0], [8, 1, 0, 0, 0]])
    refs = np.array([[5, 6, 7, 1], [8, 1, 0, 0]])
    got = rewards(cand, np.array([4, 3, 4, 2]), refs, np.array([4, 2]))
    assert got.dtype == np.float32 and got.shape == (4,)
    assert got[0] == pytest.approx(1.0) and got[1] < 0.5       # candidates 0, 1: reference 0
    assert got[3] == pytest.approx(1.0)                         # candidate 3: reference 1


def test_a_users_reward_function_is_named_module_colon_function(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def same(h, r):\n    return float(h == r)\n"
        "def broken(h, r):\n    return float('nan') if h == 'x' else 0.5\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert score(reward_function("my_rewards:same"), ["a", "b"], ["a", "a"]).tolist() == [1, 0]
    with pytest.raises(ValueError, match=r"^sequence.reward='my_rewards:broken' gave nan for "
                                         r"the candidate 'x' \(reference 'y'\): a reward must "
                                         r"be a finite number$"):
        score(reward_function("my_rewards:broken"), ["ok", "x"], ["y", "y"],
              name="my_rewards:broken")
    with pytest.raises(ValueError, match=r"^sequence.reward='no_such_mod:f': cannot import "
                                         r"module 'no_such_mod'"):
        reward_function("no_such_mod:f")
    with pytest.raises(ValueError, match=r"^sequence.reward='my_rewards:absent': module "
                                         r"'my_rewards' has no function 'absent'$"):
        reward_function("my_rewards:absent")


# --- the keys ---------------------------------------------------------------------------


@pytest.mark.parametrize("make,message", [
    (lambda: SequenceSettings(objective="mrt", candidates=1),
     "sequence.candidates=1 must be >= 2 for objective='mrt'"),
    (lambda: SequenceSettings(objective="scst", include_gold=True),
     "sequence.include_gold=True is minimum risk training's option"),
    (lambda: SequenceSettings(objective="scst", sampling="beam"),
     "sequence.sampling='beam' is minimum risk training's option"),
    (lambda: SequenceSettings(objective="rl"), "sequence.objective='rl' must be one of 'none'"),
    (lambda: SequenceSettings(reward="rouge"), "sequence.reward='rouge' must be 'bleu', 'chrf'"),
    (lambda: SequenceSettings(alpha=0.0), "sequence.alpha=0.0 must be a number > 0"),
    (lambda: SequenceSettings(loss_weight=1.5), "sequence.loss_weight=1.5 must be a number in"),
    (lambda: SequenceSettings(temperature=0.0), "sequence.temperature=0.0 must be a number > 0"),
])
def test_bad_sequence_keys_are_refused_by_name(make, message):
    with pytest.raises(ValueError) as e:
        make()
    assert str(e.value).startswith(message), str(e.value)


def _sequence_config(name="copy", **sequence):
    c = configs.get(name)
    c.packing = False
    c.sequence.update(objective="mrt", **sequence)
    return c


def test_the_run_config_refuses_what_sequence_training_cannot_train():
    check_config(_sequence_config())
    c = _sequence_config()
    c.packing = True
    with pytest.raises(ValueError, match=r"^packing=True must be False for "
                                         r"sequence.objective='mrt'"):
        check_config(c)
    c = _sequence_config()
    c.sequence.candidates = 1
    with pytest.raises(ValueError, match=r"^sequence.candidates=1 must be >= 2"):
        check_config(c)
    c = configs.get("tiny_shakespeare")
    c.packing = False
    c.sequence.objective = "scst"
    with pytest.raises(ValueError, match=r"does not fit dataset 'tiny_shakespeare' \(text\): "
                                         r"sequence-level training: translation needs an "
                                         r"encoder-decoder \(sequence level\)\)$"):
        check_config(c)
    c = _sequence_config(sampling="beam")
    c.parallel = "shard_map"
    with pytest.raises(ValueError, match=r"^sequence.sampling='beam' runs beam search inside "
                                         r"the train step, which parallel='shard_map' cannot"):
        check_config(c)
    c.parallel = "pmap"
    check_config(c)
    c = _sequence_config()
    c.scheduled_sampling.enabled = True
    with pytest.raises(ValueError, match=r"^scheduled_sampling.enabled=True is next-token "
                                         r"prediction's option; sequence.objective='mrt'"):
        check_config(c)
    c = _sequence_config(max_new_tokens=200)     # the preset grows to hold the candidates
    assert RunConfig.from_config(c).needed_max_len == 201


def test_a_too_short_model_and_a_bad_reward_are_refused_when_built(tmp_path, monkeypatch):
    cfg = tiny("encoder_decoder", max_len=8)
    settings = ObjectiveSettings(sequence=SequenceSettings(objective="mrt", max_new_tokens=8))
    with pytest.raises(ValueError, match=r"^sequence.max_new_tokens=8 needs 9 decoder "
                                         r"positions .* max_len=8$"):
        SequenceLevel.build(cfg, NumberTokenizer(), settings, model_name="m")
    (tmp_path / "bad_reward.py").write_text("def f(h, r):\n    return 'good'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    settings = ObjectiveSettings(sequence=SequenceSettings(objective="mrt", max_new_tokens=4,
                                                           reward="bad_reward:f"))
    with pytest.raises(ValueError, match=r"^sequence.reward='bad_reward:f' gave 'good'"):
        SequenceLevel.build(cfg, NumberTokenizer(), settings, model_name="m")


# --- the step ---------------------------------------------------------------------------


def _batch(seed, rows):
    """Unpacked enc-dec rows: each a source and its reference (the reversed source)."""
    r = np.random.default_rng(seed)
    out = {k: np.zeros((rows, W), np.int32) for k in (
        "inputs", "inputs_segmentation", "inputs_position", "targets",
        "targets_segmentation", "targets_position")}
    for i in range(rows):
        n = int(r.integers(3, W - 1))
        src = r.integers(4, 61, n)
        for side, toks in (("inputs", src), ("targets", src[::-1])):
            out[side][i, :n + 1] = np.append(toks, 1)              # the end token
            out[f"{side}_segmentation"][i, :n + 1] = 1
            out[f"{side}_position"][i, :n + 1] = np.arange(n + 1)
    return out


def _setup(**sequence):
    config = tiny_train_config("", adam_eps=1e-6)
    model = models.build(tiny("encoder_decoder", max_len=W, use_bias=False,
                              num_encoder_layers=1, num_decoder_layers=1))
    params = model.init(jax.random.key(0), jnp.zeros((1, W), jnp.int32),
                        jnp.zeros((1, W), jnp.int32))["params"]
    run = RunConfig.from_config(config)
    settings = ObjectiveSettings(label_smoothing=0.0, sequence=SequenceSettings(
        **{"objective": "mrt", "candidates": 3, "alpha": 1.0, "reward": "chrf",
           "max_new_tokens": 6, **sequence}))
    objective = SequenceLevel.build(model.config, NumberTokenizer(), settings, model_name="t")
    tx, schedule = make_optimizer(run.optimizer, run.loop.num_train_steps)
    return Steps(model, objective, schedule), state_lib.TrainState.create(params, tx, 0)


def _run(kind, devices, batches, **sequence):
    """The params after one step per batch on `devices` (1: one device), and each step's
    summarised metrics."""
    steps, state = _setup(**sequence)
    train_fn, eval_fn = steps.functions()
    dp = parallel.DataParallel(kind, train_fn, eval_fn)
    if devices == 1:
        one = jax.pmap(train_fn, axis_name="batch", devices=jax.devices()[:1])
        s = parallel.replicate(state, jax.devices()[:1])
        step, metrics = one, lambda m: jax.tree.map(lambda x: np.asarray(x)[0], m)
    else:
        s, step, metrics = dp.put_state(state), dp.train_step, dp.metrics
    logged = []
    for b in batches:
        s, m = step(s, jax.tree.map(lambda x: x.reshape(devices, -1, W), b))
        logged.append(summarise(metrics(m)))
    return dp.host_state(s).params, logged


@pytest.mark.slow
def test_generate_runs_inside_shard_map_and_gives_one_devices_tokens():
    """decode.loop's carry varies over the mapped axis as the rows do (what candidates
    drawn inside a shard_map train step need)."""
    from jax.sharding import Mesh, PartitionSpec as P
    model = models.build(tiny("encoder_decoder", max_len=W, num_encoder_layers=1,
                              num_decoder_layers=1))
    params = model.init(jax.random.key(0), jnp.zeros((1, W), jnp.int32),
                        jnp.zeros((1, W), jnp.int32))["params"]
    b = _batch(1, 8)
    lengths = b["inputs_segmentation"].sum(-1).astype(np.int32)

    def greedy(src, n):
        return decode.generate(model, params, src, n, max_new_tokens=5).tokens

    mesh = Mesh(np.asarray(jax.devices()), ("batch",))
    mapped = jax.jit(jax.shard_map(greedy, mesh=mesh, in_specs=(P("batch"), P("batch")),
                                   out_specs=P("batch")))
    np.testing.assert_array_equal(mapped(b["inputs"], lengths), greedy(b["inputs"], lengths))


@pytest.mark.slow
def test_candidates_are_drawn_per_global_row_whatever_the_split():
    steps, state = _setup()
    model, b = steps.model, _batch(0, 4)
    lengths = b["inputs_segmentation"].sum(-1)
    drawing = Drawing(candidates=3, max_new_tokens=6)
    key = jax.random.key(5)
    whole = draw(model, state.params, b["inputs"], lengths, row_keys(key, jnp.arange(4)),
                 drawing=drawing)
    half = draw(model, state.params, b["inputs"][2:], lengths[2:],
                row_keys(key, jnp.arange(2, 4)), drawing=drawing)
    np.testing.assert_array_equal(whole[0][2:], half[0])
    np.testing.assert_array_equal(whole[1][2:], half[1])
    other = draw(model, state.params, b["inputs"], lengths,
                 row_keys(jax.random.key(6), jnp.arange(4)), drawing=drawing)
    assert not np.array_equal(whole[0], other[0])          # another step key, other draws
    assert whole[0].shape == (4, 3, 6) and np.all((whole[1] >= 1) & (whole[1] <= 6))
    # Beam search: each source's K best beams, as beam_search gives them for it alone.
    beams = draw(model, state.params, b["inputs"], lengths, row_keys(key, jnp.arange(4)),
                 drawing=Drawing(candidates=3, sampling="beam", max_new_tokens=6))
    alone = decode.beam_search(model, state.params, b["inputs"][1:2], lengths[1:2],
                               beam_size=3, max_new_tokens=6)
    np.testing.assert_array_equal(beams[0][1], alone.tokens[0])
    np.testing.assert_array_equal(beams[1][1], alone.lengths[0])


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["mrt", "scst"])
def test_pmap_and_shard_map_over_4_devices_equal_one_device(objective):
    batches = [_batch(i, 8) for i in range(2)]
    extra = {"include_gold": True} if objective == "mrt" else {}
    one, one_logs = _run("pmap", 1, batches, objective=objective, **extra)
    for kind in ("pmap", "shard_map"):
        params, logs = _run(kind, 4, batches, objective=objective, **extra)
        chex.assert_trees_all_close(params, one, atol=2e-5)
        for got, want in zip(logs, one_logs, strict=True):
            for k in ("reward", "risk", "loss"):
                assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), (kind, k)
    assert 0.0 <= one_logs[0]["reward"] <= 1.0 and 0.0 <= one_logs[0]["risk"] <= 1.0
    if objective == "scst":
        assert 0.0 <= one_logs[0]["greedy_reward"] <= 1.0


@pytest.mark.slow
def test_a_reward_that_is_not_finite_stops_the_step_naming_it(tmp_path, monkeypatch):
    """Inside the jitted step the host's UserError reaches the caller inside JAX's runtime
    error, its message whole: the reward's name, the value and the candidate."""
    (tmp_path / "nan_reward.py").write_text(
        "def f(h, r):\n    return 1.0 if h == r else float('nan')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(Exception, match=r"sequence.reward='nan_reward:f' gave nan for the "
                                        r"candidate '[0-9 ]*' \(reference '[0-9 ]+'\): a "
                                        r"reward must be a finite number"):
        _run("pmap", 1, [_batch(0, 8)], reward="nan_reward:f")
    # The failed callback's error is also kept for JAX's effects barrier: take it here,
    # not at the end of the test process.
    for _ in range(4):
        try:
            jax.effects_barrier()
            break
        except Exception as e:  # noqa: BLE001 (JAX's runtime error)
            assert "nan_reward:f" in str(e)


# --- runs -------------------------------------------------------------------------------


def _sigterm_at(k: int):
    """A hook that sends this process SIGTERM once step k's metrics are read."""
    return lambda step, metrics: step == k and os.kill(os.getpid(), signal.SIGTERM)


def _finetune_config(data_dir: str, model_dir: str) -> ml_collections.ConfigDict:
    """`finetune_sequence` from `model_dir` on the `copy` task: 4 steps of 8 rows."""
    c = configs.get("finetune_sequence")
    c.update(init_from=model_dir, dataset="copy", data_dir=data_dir, max_source_length=24,
             max_target_length=24, max_decode_length=8, per_device_batch_size=2,
             num_train_steps=4, learning_rate=1e-3, warmup_steps=1, log_every_steps=1,
             checkpoint_every_steps=2, eval_every_steps=1000, num_eval_decode=4,
             num_test_decode=0, eval_per_device_batch_size=16)
    c.sequence.update(candidates=3, max_new_tokens=8, alpha=1.0, include_gold=True)
    return c


@pytest.fixture(scope="module")
def mrt_run(data_dir, tmp_path_factory):
    """`finetune_sequence` (mrt, the reference among the candidates) for 4 steps on 4
    devices (pmap) from 6 teacher-forced steps of `copy`: (config, workdir, summary)."""
    base, _ = straight_run(data_dir)
    config = _finetune_config(data_dir, os.path.join(base, "model"))
    workdir = str(tmp_path_factory.mktemp("mrt"))
    return config, workdir, train_and_evaluate(config, workdir)


@pytest.mark.slow
def test_a_teacher_forced_run_continues_with_mrt_logs_its_reward_and_resumes_exactly(
        mrt_run, tmp_path):
    config, whole, summary = mrt_run
    assert summary["step"] == 4 and not summary["preempted"]
    rows = train_metric_rows(whole)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert 0.0 <= r["reward"] <= 1.0 and 0.0 <= r["risk"] <= 1.0, r
        assert np.isfinite(r["loss"]) and r["grad_norm"] > 0
    assert "bleu" in summary["validation"]
    pre = models.load(summary["model"])
    assert pre.config.is_encoder_decoder and jax.tree.leaves(pre.params)

    # Stopped after step 2 and resumed: the same candidates, rewards and parameters.
    resumed = str(tmp_path / "resumed")
    first = train_and_evaluate(config, resumed, hooks=[_sigterm_at(1)])
    assert first["step"] == 2 and first["stopped_by"] == "SIGTERM"
    second = train_and_evaluate(config, resumed)
    assert second["resumed_from_step"] == 2 and second["step"] == 4
    chex.assert_trees_all_equal(checkpoint.restore_model(resumed).params,
                                checkpoint.restore_model(whole).params)
    assert train_metric_rows(resumed) == rows


@pytest.mark.slow
def test_the_sharded_mesh_trains_what_pmap_does(mrt_run, tmp_path):
    """FSDP over the 4 devices (jit over the global batch, the rewards' callback given the
    whole batch) draws and scores the candidates pmap's devices do."""
    config, whole, _ = mrt_run
    sharded = ml_collections.ConfigDict(config.to_dict())
    sharded.update(parallel="sharded", num_eval_decode=0)
    train_and_evaluate(sharded, str(tmp_path))
    for got, want in zip(train_metric_rows(str(tmp_path)), train_metric_rows(whole),
                         strict=True):
        for k in ("reward", "risk", "loss"):
            assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), (got["step"], k)
    chex.assert_trees_all_close(checkpoint.restore_model(str(tmp_path)).params,
                                checkpoint.restore_model(whole).params, atol=1e-4)
