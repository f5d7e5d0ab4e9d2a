"""Evaluation across processes: each eval step is a collective over every device of every
process, so all processes must run the same number of them, also on text, where each
process cuts its own shard of the split into its own number of chunks, and on translation
shards of unequal usable examples. Processes that read different data stop together with
one error; decoding (each process on its own first device) is not a collective.

Two processes x 2 fake CPU devices over gloo on localhost, as in test_train_loop; a run that
hangs is killed after `TIMEOUT_S` and fails the test.
"""

import json
import os
import re
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.train_helpers import tiny_train_config
from train import data
from train.data import kinds, pipeline as P
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
    return [json.loads(out.rsplit("SUMMARY ", 1)[1]) for out in _communicate(procs)]


def _communicate(procs: list[subprocess.Popen]) -> list[str]:
    """The processes' outputs once all exit 0; kills them all and fails after TIMEOUT_S."""
    deadline = time.monotonic() + TIMEOUT_S
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        outs += [p.communicate()[0] for p in procs[len(outs):]]
        raise AssertionError(f"the processes did not finish in {TIMEOUT_S} s (hung in a "
                             "collective?); their output ends:\n"
                             + "\n---\n".join(out[-1500:] for out in outs)) from None
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    return outs


@pytest.mark.slow
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
                                       kinds.TEXT, (16,), "drop")[0]) for i in range(2))
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


# ---------------------------------------------------------------------------------------------
# Uneven shards, different data, and decoding on one process more than on the other.

def _write_translation(tmp_path, validation: list[str]) -> str:
    (tmp_path / "train.tsv").write_text("".join(f"w{i} x\ty{i} z\n" for i in range(8)))
    (tmp_path / "validation.tsv").write_text("".join(f"{s}\n" for s in validation))
    (tmp_path / "test.tsv").write_text("a b\tc d\n")
    return ",".join(str(tmp_path / f"{n}.tsv") for n in ("train", "validation", "test"))


def _eval_worker(process_id: str, address: str, data_dir: str, files: str, other: str) -> None:
    """One process of `test_two_processes_with_uneven_shards_take_the_same_collective_steps`
    (run with `python -c`); prints `RESULT {...}` last."""
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(address, num_processes=2, process_id=int(process_id))
    import models
    from tests.train_helpers import next_token_steps
    from train import evaluate, parallel
    pid, tok = jax.process_index(), data.ByteTokenizer()
    config = tiny_train_config(data_dir)
    model = models.build(models.get_config(
        "transformer-tiny", vocab_size=tok.vocab_size, d_model=32, num_heads=2, mlp_dim=64,
        num_encoder_layers=1, num_decoder_layers=1, max_len=16))
    src = np.ones((1, 12), np.int32)
    params = model.init(jax.random.key(0), src, src)["params"]
    dp = parallel.DataParallel("pmap", *next_token_steps(model, config)[0].functions())
    replicated = parallel.replicate(params, jax.local_devices())
    cfg = data.PipelineConfig(per_device_batch_size=1, max_source_length=12,
                              max_target_length=12)
    ds = data.load_dataset("local_translation", data_dir, data_files=tuple(files.split(",")))
    result = {}
    # 1. Process 1 reads other data (a validation file one line shorter). Before, each
    #    process planned its own number of eval steps and the collectives hung.
    mine = ds if pid == 0 else data.load_dataset("local_translation", data_dir,
                                                 data_files=tuple(other.split(",")))
    try:
        batches, _ = data.eval_batches(mine, tok, cfg, "validation")
        result["mismatch"] = f"no error: {len(batches)} batches"
        evaluate.loss_metrics(dp, replicated, batches)
    except ValueError as e:
        result["mismatch"] = str(e)
    # 2. The same data, unevenly shared: the long example is dropped from one shard only.
    batches, stats = data.eval_batches(ds, tok, cfg, "validation")
    result.update(batches=len(batches), kept=stats.kept,
                  loss=evaluate.loss_metrics(dp, replicated, batches))
    # 3. Decoding runs on each process's own first device, no collective: three greedy
    #    batches and a beam-search one here, one greedy batch there, then a collective again.
    sources = [s for s, _ in ds.examples("validation", range(len(ds.split("validation"))))]
    sources = sources if pid == 0 else sources[:1]
    hyps = evaluate.translate(model, params, tok, sources, max_source_length=12,
                              max_new_tokens=3, batch_size=2)
    if pid == 0:
        hyps += evaluate.translate(model, params, tok, sources[:2], max_source_length=12,
                                   max_new_tokens=3, beam_size=2, batch_size=2)
    result.update(decoded=len(hyps), again=evaluate.loss_metrics(dp, replicated, batches))
    print("RESULT " + json.dumps(result, default=float), flush=True)


@pytest.mark.slow
def test_two_processes_with_uneven_shards_take_the_same_collective_steps(data_dir, tmp_path):
    """Two processes x 2 devices: (1) processes whose validation data differ both stop with
    one error naming each one's data (before: different numbers of eval steps, a hang);
    (2) shards with 3 and 1 usable examples (2 and 1 local batches) take the same eval steps,
    and the loss counts every kept token once; (3) decoding 3 greedy batches and a beam
    search one on one process and 1 greedy batch on the other (no collective) is followed by
    an evaluation that both finish, with the same loss."""
    # TFDS stores these lines in the order 4, 1, 5, 3, 2: shard 0 gets lines 4, 5, 2, and
    # shard 1 lines 1 (too long: dropped) and 3.
    pairs = ["r " * 20 + "\ts t", "a b\tc d", "e f\tg h", "i j k\tl m", "n o\tp q"]
    (tmp_path / "same").mkdir()
    (tmp_path / "other").mkdir()
    files = _write_translation(tmp_path / "same", pairs)
    other = _write_translation(tmp_path / "other", pairs[1:])
    tok = data.ByteTokenizer()
    ds = data.load_dataset("local_translation", data_dir, data_files=tuple(files.split(",")))
    data.load_dataset("local_translation", data_dir, data_files=tuple(other.split(",")))
    kept = [len(P.select_items(P.tokenize_split(ds, "validation", tok, shard_index=i,
                                                shard_count=2), kinds.TRANSLATION, (12, 12),
                               "drop")[0]) for i in range(2)]
    assert kept == [3, 1], "the shards must need different numbers of batches"
    tokens = sum(len(tok.encode(t)) + 1 for s, t in ds.examples("validation", range(5))
                 if len(tok.encode(s)) < 12)

    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
               .replace("--xla_force_host_platform_device_count=4",
                        "--xla_force_host_platform_device_count=2"))
    address = f"localhost:{_free_port()}"
    code = ("import sys; from tests.test_multihost_eval import _eval_worker; "
            "_eval_worker(*sys.argv[1:])")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(i), address, data_dir, files,
                               other], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, cwd=os.path.dirname(TESTS), env=env) for i in range(2)]
    results = [json.loads(out.rsplit("RESULT ", 1)[1]) for out in _communicate(procs)]
    mismatch = results[0]["mismatch"]
    assert results[1]["mismatch"] == mismatch
    assert re.fullmatch(r"the processes read different data for split 'validation' of "
                        r"'local_translation' \(process 0: 5 examples, digest [0-9a-f]{16}; "
                        r"process 1: 4 examples, digest [0-9a-f]{16}\); every process must "
                        r"read the same files \(data_files, data_dir\) with the same "
                        r"tokenizer", mismatch), mismatch
    assert [r["batches"] for r in results] == [2, 2]
    assert [r["kept"] for r in results] == [3, 1]
    assert results[0]["loss"] == results[1]["loss"] == results[0]["again"] == results[1]["again"]
    assert results[0]["loss"]["tokens"] == tokens
    assert [r["decoded"] for r in results] == [5 + 2, 1]
