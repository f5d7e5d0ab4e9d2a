"""Preference training (`train.objectives.preference`, `finetune_dpo`): the DPO, IPO and
SimPO losses against their formulas on transformers' log-probabilities, the gradient
against the formula on each pair scored alone, log 2 at step 0, pairs that never swap
through the pipeline, the `dpo.*` keys' refusals, device splits equal to one device, and
runs with LoRA (the base as the reference) and in full (a kept copy) that learn, export
and resume exactly."""

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
from tests.train_helpers import tiny_train_config, train_metric_rows
from train import checkpoint, configs, data as data_lib, parallel, state as state_lib
from train.objectives.preference import Preference, joined_rows
from train.objectives.preference_settings import PreferenceSettings
from train.run_config import RunConfig, check_config
from train.settings import ObjectiveSettings
from train.state import make_optimizer
from train.step import Steps, summarise
from train.trainer import train_and_evaluate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LOG2 = float(np.log(2.0))


def _row(ids, width):
    tok, seg = np.zeros(width, np.int32), np.zeros(width, np.int32)
    tok[:len(ids)], seg[:len(ids)] = ids, 1
    return tok, seg


def _batch(triples, widths=(7, 6, 6)):
    """A batch of (prompt, chosen, rejected) id lists, each side ending in EOS (1) as the
    pipeline ends it; rows past the triples are empty."""
    out = {}
    for side, width, at in zip(("inputs", "targets", "rejected"), widths, range(3),
                               strict=True):
        rows = [_row(list(t[at]) + [1], width) for t in triples]
        out[side] = np.stack([r[0] for r in rows])
        out[f"{side}_segmentation"] = np.stack([r[1] for r in rows])
        out[f"{side}_position"] = out[f"{side}_segmentation"].cumsum(1) - 1
    return {k: jnp.asarray(v) for k, v in out.items()}


TRIPLES = [([5, 6, 7], [8, 9], [10]), ([11], [12, 13, 14, 15], [16, 17]),
           ([18, 19, 20, 21, 22], [23], [24, 25, 26])]


@pytest.fixture(scope="module")
def gpt2_pair(tmp_path_factory):
    """A tiny random GPT-2 (the reference) and a perturbed copy (the policy), each saved by
    transformers and loaded by `models.load`: (hf reference, hf policy, ours ref, ours
    policy)."""
    root = tmp_path_factory.mktemp("dpo_gpt2")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=40, n_positions=32, n_embd=32, n_layer=2,
                                  n_head=2, bos_token_id=2, eos_token_id=1)
    ref = transformers.GPT2LMHeadModel(cfg).eval()
    policy = transformers.GPT2LMHeadModel(cfg).eval()
    policy.load_state_dict(ref.state_dict())
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ref.save_pretrained(root / "ref")
    policy.save_pretrained(root / "policy")
    return ref, policy, models.load(str(root / "ref")), models.load(str(root / "policy"))


def _hf_logps(hf, bos, prompt, response):
    """transformers' summed log-prob of `response` (+ EOS 1) behind BOS and the prompt."""
    ids = [bos, *prompt, *response, 1]
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1).numpy()
    start = 1 + len(prompt)
    return sum(logp[t - 1, ids[t]] for t in range(start, len(ids))), len(ids) - start


def _formula(loss, beta, gamma, c, r, rc, rr, nc, nr):
    if loss == "sigmoid":
        return np.logaddexp(0.0, -beta * ((c - rc) - (r - rr)))
    if loss == "ipo":
        return ((c - rc) / nc - (r - rr) / nr - 1 / (2 * beta)) ** 2
    return np.logaddexp(0.0, -(beta * (c / nc - r / nr) - gamma))


def _objective(**dpo):
    return Preference(bos_id=2, settings=PreferenceSettings(**dpo))


def _sums(objective, pre, params, batch, reference):
    task = objective.prepare(batch, key=None, row_ids=None)
    with jax.default_matmul_precision("highest"):
        return objective.loss_sums(pre.model, params, batch, task, dropout_rng=None,
                                   sample_rng=None, step=0, train=True, reference=reference)


@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "simpo"])
def test_each_loss_equals_its_formula_on_transformers_log_probs(gpt2_pair, loss):
    hf_ref, hf_policy, ref, policy = gpt2_pair
    beta, gamma = 0.5, 0.3
    objective = _objective(loss=loss, beta=beta, simpo_gamma=gamma)
    batch = _batch(TRIPLES)
    sums = jax.jit(lambda p, r, b: _sums(objective, policy, p, b, r))(
        policy.params, ref.params, batch)
    want, margins = [], []
    for prompt, chosen, rejected in TRIPLES:
        c, nc = _hf_logps(hf_policy, 2, prompt, chosen)
        r, nr = _hf_logps(hf_policy, 2, prompt, rejected)
        rc, _ = _hf_logps(hf_ref, 2, prompt, chosen)
        rr, _ = _hf_logps(hf_ref, 2, prompt, rejected)
        want.append(_formula(loss, beta, gamma, c, r, rc, rr, nc, nr))
        margins.append((c - rc) - (r - rr) if loss == "sigmoid" else None)
    assert float(sums["weight"]) == 3
    np.testing.assert_allclose(float(sums["loss"]), sum(want), rtol=2e-5, atol=1e-6)
    if loss == "sigmoid":
        np.testing.assert_allclose(float(sums["reward_margin"]), beta * sum(margins),
                                   rtol=2e-5, atol=1e-6)


def test_the_gradient_equals_the_formulas_on_each_pair_scored_alone(gpt2_pair):
    """Joined, padded and batched rows give the gradient of the loss computed from each
    sequence run through the model on its own, unpadded."""
    _, _, ref, policy = gpt2_pair
    objective = _objective(loss="sigmoid", beta=0.5)
    batch = _batch(TRIPLES)

    def ours(params):
        return _sums(objective, policy, params, batch, ref.params)["loss"]

    def alone(params):
        def logp(p, prompt, response):
            ids = jnp.array([[2, *prompt, *response, 1]])
            lp = jax.nn.log_softmax(policy.model.apply({"params": p}, ids[:, :-1]))
            n = len(response) + 1
            return jnp.sum(jnp.take_along_axis(lp[0, -n:], ids[0, -n:, None], 1))
        total = 0.0
        for prompt, chosen, rejected in TRIPLES:
            c, r = logp(params, prompt, chosen), logp(params, prompt, rejected)
            rc, rr = logp(ref.params, prompt, chosen), logp(ref.params, prompt, rejected)
            total += jax.nn.softplus(-0.5 * ((c - rc) - (r - rr)))
        return total

    with jax.default_matmul_precision("highest"):
        got, want = jax.jit(jax.grad(ours))(policy.params), jax.jit(jax.grad(alone))(
            policy.params)
    chex.assert_trees_all_close(got, want, atol=2e-6, rtol=1e-4)


def test_at_step_0_the_loss_is_log_2_and_swapped_pairs_flip_their_rewards(gpt2_pair):
    _, _, ref, policy = gpt2_pair
    objective = _objective()
    batch = _batch(TRIPLES)
    # The policy is its reference: full fine-tuning's copy, or an adapted model's base.
    same = _sums(objective, ref, ref.params, batch, ref.params)
    assert float(same["loss"]) / 3 == pytest.approx(LOG2, abs=1e-6)
    assert float(same["reward_margin"]) == 0 and float(same["correct"]) == 0
    cfg = ref.config.replace(lora=models.LoraConfig(rank=2, alpha=4, targets=("query",)))
    adapted = models.build(cfg).init(jax.random.key(0), batch["targets"])["params"]
    base, adapters = models.lora.split(adapted)
    base = models.lora.join(models.lora.split(ref.params)[0], adapters)
    lora_objective = Preference(bos_id=2, adapted=True)
    model = models.build(cfg)
    task = lora_objective.prepare(batch, key=None, row_ids=None)
    with jax.default_matmul_precision("highest"):
        at_start = lora_objective.loss_sums(model, base, batch, task, dropout_rng=None,
                                            sample_rng=None, step=0, train=True)
    assert float(at_start["loss"]) / 3 == pytest.approx(LOG2, abs=1e-6)

    # Chosen and rejected swapped in the data: each reward moves to the other side.
    a = _sums(objective, policy, policy.params, batch, ref.params)
    swapped = dict(batch)
    for k in ("", "_segmentation", "_position"):
        swapped[f"targets{k}"], swapped[f"rejected{k}"] = batch[f"rejected{k}"], batch[
            f"targets{k}"]
    b = _sums(objective, policy, policy.params, swapped, ref.params)
    np.testing.assert_allclose(float(a["reward_chosen"]), float(b["reward_rejected"]),
                               rtol=1e-5)
    np.testing.assert_allclose(float(a["reward_margin"]), -float(b["reward_margin"]),
                               rtol=1e-5)
    assert float(a["correct"]) + float(b["correct"]) == 3


def test_joined_rows_put_each_response_behind_its_prompt():
    batch = _batch(TRIPLES)
    tokens, scored, real = map(np.asarray, joined_rows(
        batch["inputs"], batch["inputs_segmentation"], batch["targets"],
        batch["targets_segmentation"]))
    assert tokens.shape == (3, 7 - 1 + 6)
    for row, (prompt, chosen, _) in enumerate(TRIPLES):
        n = len(prompt) + len(chosen) + 1
        assert tokens[row].tolist() == [*prompt, *chosen, 1] + [0] * (12 - n)
        assert scored[row].tolist() == [0] * len(prompt) + [1] * (len(chosen) + 1) + [0] * (
            12 - n)
        assert real[row].tolist() == [1] * n + [0] * (12 - n)


# --- the data ---------------------------------------------------------------------------------


def _pairs_file(path, n=40, bad=True):
    """Prompts "qNN", chosen "yes NN", rejected "no NN", with some bad lines among them."""
    lines = [json.dumps({"prompt": f"q{i:02d}", "chosen": f" yes {i:02d}",
                         "rejected": f" no {i:02d}"}) for i in range(n)]
    if bad:
        lines[3:3] = ["{not json", json.dumps({"prompt": "x", "chosen": "y"}),
                      json.dumps({"prompt": "x", "chosen": "same", "rejected": "same"}),
                      json.dumps({"prompt": "x", "chosen": 3, "rejected": "z"}), ""]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_pairs_from_a_jsonl_file_keep_each_chosen_with_its_rejected(tmp_path, data_dir):
    files = (_pairs_file(tmp_path / "pairs.jsonl"),)
    ds = data_lib.load_dataset("local_preference", data_dir, data_files=files)
    assert ds.kind == "preference" and ds.bad_lines.total == 5
    assert set(ds.bad_lines.counts) == {"not JSON", "no 'rejected' field",
                                        "chosen equals rejected", "'chosen' is not a string",
                                        "blank line"}
    assert ds.bad_lines.examples[0] == f"{files[0]}:4: not JSON"
    tok = ByteTokenizer()
    cfg = data_lib.PipelineConfig(per_device_batch_size=4, max_source_length=8,
                                  max_target_length=10, packing=False)
    source, stats = data_lib.train_source(ds, tok, cfg, num_devices=2, shard_index=0,
                                          shard_count=1)
    seen = 0
    for batch in (source[i] for i in range(3)):
        flat = {k: np.asarray(v).reshape(-1, np.asarray(v).shape[-1]) for k, v in
                batch.items()}
        for side, word in (("targets", "yes"), ("rejected", "no")):
            tokens, scored, _ = map(np.asarray, joined_rows(
                flat["inputs"], flat["inputs_segmentation"], flat[side],
                flat[f"{side}_segmentation"]))
            for row in range(tokens.shape[0]):
                text = tok.decode([int(t) for t in tokens[row] if t > 2])
                prompt, _, response = text.partition(" ")
                assert prompt.startswith("q") and response == f"{word} {prompt[1:]}"
                said = tok.decode([int(t) for t, s in zip(tokens[row], scored[row],
                                                          strict=True) if s and t > 2])
                assert said == f" {word} {prompt[1:]}"
                seen += 1
    assert seen == 2 * 3 * 8


@pytest.mark.parametrize("overrides,key", [
    ({"packing": True}, "packing=True"),
    ({"dpo.beta": 0.0}, "dpo.beta=0.0"),
    ({"dpo.loss": "kto"}, "dpo.loss='kto'"),
    ({"label_smoothing": 0.1}, "label_smoothing=0.1"),
])
def test_the_run_config_refuses_what_preference_training_cannot_train(overrides, key):
    c = _dpo_config("", "", dataset="addition_preference", model="gpt-tiny")
    for k, v in overrides.items():
        node, _, leaf = k.rpartition(".")
        (c[node] if node else c)[leaf] = v
    with pytest.raises(ValueError, match=key.replace("(", r"\(")):
        check_config(c)


def test_dpo_keys_with_other_data_and_preference_data_for_an_encoder_decoder_are_refused():
    c = configs.get("copy")
    c.dpo.beta = 0.2
    with pytest.raises(ValueError, match=r"dpo.beta=0.2 is read with preference data "
                                         r"only .* not dataset='copy'"):
        check_config(c)
    c = configs.get("copy")
    c.update(dataset="addition_preference", packing=False, label_smoothing=0.0)
    with pytest.raises(ValueError, match=r"preference needs a decoder-only model"):
        check_config(c)


# --- device splits ---------------------------------------------------------------------------


def _steps_and_state(pre, **dpo):
    objective = Preference(bos_id=2, settings=PreferenceSettings(**dpo))
    run = RunConfig.from_config(tiny_train_config("", adam_eps=1e-6, learning_rate=1e-2))
    tx, schedule = make_optimizer(run.optimizer, run.loop.num_train_steps)
    state = state_lib.TrainState.create(pre.params, tx, 0, reference=True)
    return Steps(pre.model, objective, schedule), state


def _random_batch(seed, rows):
    r = np.random.default_rng(seed)
    return _batch([([int(x) for x in r.integers(3, 40, r.integers(1, 6))],
                    [int(x) for x in r.integers(3, 40, r.integers(1, 5))],
                    [int(x) for x in r.integers(3, 40, r.integers(1, 5))])
                   for _ in range(rows)])


def _first_replica(tree):
    return jax.tree.map(lambda x: np.asarray(x)[0], tree)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["pmap", "shard_map"])
def test_four_devices_train_what_one_device_does(gpt2_pair, kind):
    """Three steps of 8 pairs with the reference copy in the state, over 4 devices and on
    one: the same metrics and parameters (and the reference never moves)."""
    _, _, ref, _ = gpt2_pair
    batches = [_random_batch(s, 8) for s in range(3)]
    runs = {}
    for devices in (1, 4):
        steps, state = _steps_and_state(ref)
        train_fn, eval_fn = steps.functions()
        dp = parallel.DataParallel(kind, train_fn, eval_fn)
        if devices == 1:
            one = jax.pmap(train_fn, axis_name="batch", devices=jax.devices()[:1])
            s, step = parallel.replicate(state, jax.devices()[:1]), one
            metrics = _first_replica
        else:
            s, step, metrics = dp.put_state(state), dp.train_step, dp.metrics
        logged = []
        for b in batches:
            s, m = step(s, {k: np.asarray(x).reshape(devices, -1, x.shape[-1])
                            for k, x in b.items()})
            logged.append(summarise(metrics(m)))
        host = _first_replica(s) if devices == 1 else dp.host_state(s)
        runs[devices] = host, logged
    (one, one_logs), (four, four_logs) = runs[1], runs[4]
    assert one_logs[0]["loss"] == pytest.approx(LOG2, abs=1e-6)
    for a, b in zip(one_logs, four_logs, strict=True):
        for k in ("loss", "accuracy", "reward_margin", "logps_chosen"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k
    chex.assert_trees_all_close(one.params, four.params, atol=1e-5)
    chex.assert_trees_all_equal(one.reference, ref.params)
    assert one_logs[-1]["loss"] < LOG2


# --- runs ----------------------------------------------------------------------------------


def _dpo_config(data_dir, model_dir, files="", **overrides):
    c = configs.get("finetune_dpo")
    c.update(init_from=model_dir, data_dir=data_dir, data_files=files,
             max_source_length=8, max_target_length=10, max_decode_length=16,
             per_device_batch_size=2,
             eval_per_device_batch_size=4, num_train_steps=8, learning_rate=3e-3,
             warmup_steps=1, lr_decay="constant", log_every_steps=1,
             checkpoint_every_steps=4, eval_every_steps=1000)
    c.update(overrides)
    return c


@pytest.fixture(scope="module")
def byte_gpt2(tmp_path_factory):
    """A tiny random GPT-2-like model over bytes (the project's byte tokenizer's ids),
    saved as a model directory: (its directory, a pairs file). No biases: a key bias has a
    zero gradient, whose rounding noise adam turns into updates that differ between
    device layouts (see `tiny_train_config`)."""
    root = tmp_path_factory.mktemp("dpo_run")
    cfg = models.get_config("gpt-tiny", vocab_size=ByteTokenizer().vocab_size, max_len=32,
                            d_model=32, num_heads=2, mlp_dim=64, num_layers=2,
                            use_bias=False)
    model = models.build(cfg)
    params = model.init(jax.random.key(7), jnp.zeros((1, 8), jnp.int32))["params"]
    models.save(str(root / "model"), cfg, params, tokenizer=ByteTokenizer())
    return str(root / "model"), _pairs_file(root / "pairs.jsonl", n=200, bad=False)


def _accuracy(pre, base, pairs_path, n=24):
    """The share of the file's first `n` pairs that `pre` prefers against `base` as the
    run's loss compares them (the chosen response's log-ratio above the rejected one's)."""
    tok = ByteTokenizer()
    with open(pairs_path) as f:
        triples = [json.loads(line) for line in f][:n]
    batch = _batch([(tok.encode(t["prompt"]), tok.encode(t["chosen"]),
                     tok.encode(t["rejected"])) for t in triples], widths=(8, 10, 10))
    adapted = pre.config.lora is not None
    objective = Preference(bos_id=int(pre.config.bos_id), adapted=adapted)
    sums = _sums(objective, pre, pre.params, batch, None if adapted else base.params)
    return float(sums["correct"]) / n


def _sigterm_at(k: int):
    return lambda step, metrics: step == k and os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [0, 4], ids=["full", "lora"])
def test_a_run_learns_the_preference_exports_and_resumes_exactly(byte_gpt2, data_dir, lora,
                                                                   tmp_path):
    model_dir, pairs = byte_gpt2
    config = _dpo_config(data_dir, model_dir, pairs, eval_every_steps=8)
    config.dpo.beta = 1.0
    if lora:
        config.lora.update(rank=lora, alpha=2.0 * lora, targets="query,value,up")
    before = train_and_evaluate(ml_collections.ConfigDict(
        {**config.to_dict(), "num_train_steps": 0}), str(tmp_path / "zero"))["validation"]
    assert before["loss"] == pytest.approx(LOG2, abs=1e-6)
    whole = str(tmp_path / "whole")
    summary = train_and_evaluate(config, whole)
    after = summary["validation"]
    assert after["accuracy"] >= 0.9 and after["reward_margin"] > 0 and after["loss"] < LOG2 - 0.1
    rows = train_metric_rows(whole)
    assert [r["step"] for r in rows] == list(range(1, 9))
    # The export: PEFT adapters over the directory named in them, or the whole model in
    # the directory's own type; either scores the validation pairs as the run did.
    export = os.path.join(whole, "adapter") if lora else summary["model"]
    assert os.path.isfile(os.path.join(export, "adapter_config.json")) == bool(lora)
    exported = models.load(export)
    assert exported.model_type == models.load(model_dir).model_type
    base = models.load(model_dir)
    assert _accuracy(exported, base, pairs) >= 0.9
    assert _accuracy(base, base, pairs) == 0                  # every pair a tie

    resumed = str(tmp_path / "resumed")
    first = train_and_evaluate(config, resumed, hooks=[_sigterm_at(3)])
    assert first["stopped_by"] == "SIGTERM" and first["step"] == 4
    second = train_and_evaluate(config, resumed)
    assert second["resumed_from_step"] == 4 and second["step"] == 8
    chex.assert_trees_all_equal(checkpoint.restore_model(resumed).params,
                                checkpoint.restore_model(whole).params)
    assert train_metric_rows(resumed) == rows
    if lora:
        return
    # FSDP over the 4 devices, the reference copy sharded like the parameters it copies.
    sharded = str(tmp_path / "sharded")
    train_and_evaluate(ml_collections.ConfigDict({**config.to_dict(), "parallel": "sharded"}),
                       sharded)
    for got, want in zip(train_metric_rows(sharded), rows, strict=True):
        for k in ("loss", "reward_margin", "accuracy"):
            assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), (got["step"], k)
    chex.assert_trees_all_close(checkpoint.restore_model(sharded).params,
                                checkpoint.restore_model(whole).params, atol=1e-5)


def test_the_settings_default_to_dpo():
    s = ObjectiveSettings()
    assert s.dpo.loss == "sigmoid" and s.dpo.beta == 0.1 and s.dpo.needs_reference
    assert not PreferenceSettings(loss="simpo").needs_reference
