"""Shared by the training tests: a tiny config on the built-in `copy` task, cheap enough for
many runs; the straight run every interrupted run must reproduce; training workers in fresh
interpreters (tests/train_worker.py)."""

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile

from train import configs

TESTS = os.path.dirname(os.path.abspath(__file__))


def next_token_steps(model, config):
    """(`train.step.Steps`, optimiser) for `model` trained with next-token prediction as a
    run of `config` (an ml_collections config) trains it."""
    from train.objectives import NextToken
    from train.run_config import RunConfig
    from train.state import make_optimizer
    from train.step import Steps
    run = RunConfig.from_config(config)
    tx, schedule = make_optimizer(run.optimizer, run.loop.num_train_steps)
    objective = NextToken.build(model.config, None, run.objective, model_name="test")
    return Steps(model, objective, schedule, run.optimizer.grad_accum_steps), tx


def tiny_train_config(data_dir: str, **overrides):
    c = configs.get("copy")
    c.data_dir = data_dir
    # No biases: a key bias has a mathematically zero gradient (softmax ignores it), and
    # adam turns the rounding noise it gets instead into full-size updates, which differ
    # with the order of the device sums; runs on different topologies are compared here.
    c.model_overrides.update(d_model=32, num_heads=2, mlp_dim=64, num_encoder_layers=1,
                             num_decoder_layers=1, use_bias=False)
    c.update(max_source_length=24, max_target_length=24, max_decode_length=8,
             per_device_batch_size=2, eval_per_device_batch_size=250, num_train_steps=6,
             warmup_steps=2, log_every_steps=1, checkpoint_every_steps=3,
             eval_every_steps=1000, num_eval_decode=0, num_test_decode=0, beam_size=2,
             keep_checkpoints=5)
    for k, v in overrides.items():
        c[k] = v
    return c


@functools.cache
def straight_run(data_dir: str) -> tuple[str, dict]:
    """`tiny_train_config` trained 6 steps in one go, once per test process (test modules
    share it through this cache): (workdir, summary). Tests copy it; they never write in it.
    """
    from train.trainer import train_and_evaluate
    workdir = tempfile.mkdtemp(prefix="straight-", dir=os.path.dirname(data_dir))
    return workdir, train_and_evaluate(tiny_train_config(data_dir), workdir)


def train_metric_rows(workdir: str) -> list[dict]:
    """metrics.jsonl's train rows in file order, without the wall-clock rate."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [{k: v for k, v in r.items() if k != "tokens_per_s"}
            for r in rows if r["split"] == "train"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def worker(workdir: str, data_dir: str, devices: int, **settings) -> subprocess.Popen:
    """tests/train_worker.py in a fresh interpreter (stdout and stderr together, as text)."""
    args = [sys.executable, os.path.join(TESTS, "train_worker.py"), workdir, data_dir,
            str(devices)] + [f"{k}={json.dumps(v)}" for k, v in settings.items()]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=os.path.dirname(TESTS))


def worker_summary(proc: subprocess.Popen, timeout: float = 300) -> dict:
    """The summary a worker printed; fails with its output unless it exited with 0."""
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-3000:]
    return json.loads(out.rsplit("SUMMARY ", 1)[1])


def worker_killed(proc: subprocess.Popen, timeout: float = 300) -> str:
    """The output of a worker that must have died by SIGKILL."""
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, out[-3000:])
    return out


def assert_split_encoded_as(ds, split: str, tokenizer, hf_tokenizer) -> dict:
    """`split` of a translation dataset tokenised by the run's `tokenizer` equals
    transformers' `hf_tokenizer(sources, text_target=targets)` example for example (both
    sides); returns transformers' encoding."""
    from train.data import tokenize_split
    data = tokenize_split(ds, split, tokenizer)
    pairs = ds.examples(split, data.example_ids)
    want = hf_tokenizer([s for s, _ in pairs], text_target=[t for _, t in pairs])
    for side, key in ((0, "input_ids"), (1, "labels")):
        got = [data.tokens[side][a:b].tolist()
               for a, b in zip(data.offsets[side][:-1], data.offsets[side][1:], strict=True)]
        assert got == want[key], key
    return want
