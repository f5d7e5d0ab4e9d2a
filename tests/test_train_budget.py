"""A wall-clock budget (`max_train_seconds`) and checkpoint averaging
(`average_last_checkpoints`): the run stops by the budget and ends as a finished run does,
resumes exactly; the exported and evaluated model is the mean of the newest checkpoints'
parameters, which stay as trained; bad values are refused by name.

Every run is `tiny_train_config` (the `copy` task, a one-layer model, 6 steps).
"""

import os
import types

import chex
import jax
import numpy as np
import pytest

import models
from models.errors import UserError
from tests.train_helpers import straight_run, tiny_train_config
from train import checkpoint, export as export_lib, trainer
from train.settings import CheckpointSettings, LoopSettings
from train.trainer import train_and_evaluate


@pytest.fixture
def ticking_clock(monkeypatch):
    """The trainer's clock reads 0, 1, 2, ...: one second passes at each reading. The loop
    reads it once when it starts and once before each step, so a budget of k + 0.5 seconds
    allows k steps."""
    ticks = iter(range(10**6))
    monkeypatch.setattr(trainer, "time", types.SimpleNamespace(time=lambda: next(ticks)))


def _steps(workdir: str) -> list[int]:
    return sorted(checkpoint.manager(workdir).all_steps())


def _params(workdir: str, step: int | None = None):
    return checkpoint.restore_model(workdir, step).params


def test_the_budget_stops_the_run_which_ends_as_a_finished_run_and_resumes_exactly(
        ticking_clock, data_dir, tmp_path):
    straight_dir, straight = straight_run(data_dir)
    workdir = str(tmp_path)
    config = tiny_train_config(data_dir, max_train_seconds=4.5, num_test_decode=4)
    first = train_and_evaluate(config, workdir)
    assert first["step"] == 4 and first["stopped_by"] == "max_train_seconds"
    assert first["preempted"] is False
    assert _steps(workdir) == [3, 4]                 # the cadence's, and the stopping step's
    assert set(first["validation"]) >= {"loss", "accuracy"} and "test" in first
    assert os.path.exists(os.path.join(workdir, "model", "model.safetensors"))
    # The same command goes on from step 4 (for up to 4.5 s more) and reaches step 6: the
    # run a budget cut in two ends bit for bit where the straight run does.
    second = train_and_evaluate(config, workdir)
    assert second["resumed_from_step"] == 4 and second["step"] == 6
    assert "stopped_by" not in second
    chex.assert_trees_all_equal(_params(workdir), _params(straight_dir))
    assert second["validation"] == straight["validation"]


def test_a_real_clock_budget_shorter_than_a_step_stops_after_one_step(data_dir, tmp_path):
    config = tiny_train_config(data_dir, max_train_seconds=1e-3, num_train_steps=1000)
    summary = train_and_evaluate(config, str(tmp_path))
    assert summary["step"] == 1 and summary["stopped_by"] == "max_train_seconds"
    assert summary["train_seconds"] >= 1e-3


def test_no_budget_by_default(ticking_clock, data_dir, tmp_path):
    assert LoopSettings().max_train_seconds == 0
    summary = train_and_evaluate(tiny_train_config(data_dir), str(tmp_path))
    assert summary["step"] == 6 and "stopped_by" not in summary


def _mean(workdir: str, steps: list[int]):
    """The hand-computed mean of the checkpoints' parameters."""
    trees = [_params(workdir, s) for s in steps]
    return jax.tree.map(lambda *leaves: np.mean(np.stack(leaves), axis=0), *trees)


def _averaged_config(data_dir, **changes):
    return tiny_train_config(data_dir, checkpoint_every_steps=2, average_last_checkpoints=3,
                             num_test_decode=4, **changes)


def test_the_export_and_final_evaluation_are_the_mean_of_the_newest_checkpoints(
        data_dir, tmp_path):
    straight_dir, straight = straight_run(data_dir)
    workdir = str(tmp_path / "run")
    summary = train_and_evaluate(_averaged_config(data_dir), workdir)
    assert summary["averaged_steps"] == [2, 4, 6] and _steps(workdir) == [2, 4, 6]
    mean = _mean(workdir, [2, 4, 6])
    exported = models.load(summary["model"]).params
    chex.assert_trees_all_close(exported, mean, rtol=1e-6, atol=1e-7)
    # The checkpoints keep the trained states (a resumed run continues from them).
    chex.assert_trees_all_equal(_params(workdir), _params(straight_dir))
    # The final evaluation scored the mean, not the last state.
    assert summary["validation"]["loss"] != straight["validation"]["loss"]
    # python -m train.export writes the same mean; --average-last 1 the step alone.
    again = export_lib.export(workdir, out=str(tmp_path / "again"))
    chex.assert_trees_all_equal(models.load(again).params, exported)
    single = export_lib.export(workdir, out=str(tmp_path / "single"), average_last=1)
    chex.assert_trees_all_equal(models.load(single).params, _params(workdir))
    two = export_lib.export(workdir, step=4, out=str(tmp_path / "two"), average_last=2)
    chex.assert_trees_all_close(models.load(two).params, _mean(workdir, [2, 4]),
                                rtol=1e-6, atol=1e-7)


def test_a_resumed_run_averages_the_checkpoints_written_before_the_restart(
        ticking_clock, data_dir, tmp_path):
    workdir = str(tmp_path / "cut")
    first = train_and_evaluate(_averaged_config(data_dir, max_train_seconds=3.5), workdir)
    assert first["step"] == 3 and first["averaged_steps"] == [2, 3]
    second = train_and_evaluate(_averaged_config(data_dir, max_train_seconds=3.5), workdir)
    assert second["step"] == 6 and second["averaged_steps"] == [3, 4, 6]
    chex.assert_trees_all_close(models.load(second["model"]).params,
                                _mean(workdir, [3, 4, 6]), rtol=1e-6, atol=1e-7)


def test_fewer_checkpoints_than_asked_average_those_there_and_one_is_the_state(
        data_dir, tmp_path):
    workdir = str(tmp_path / "short")
    config = _averaged_config(data_dir, num_train_steps=2)
    summary = train_and_evaluate(config, workdir)
    assert _steps(workdir) == [2] and "averaged_steps" not in summary
    chex.assert_trees_all_equal(models.load(summary["model"]).params, _params(workdir))


@pytest.mark.parametrize("make,message", [
    (lambda: LoopSettings(max_train_seconds=-1),
     "max_train_seconds=-1 must be a number >= 0 (0: no limit)"),
    (lambda: LoopSettings(max_train_seconds="6m"),
     "max_train_seconds='6m' must be a number >= 0 (0: no limit)"),
    (lambda: CheckpointSettings(average_last_checkpoints=0),
     "average_last_checkpoints=0 must be an int >= 1"),
    (lambda: CheckpointSettings(average_last_checkpoints=4, keep_checkpoints=3),
     "average_last_checkpoints=4 is above keep_checkpoints=3: only the newest"),
])
def test_bad_values_are_refused_by_name(make, message):
    with pytest.raises(UserError) as e:
        make()
    assert str(e.value).startswith(message), str(e.value)


def test_export_refuses_a_bad_average_count_by_name(tmp_path):
    with pytest.raises(UserError, match=r"^average_last=0 must be an int >= 1"):
        export_lib.export(str(tmp_path), average_last=0)


def test_the_command_line_ends_a_run_stopped_by_its_budget_as_a_finished_one(tmp_path):
    """`python -m train --config translate_small` (made tiny) in a fresh interpreter: the
    budget ends the run with status 0 and the usual closing lines."""
    import json
    import subprocess
    import sys
    words = ["open", "close", "file", "new", "save", "print", "page", "view"]
    german = ["öffnen", "schließen", "Datei", "neu", "speichern", "drucken", "Seite", "Ansicht"]
    rows = [f"{words[i % 8]} {words[(i * 3) % 8]}\t{german[i % 8]} {german[(i * 3) % 8]}"
            for i in range(64)]
    for name, part in (("train", rows[:48]), ("validation", rows[48:56]), ("test", rows[56:])):
        (tmp_path / f"{name}.tsv").write_text("\n".join(part) + "\n")
    files = ",".join(str(tmp_path / f"{n}.tsv") for n in ("train", "validation", "test"))
    workdir = tmp_path / "run"
    overrides = dict(data_files=files, tokenizer="byte",
                     max_train_seconds=0.001, per_device_batch_size=2,
                     eval_per_device_batch_size=8, max_source_length=24,
                     max_target_length=24, max_decode_length=8, num_eval_decode=4,
                     num_test_decode=4, log_every_steps=1)
    model = dict(d_model=32, num_heads=2, mlp_dim=64, num_encoder_layers=1,
                 num_decoder_layers=1)
    args = ([sys.executable, "-m", "train", "--config", "translate_small", "--workdir",
             str(workdir)] + [f"--config.{k}={v}" for k, v in overrides.items()]
            + [f"--config.model_overrides.{k}={v}" for k, v in model.items()])
    done = subprocess.run(args, capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "max_train_seconds=0.001 spent: stopped at step 1 of 2600" in done.stdout
    assert "done: step 1 in" in done.stdout
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["stopped_by"] == "max_train_seconds" and "test" in summary
