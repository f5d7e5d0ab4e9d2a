"""GRPO (`train.objectives.grpo`, `finetune_grpo`): group advantages and the rewards by
hand, the gradient against the formula on the completions the step drew, the `grpo.*`
keys' refusals, and runs that raise their reward, resume exactly, and give the same steps
under pmap, shard_map and an FSDP mesh over 4 devices."""

import json
import os
import signal

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

import models
from models.tokenizer import ByteTokenizer
from tests.train_helpers import train_metric_rows
from train import checkpoint, configs, data as data_lib
from train.objectives import grpo, grpo_rewards
from train.objectives.grpo import Grpo, advantages, rollout_prompts
from train.objectives.grpo_settings import GrpoSettings
from train.objectives.sequence_candidates import Drawing, draw
from train.run_config import check_config
from train.trainer import train_and_evaluate

TOK = ByteTokenizer()


def ones(prompts, completions, answers):
    """A test reward: the share of "1" characters in the completion."""
    del prompts, answers
    return [c.count("1") / max(len(c), 1) for c in completions]


def spread(prompts, completions, answers):
    """A test reward that differs between almost any two completions."""
    del prompts, answers
    return [sum(ord(ch) % 7 for ch in c) / 10 for c in completions]


def not_a_number(prompts, completions, answers):
    return [float("nan")] * len(completions)


def as_long_as_asked(prompts, completions, answers, *, fields):
    """A test reward reading a field beyond the answer: 1 when the completion has the
    line's `length` characters."""
    del prompts, answers
    return [float(len(c) == f["length"]) for c, f in zip(completions, fields, strict=True)]


def test_advantages_are_each_groups_rewards_standardised_or_centred():
    r = np.array([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]], np.float32)
    scaled, std = advantages(jnp.asarray(r), scaled=True)
    want_std = r.std(axis=1, ddof=1)
    np.testing.assert_allclose(std, want_std, rtol=1e-6)
    np.testing.assert_allclose(scaled, (r - r.mean(1, keepdims=True))
                               / (want_std[:, None] + 1e-4), rtol=1e-5)
    centred, _ = advantages(jnp.asarray(r), scaled=False)
    np.testing.assert_allclose(centred, r - r.mean(1, keepdims=True))
    assert not np.asarray(scaled[1]).any()           # a group of equal rewards: no signal


def test_rewards_sum_their_functions_and_refuse_what_is_not_a_number():
    fns = grpo_rewards.reward_functions("exact_match, number,tests.test_grpo:ones")
    got = grpo_rewards.score(fns, ["1+1=", "2+2="], [" 2", "x", "4", "11"], ["2", "4"])
    # completions 0, 1 answer prompt 0 (answer 2); 2, 3 prompt 1 (answer 4)
    np.testing.assert_allclose(got, [1 + 1 + 0, 0 + 0 + 0, 1 + 1 + 0, 0 + 1 + 1])
    with pytest.raises(ValueError, match=r"grpo.reward='x' gave nan for the completion "
                                         r"'a' of the prompt 'p'"):
        grpo_rewards.score(grpo_rewards.reward_functions("tests.test_grpo:not_a_number"),
                           ["p"], ["a", "b"], ["c"], name="x")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        grpo_rewards.reward_functions("no_such_module:f")
    with pytest.raises(ValueError, match="has no function 'missing'"):
        grpo_rewards.reward_functions("tests.test_grpo:missing")


def _batch(prompts, answers, width=8):
    out = {}
    for side, texts in (("inputs", prompts), ("targets", answers)):
        tok = np.zeros((len(texts), width), np.int32)
        seg = np.zeros_like(tok)
        for i, t in enumerate(texts):
            ids = TOK.encode(t) + [TOK.eos_id]
            tok[i, :len(ids)], seg[i, :len(ids)] = ids, 1
        out[side], out[f"{side}_segmentation"] = tok, seg
        out[f"{side}_position"] = np.maximum(seg.cumsum(1) - 1, 0) * seg
    return {k: jnp.asarray(v) for k, v in out.items()}


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo"])
def test_the_gradient_equals_the_formula_on_the_completions_drawn(loss):
    cfg = models.get_config("gpt-tiny", vocab_size=TOK.vocab_size, max_len=24, d_model=32,
                            num_heads=2, mlp_dim=64, num_layers=1)
    model = models.build(cfg)
    params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    reference = jax.tree.map(lambda x: x + 0.02 * jnp.sin(jnp.arange(x.size).reshape(x.shape)
                                                          .astype(x.dtype)), params)
    settings = GrpoSettings(num_generations=3, max_new_tokens=5, beta=0.1, loss=loss,
                            reward="tests.test_grpo:spread", temperature=1.5)
    objective = Grpo(bos_id=int(cfg.bos_id), settings=settings, rewards=grpo_rewards.HostRewards(
        grpo_rewards.reward_functions(settings.reward), TOK, settings.reward))
    batch = _batch(["12+3=", "7+70="], ["15", "77"])
    task = objective.prepare(batch, key=jax.random.key(5), row_ids=jnp.arange(2))

    def ours(p):
        sums = objective.loss_sums(model, p, batch, task, dropout_rng=None, sample_rng=None,
                                   step=0, train=True, reference=reference)
        return sums["loss"], sums

    with jax.default_matmul_precision("highest"):
        (value, sums), grads = jax.jit(jax.value_and_grad(ours, has_aux=True))(params)
    # The same completions, drawn again; their rewards and advantages by hand.
    prompts, lengths = rollout_prompts(batch["inputs"], batch["inputs_segmentation"],
                                       int(cfg.bos_id))
    tokens, lens = map(np.asarray, draw(model, params, prompts, lengths, task["row_keys"],
                                        drawing=Drawing(candidates=3, temperature=1.5,
                                                        max_new_tokens=5)))
    texts = [[TOK.decode(tokens[b, g, :lens[b, g]].tolist()) for g in range(3)]
             for b in range(2)]
    r = np.array([spread(None, t, None) for t in texts], np.float32)
    assert (r.std(axis=1) > 0).all()                  # every group teaches something
    adv = r - r.mean(axis=1, keepdims=True)
    if loss == "grpo":
        adv = adv / (r.std(axis=1, ddof=1, keepdims=True) + 1e-4)
    np.testing.assert_allclose(float(sums["reward"]) / 6, r.mean(), rtol=1e-6)

    def formula(p):
        total = 0.0
        for b in range(2):
            prompt = [int(cfg.bos_id), *np.asarray(batch["inputs"][b, :int(lengths[b]) - 1])]
            for g in range(3):
                n = int(lens[b, g])
                ids = jnp.array([prompt + tokens[b, g, :n].tolist()])
                def logps(q, ids=ids, n=n):
                    lp = jax.nn.log_softmax(model.apply({"params": q}, ids[:, :-1]) / 1.5)
                    return jnp.take_along_axis(lp[0, -n:], ids[0, -n:, None], 1)[:, 0]
                lp, ref = logps(p), logps(reference)
                ratio = jnp.exp(lp - jax.lax.stop_gradient(lp))
                k3 = jnp.exp(ref - lp) - (ref - lp) - 1.0
                tok = -ratio * adv[b, g] + 0.1 * k3
                total += jnp.mean(tok) if loss == "grpo" else jnp.sum(tok) / 5
        return total

    with jax.default_matmul_precision("highest"):
        want_value, want = jax.value_and_grad(formula)(params)
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-4, atol=1e-6)
    chex.assert_trees_all_close(grads, want, atol=2e-6, rtol=1e-4)
    assert float(sums["kl"]) > 0 and float(sums["clip_fraction"]) == 0


@pytest.mark.parametrize("overrides,message", [
    ({"packing": True}, "packing=True must be False for dataset='addition_prompts'"),
    ({"grpo.num_generations": 1}, "grpo.num_generations=1"),
    ({"grpo.epsilon_high": 0.1}, "grpo.epsilon_high=0.1 must be >= grpo.epsilon=0.2"),
    ({"grpo.reward": "exact"}, "grpo.reward='exact'"),
    ({"grpo.loss": "ppo"}, "grpo.loss='ppo'"),
    ({"label_smoothing": 0.1}, "label_smoothing=0.1"),
])
def test_the_run_config_refuses_what_grpo_cannot_train(overrides, message):
    c = configs.get("finetune_grpo")
    c.update(dataset="addition_prompts", model="gpt-tiny")
    for k, v in overrides.items():
        node, _, leaf = k.rpartition(".")
        (c[node] if node else c)[leaf] = v
    with pytest.raises(ValueError, match=message):
        check_config(c)
    c = configs.get("copy")
    c.grpo.beta = 0.5
    with pytest.raises(ValueError, match=r"grpo.beta=0.5 is read with prompts data only"):
        check_config(c)


def test_prompt_files_name_their_bad_lines(tmp_path, data_dir):
    path = tmp_path / "problems.jsonl"
    path.write_text("\n".join([json.dumps({"prompt": "1+1=", "answer": "2"}), "{",
                               json.dumps({"prompt": "x"}),
                               json.dumps({"prompt": "2+2=", "answer": 4}),
                               json.dumps({"prompt": " ", "answer": "1"})] * 3) + "\n")
    ds = data_lib.load_dataset("local_prompts", data_dir, data_files=(str(path),))
    assert ds.kind == "prompts" and ds.bad_lines.total == 12
    assert ds.bad_lines.examples[:4] == [f"{path}:2: not JSON", f"{path}:3: no 'answer' field",
                                         f"{path}:4: 'answer' is not a string",
                                         f"{path}:5: empty 'prompt'"]


def test_a_reward_that_takes_fields_reads_each_prompt_lines_other_fields(tmp_path, data_dir):
    """Every field of a `local_prompts` line reaches a reward that takes `fields`, found by
    the prompt's pieces as the run encodes them; other rewards are called as before."""
    path = tmp_path / "problems.jsonl"
    lines = [{"prompt": "say 1", "answer": "1", "length": 1},
             {"prompt": "say 22", "answer": "22", "length": 2, "tests": ["x"]}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) * 20)   # repeats: one line
    ds = data_lib.load_dataset("local_prompts", data_dir, data_files=(str(path),))
    fns = grpo_rewards.reward_functions("tests.test_grpo:as_long_as_asked,exact_match")
    settings = ml_collections.ConfigDict({"grpo": GrpoSettings(), "label_smoothing": 0.0})
    cfg = models.get_config("gpt-tiny", vocab_size=TOK.vocab_size)
    objective = Grpo.build(cfg, TOK, settings, model_name="m", dataset=ds)
    assert objective.rewards.records == {}       # exact_match takes no fields
    settings.grpo = GrpoSettings(reward="tests.test_grpo:as_long_as_asked")
    objective = Grpo.build(cfg, TOK, settings, model_name="m", dataset=ds)
    assert objective.rewards.records == grpo.prompt_records(ds, TOK)
    rewards = grpo_rewards.HostRewards(fns, TOK, "r", grpo.prompt_records(ds, TOK))
    assert sorted(rewards.records.values(), key=lambda r: r["length"]) == lines
    batch = _batch(["say 1", "say 22"], ["1", "22"])
    completions = [TOK.encode(c) for c in ("1", "22", "3", "22")]   # two a prompt
    tokens = np.zeros((4, 4), np.int32)
    for m, ids in enumerate(completions):
        tokens[m, :len(ids)] = ids
    got = rewards(batch["inputs"], jnp.array([5, 6]), tokens, jnp.array([1, 2, 1, 2]),
                  batch["targets"], jnp.array([1, 2]))
    # as_long_as_asked + exact_match: "1" for "say 1" (1 + 1), "22" too (0 + 0: length 1
    # asked), "3" for "say 22" (0 + 0), "22" (1 + 1).
    np.testing.assert_allclose(got, [2, 0, 0, 2])
    # A prompt no line holds (cut to max_source_length) is named, not scored without it.
    with pytest.raises(ValueError, match=r"the prompt 'say' is no line of the data files"):
        rewards(batch["inputs"], jnp.array([3, 6]), tokens, jnp.array([1, 2, 1, 2]),
                batch["targets"], jnp.array([1, 2]))


def test_one_prompt_on_two_lines_with_different_fields_is_refused_naming_both(tmp_path):
    from train.data.local_files import read_prompt_records
    path = tmp_path / "problems.jsonl"
    path.write_text(json.dumps({"prompt": "p", "answer": "1"}) + "\n"
                    + json.dumps({"prompt": "q", "answer": "2"}) + "\n"
                    + json.dumps({"prompt": "p", "answer": "1", "hint": "h"}) + "\n")
    with pytest.raises(ValueError, match=rf"{path}:1 and {path}:3 hold the prompt 'p'"):
        read_prompt_records((str(path),))


# --- runs ----------------------------------------------------------------------------------


def _config(data_dir, model_dir, **overrides):
    c = configs.get("finetune_grpo")
    c.update(init_from=model_dir, dataset="addition_prompts", data_dir=data_dir,
             max_source_length=16, max_target_length=10, max_decode_length=16,
             per_device_batch_size=4, eval_per_device_batch_size=16, num_train_steps=20,
             learning_rate=2e-2, warmup_steps=1, log_every_steps=1,
             checkpoint_every_steps=10, eval_every_steps=1000)
    c.grpo.update(reward="tests.test_grpo:ones", max_new_tokens=6, beta=0.04)
    c.update(overrides)
    return c


@pytest.fixture(scope="module")
def byte_lm(tmp_path_factory):
    cfg = models.get_config("gpt-tiny", vocab_size=TOK.vocab_size, max_len=32, d_model=32,
                            num_heads=2, mlp_dim=64, num_layers=2, use_bias=False)
    model = models.build(cfg)
    params = model.init(jax.random.key(3), jnp.zeros((1, 8), jnp.int32))["params"]
    path = str(tmp_path_factory.mktemp("grpo_lm") / "model")
    models.save(path, cfg, params, tokenizer=TOK)
    return path


def _sigterm_at(k: int):
    return lambda step, metrics: step == k and os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.slow
def test_a_run_raises_its_reward_resumes_exactly_and_other_layouts_draw_what_pmap_does(
        byte_lm, data_dir, tmp_path):
    config = _config(data_dir, byte_lm)
    whole = str(tmp_path / "whole")
    summary = train_and_evaluate(config, whole)
    rows = train_metric_rows(whole)
    assert [r["step"] for r in rows] == list(range(1, 21))
    first, last = np.mean([r["reward"] for r in rows[:3]]), np.mean(
        [r["reward"] for r in rows[-3:]])
    assert last > first + 0.2, (first, last)
    for r in rows:
        assert r["completion_length"] <= 6 and r["kl"] >= 0 and r["clip_fraction"] == 0
        assert 0 <= r["zero_std_groups"] <= 1 and r["tokens"] == 16 * 4   # 16 prompts x G
    assert summary["validation"]["reward"] > 0.5                   # greedy, from near 0

    resumed = str(tmp_path / "resumed")
    stopped = train_and_evaluate(config, resumed, hooks=[_sigterm_at(9)])
    assert stopped["stopped_by"] == "SIGTERM" and stopped["step"] == 10
    again = train_and_evaluate(config, resumed)
    assert again["resumed_from_step"] == 10
    chex.assert_trees_all_equal(checkpoint.restore_model(resumed).params,
                                checkpoint.restore_model(whole).params)
    assert train_metric_rows(resumed) == rows

    # shard_map, and FSDP over the 4 devices (the rewards' callback given the whole
    # batch): the same completions, rewards and steps.
    for parallel in ("shard_map", "sharded"):
        other = str(tmp_path / parallel)
        train_and_evaluate(ml_collections.ConfigDict({**config.to_dict(),
                                                      "parallel": parallel}), other)
        for got, want in zip(train_metric_rows(other), rows, strict=True):
            for k in ("reward", "loss", "kl", "completion_length"):
                assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-5), (
                    parallel, got["step"], k)
