"""Evaluation across processes: each eval step is a collective over every device of every
process, so all processes must run the same number of them, also on text, where each
process cuts its own shard of the split into its own number of chunks.

Two processes x 2 fake CPU devices over gloo on localhost, as in test_train_loop; a run that
hangs is killed after `TIMEOUT_S` and fails the test.
"""

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np

from tests.train_helpers import tiny_train_config
from train import data
from train.data import pipeline as P
from train.trainer import train_and_evaluate

TESTS = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_S = 150          # both processes together; a normal run takes well under a minute


def _text_files(tmp_path) -> str:
    """local_text with three files: train, validation, test. The validation split has one
    long line and one short one, so whichever order TFDS gives them, one process's shard is
    cut into 19 chunks of 16 tokens (bytes and EOS) and the other's into 1."""
    files = {
        "train.txt": "".join(f"the cat {i} sat on the mat {i % 7} times\n" for i in range(64)),
        "validation.txt": "a long line, " * 23 + "\nshort line\n",       # 299 bytes
        "test.txt": "a test line\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return ",".join(str(tmp_path / name) for name in files)


def _overrides(data_files: str) -> dict:
    return dict(model="gpt-tiny", model_overrides=dict(d_model=32, num_heads=2, head_dim=16,
                                                       mlp_dim=64, num_layers=1,
                                                       use_bias=False),
                dataset="local_text", data_files=data_files, tokenizer="byte",
                max_source_length=16, max_target_length=16, label_smoothing=0.0,
                per_device_batch_size=2, eval_per_device_batch_size=2, num_train_steps=4,
                eval_every_steps=2, checkpoint_every_steps=1000, warmup_steps=1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run_two_processes(workdir: str, data_dir: str, settings: dict) -> list[dict]:
    """Both workers' summaries; kills both and fails if they are not done in TIMEOUT_S."""
    common = dict(settings, distributed=True, num_processes=2,
                  coordinator_address=f"localhost:{_free_port()}")
    procs = [subprocess.Popen(
        [sys.executable, os.path.join(TESTS, "train_worker.py"), workdir, data_dir, "2"]
        + [f"{k}={json.dumps(v)}" for k, v in dict(common, process_id=i).items()],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        cwd=os.path.dirname(TESTS)) for i in range(2)]
    deadline = time.monotonic() + TIMEOUT_S
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        outs += [p.communicate()[0] for p in procs[len(outs):]]
        raise AssertionError(f"the two processes did not finish in {TIMEOUT_S} s (hung in a "
                             "collective?); their output ends:\n"
                             + "\n---\n".join(out[-1500:] for out in outs)) from None
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    return [json.loads(out.rsplit("SUMMARY ", 1)[1]) for out in outs]


def test_two_processes_evaluate_text_shards_of_unequal_chunk_counts(data_dir, tmp_path):
    """Evaluations at steps 2 and 4 on two processes whose validation shards have 19 and 1
    chunks (5 and 1 local batches of 4 rows): both finish, and the validation loss (summed
    over both shards, padding rows counting for nothing) is the loss one process with 4
    devices computes over the whole split."""
    files = _text_files(tmp_path)
    settings = _overrides(files)
    ds = data.load_dataset("local_text", data_dir, data_files=tuple(files.split(",")))
    chunks = sorted(len(P.select_items(P.tokenize_split(ds, "validation", data.ByteTokenizer(),
                                                        shard_index=i, shard_count=2),
                                       "text", (16,), "drop")[0]) for i in range(2))
    assert chunks == [1, 19], "the shards must need different numbers of eval batches"

    workdir = tmp_path / "two"
    two = _run_two_processes(str(workdir), data_dir, settings)
    assert [s["step"] for s in two] == [4, 4]
    assert two[0]["validation"] == two[1]["validation"]
    assert two[0]["validation"]["tokens"] == 300 + 11       # every chunk once, padding none
    with open(workdir / "metrics.jsonl") as f:
        assert [r["step"] for r in map(json.loads, f) if r["split"] == "eval"] == [2, 4]

    one = train_and_evaluate(tiny_train_config(data_dir, **settings), str(tmp_path / "one"))
    np.testing.assert_allclose(two[0]["validation"]["loss"], one["validation"]["loss"],
                               rtol=1e-5)
