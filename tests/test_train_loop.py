"""The training loop end to end: exact resume, SIGTERM, corrupt checkpoints, NaN stop,
two processes, and the checkpoint as decoding sees it.

Every run is `tiny_train_config` (the `copy` task, a one-layer model, 6 steps of 8 global
rows, checkpoints every 3 steps) on 4 fake devices unless a test says otherwise.
"""

import glob
import json
import os
import shutil
import signal

import chex
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import models
from models.tokenizer import load_tokenizer
from tests.train_helpers import (
    free_port,
    straight_run,
    tiny_train_config,
    worker,
    worker_summary,
)
from train import checkpoint, trainer
from train.trainer import train_and_evaluate


def _sigterm_at(k: int):
    """A hook that sends this process SIGTERM once step k's metrics are read."""
    return lambda step, metrics: step == k and os.kill(os.getpid(), signal.SIGTERM)


def _params(workdir: str, step: int | None = None):
    saved = checkpoint.restore_model(workdir, step)
    return saved.params, saved.step


def _steps(workdir: str) -> list[int]:
    return sorted(checkpoint.manager(workdir).all_steps())


def _train_metrics(workdir: str) -> dict[int, dict]:
    """metrics.jsonl's train rows by step, without the wall-clock rate."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {r["step"]: {k: v for k, v in r.items() if k != "tokens_per_s"}
            for r in rows if r["split"] == "train"}


@pytest.fixture(scope="module")
def straight(data_dir):
    """Six steps in one go: the run every interrupted run must reproduce (made once per
    test process, shared with test_reliability)."""
    return straight_run(data_dir)


def test_a_fresh_run_writes_checkpoints_metrics_and_its_summary(straight):
    workdir, summary = straight
    assert summary["step"] == 6 and summary["resumed_from_step"] is None
    assert summary["train_seconds"] > 0
    assert set(summary["validation"]) >= {"loss", "accuracy", "perplexity"}
    with open(os.path.join(workdir, "summary.json")) as f:
        assert json.load(f) == summary
    assert _steps(workdir) == [3, 6]
    assert sorted(_train_metrics(workdir)) == [1, 2, 3, 4, 5, 6]
    assert glob.glob(os.path.join(workdir, "tensorboard", "events.out.tfevents.*"))
    assert os.path.exists(os.path.join(workdir, "tokenizer", "zoo_tokenizer.json"))
    assert summary["model"] == os.path.join(workdir, "model")
    assert os.path.exists(os.path.join(workdir, "model", "model.safetensors"))


def test_sigterm_saves_and_the_same_command_resumes_exactly(straight, data_dir, tmp_path):
    workdir = str(tmp_path)
    config = tiny_train_config(data_dir)
    # The signal arrives while step 2 runs (step 1's metrics are read behind it): the loop
    # finishes step 2, saves it (not a checkpoint_every_steps step) and returns.
    first = train_and_evaluate(config, workdir, hooks=[_sigterm_at(1)])
    assert first["stopped_by"] == "SIGTERM" and first["step"] == 2
    assert first["preempted"] is True
    assert _steps(workdir) == [2]
    second = train_and_evaluate(config, workdir)
    assert second["resumed_from_step"] == 2 and second["step"] == 6
    assert second["preempted"] is False and "stopped_by" not in second
    # Bit for bit: the restored state, data position and RNG continue the same computation.
    chex.assert_trees_all_equal(_params(workdir)[0], _params(straight[0])[0])
    assert _train_metrics(workdir) == _train_metrics(straight[0])
    assert second["validation"] == straight[1]["validation"]


def test_ctrl_c_and_sigterm_become_a_stop_request_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGINT)
    for sig in (signal.SIGINT, signal.SIGTERM):
        with trainer._stop_signals() as should_stop:
            assert should_stop(0) is None
            os.kill(os.getpid(), sig)
            assert should_stop(0) == sig.name
    assert signal.getsignal(signal.SIGINT) is before


def test_a_corrupt_latest_checkpoint_is_reported_and_the_previous_one_used(
        straight, data_dir, tmp_path, capsys):
    workdir = str(tmp_path / "run")
    shutil.copytree(straight[0], workdir)
    for path in glob.glob(os.path.join(workdir, "checkpoints", "6", "params", "**"),
                          recursive=True):
        if os.path.isfile(path):
            with open(path, "wb") as f:
                f.write(b"\0garbage")
    params, step = _params(workdir)
    assert step == 3
    assert "checkpoint at step 6 is unreadable" in capsys.readouterr().out
    chex.assert_trees_all_equal(params, _params(straight[0], 3)[0])

    # Training again resumes from step 3, sets step 6 aside, and redoes it exactly.
    summary = train_and_evaluate(tiny_train_config(data_dir), workdir)
    out = capsys.readouterr().out
    assert "checkpoint at step 6 is unreadable" in out and "6.unreadable" in out
    assert summary["resumed_from_step"] == 3 and summary["step"] == 6
    assert os.path.isdir(os.path.join(workdir, "checkpoints", "6.unreadable"))
    chex.assert_trees_all_equal(_params(workdir)[0], _params(straight[0])[0])


def test_a_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoints in"):
        checkpoint.restore_model(str(tmp_path))


def test_a_nan_loss_stops_the_run_naming_the_step_and_keeps_the_last_good_checkpoint(
        data_dir, tmp_path):
    # An absurd learning rate from the first step (rsqrt: no ramp from 0) and no clipping:
    # step 1's update overflows the parameters, so step 2's loss is not finite.
    config = tiny_train_config(data_dir, learning_rate=1e30, lr_decay="rsqrt", warmup_steps=1,
                               grad_clip_norm=0.0, checkpoint_every_steps=1)
    with pytest.raises(FloatingPointError, match=r"loss is (nan|inf) at step 2; stopping"):
        train_and_evaluate(config, str(tmp_path))
    assert _steps(str(tmp_path)) == [1]
    params, _ = _params(str(tmp_path))
    chex.assert_tree_all_finite(params)


def test_checkpoints_hold_plain_parameters_that_decode_on_one_device(straight):
    """Saved from 4 replicas, restored as host arrays of the model's own shapes, no optimiser
    state, and usable by decode straight away; the run's export holds the same model."""
    import decode
    saved = checkpoint.restore_model(straight[0])
    params, tok = saved.params, saved.tokenizer
    assert saved.step == 6 and tok.vocab_size == 260
    model = models.build(saved.config)
    src = np.array([[10, 11, 12, 1]], np.int32)
    expected = jax.eval_shape(model.init, jax.random.key(0), src, src)["params"]
    chex.assert_trees_all_equal_shapes_and_dtypes(params, expected)
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(params))
    out = decode.generate(model, params, src, np.array([4], np.int32), max_new_tokens=3)
    chex.assert_shape(out.tokens, (1, 3))
    # The items decoding does not read are there for training to resume from.
    mngr = ocp.CheckpointManager(os.path.join(straight[0], "checkpoints"))
    assert set(mngr.item_metadata(6).keys()) >= {"params", "train", "data", "config",
                                                 "tokenizer"}
    # The export is the same model, in the one on-disk form, with its tokenizer.
    exported = models.load(os.path.join(straight[0], "model"))
    assert exported.config == saved.config and exported.model_type == "jax_transformer_zoo"
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, exported.params), params)
    assert exported.tokenizer.encode("ab", add_special_tokens=True) == \
        tok.encode("ab") + [tok.eos_id]          # an encoder-decoder's sources end in EOS


@pytest.mark.slow
def test_two_processes_preempted_then_one_device_resuming_equal_one_process(
        straight, data_dir, tmp_path):
    """Two processes x 2 devices (gloo on localhost) train the same global batches as one
    process x 4. SIGTERM to one of them reaches both through JAX's preemption service: they
    stop after the same step and save one checkpoint. A single process with 1 device (8 rows
    per device, so the same global batch) resumes it and ends where the straight run did."""
    workdir = str(tmp_path)
    port = free_port()
    common = dict(distributed=True, num_processes=2, coordinator_address=f"localhost:{port}",
                  step_seconds=0.5)
    procs = [worker(workdir, data_dir, 2, process_id=i, **common,
                     **({"sigterm_at": 1} if i == 1 else {})) for i in range(2)]
    first = [worker_summary(p) for p in procs]
    assert [s["stopped_by"] for s in first] == ["SIGTERM", "SIGTERM"]
    # The step they agree on depends on when the notice arrives (step 3's periodic
    # checkpoint may come first); what matters is that both stop there and save it.
    assert first[0]["step"] == first[1]["step"] and 1 <= first[0]["step"] < 6
    assert _steps(workdir)[-1] == first[0]["step"]

    resumed = worker_summary(worker(workdir, data_dir, 1, per_device_batch_size=8))
    assert resumed["resumed_from_step"] == first[0]["step"] and resumed["step"] == 6
    # Tolerance: gradients are summed over devices in another order (in process, then over
    # gloo), and adam divides by their root mean square.
    chex.assert_trees_all_close(_params(workdir)[0], _params(straight[0])[0], atol=2e-5)
    np.testing.assert_allclose(resumed["validation"]["loss"],
                               straight[1]["validation"]["loss"], rtol=1e-5)


@pytest.mark.slow
def test_two_processes_restore_the_newest_step_both_can_read(straight, data_dir, tmp_path):
    """Two processes x 2 devices resume the straight run's checkpoints (steps 3 and 6), and
    process 1 cannot read step 6 (its integrity check fails there only). Both restore step
    3, the lead sets step 6 aside naming process 1's reason, and both redo steps 4 to 6 to
    the straight run's parameters."""
    workdir = str(tmp_path / "run")
    shutil.copytree(straight[0], workdir)
    common = dict(distributed=True, num_processes=2, coordinator_address=f"localhost:{free_port()}")
    procs = [worker(workdir, data_dir, 2, process_id=i, **common,
                    **({"unreadable_step": 6} if i == 1 else {})) for i in range(2)]
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    summaries = [json.loads(out.rsplit("SUMMARY ", 1)[1]) for out in outs]
    assert [(s["resumed_from_step"], s["step"]) for s in summaries] == [(3, 6), (3, 6)]
    ckpts = os.path.join(workdir, "checkpoints")
    assert (f"checkpoint at step 6 is unreadable (process 1: unreadable_step=6 fails this "
            f"process's integrity check); moved it to {ckpts}/6.unreadable; using step 3"
            in outs[0])
    assert sorted(os.listdir(ckpts)) == ["3", "6", "6.unreadable"]
    assert summaries[0]["validation"] == summaries[1]["validation"]
    # Tolerance: gradients are summed over devices in another order (in process, then over
    # gloo), and adam divides by their root mean square.
    chex.assert_trees_all_close(_params(workdir)[0], _params(straight[0])[0], atol=2e-5)
    np.testing.assert_allclose(summaries[0]["validation"]["loss"],
                               straight[1]["validation"]["loss"], rtol=1e-5)


def test_tokenizer_from_takes_another_models_tokenizer(straight, data_dir, tmp_path):
    """A run given `tokenizer_from` (a draft for speculative decoding) encodes with that
    model's tokenizer, not one of its own making (here: bytes, where sentencepiece would
    have been trained)."""
    workdir, _ = straight
    config = tiny_train_config(data_dir, tokenizer="sentencepiece", vocab_size=300,
                               tokenizer_from=os.path.join(workdir, "model"),
                               num_train_steps=1)
    train_and_evaluate(config, str(tmp_path))
    ours = load_tokenizer(os.path.join(str(tmp_path), "tokenizer"))
    theirs = load_tokenizer(os.path.join(workdir, "model"))
    assert ours.identity == theirs.identity and ours.vocab_size == theirs.vocab_size
