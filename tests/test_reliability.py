"""Careless users and unkind machines: what a run writes is whole and finite, what it reads
is what was written, one run per workdir, fast errors that name the path, exit statuses,
and kill -9 at chosen moments (tests/kill_soak.py does it at random moments, at length).

Runs are `tiny_train_config` (the `copy` task, a one-layer model, 6 steps) on 4 fake
devices; `straight` is the uninterrupted 6-step run, shared with test_train_loop.
"""

import glob
import json
import os
import shutil
import signal
import struct
import time

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import train.__main__ as train_cli
from models.tokenizer import ByteTokenizer
from tests.train_helpers import (
    straight_run,
    tiny_train_config,
    train_metric_rows,
    worker,
    worker_killed,
    worker_summary,
)
from train import checkpoint, integrity, parallel, setup, workdir as workdir_lib
from train.run_config import RunConfig
from train.state import TrainState
from train.trainer import train_and_evaluate


@pytest.fixture(scope="module")
def straight(data_dir):
    return straight_run(data_dir)


def _params(workdir: str, step: int | None = None):
    return checkpoint.restore_model(workdir, step).params


def _copy(straight, tmp_path) -> str:
    workdir = str(tmp_path / "run")
    shutil.copytree(straight[0], workdir)
    return workdir


def _flip_a_byte_in_params(workdir: str, step: int) -> str:
    """Flips one bit in the middle of the step's largest params file (array data, which
    orbax reads back without complaint); returns its path relative to the step."""
    step_dir = os.path.join(workdir, "checkpoints", str(step))
    files = [p for p in glob.glob(os.path.join(step_dir, "params", "**"), recursive=True)
             if os.path.isfile(p)]
    path = max(files, key=os.path.getsize)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    return os.path.relpath(path, step_dir)


def _event_records(path: str) -> list[bytes]:
    """The records of a TensorBoard events file (TFRecord framing)."""
    out = []
    with open(path, "rb") as f:
        while header := f.read(12):
            (length,) = struct.unpack("<Q", header[:8])
            out.append(f.read(length))
            f.read(4)
    return out


# ---------------------------------------------------------------------------------------------
# Written finite and whole, proven so when read.

def test_non_finite_arrays_are_found_on_device_by_path():
    ok = {"params": {"a": np.ones(3, np.float32)}, "opt_state": (np.zeros(2), np.int32(7))}
    assert integrity.first_non_finite(ok) is None
    bad = {"params": {"a": np.ones(3, np.float32)},
           "opt_state": ({"mu": np.array([1.0, np.inf])}, np.int32(7))}
    assert integrity.first_non_finite(bad) == "opt_state/0/mu"
    # Replicated over the 4 devices as the loop holds it (pmap's leading device axis).
    replicated = parallel.replicate({"b": np.array([0.0, np.nan]), "a": np.ones(2)},
                                    jax.local_devices())
    assert integrity.first_non_finite(replicated) == "b"


def test_a_non_finite_parameter_is_never_saved_and_the_error_names_step_and_array(
        data_dir, tmp_path, monkeypatch):
    """Step 2's update leaves a NaN in one kernel while its loss (of step-1 parameters) is
    finite: the save of step 2 refuses, naming the step and the kernel; step 1 stays the
    newest checkpoint, and the workdir's lock is released."""
    train_step = parallel.DataParallel.train_step
    calls = []

    def poisoning(self, state, batch):
        new_state, metrics = train_step(self, state, batch)
        calls.append(1)
        if len(calls) == 2:
            params = dict(new_state.params)
            encoder = jax.tree.map(lambda x: x, params["encoder"])
            kernel = encoder["layer_0"]["mlp"]["up"]["kernel"]
            encoder["layer_0"]["mlp"]["up"]["kernel"] = kernel.at[..., 0].set(np.nan)
            new_state = new_state.replace(params={**params, "encoder": encoder})
        return new_state, metrics

    monkeypatch.setattr(parallel.DataParallel, "train_step", poisoning)
    workdir = str(tmp_path)
    config = tiny_train_config(data_dir, num_train_steps=3, checkpoint_every_steps=1)
    with pytest.raises(FloatingPointError, match=r"^params/encoder/layer_0/mlp/up/kernel is "
                       r"not finite \(nan or inf\) at step 2; stopping without saving it"):
        train_and_evaluate(config, workdir)
    assert sorted(checkpoint.manager(workdir).all_steps()) == [1]
    assert not glob.glob(os.path.join(workdir, "checkpoints", "2*"))
    chex.assert_tree_all_finite(_params(workdir))
    workdir_lib.claim(workdir).release()


def test_a_flipped_byte_sets_the_step_aside_in_one_line_and_resuming_redoes_it_exactly(
        straight, data_dir, tmp_path, capfd):
    """Also: metrics.jsonl and TensorBoard hold each step once after the resume (the copy
    logged steps 4 to 6, which the resumed run logs again)."""
    workdir = _copy(straight, tmp_path)
    changed = _flip_a_byte_in_params(workdir, 6)
    capfd.readouterr()
    assert checkpoint.restore_model(workdir).step == 3       # decoding falls back too
    out = capfd.readouterr().out
    assert f"checkpoint at step 6 is unreadable ({changed} differs from its manifest" in out

    summary = train_and_evaluate(tiny_train_config(data_dir), workdir)
    captured = capfd.readouterr()
    lines = [line for line in (captured.out + captured.err).splitlines() if "step 6" in line
             and "unreadable" in line]
    assert lines == [f"checkpoint at step 6 is unreadable ({changed} differs from its manifest "
                     f"(sha256)); moved it to {workdir}/checkpoints/6.unreadable; using step 3"]
    assert "Traceback" not in captured.out + captured.err
    assert summary["resumed_from_step"] == 3 and summary["step"] == 6
    chex.assert_trees_all_equal(_params(workdir), _params(straight[0]))

    # Each train step once, as the straight run logged them.
    assert train_metric_rows(workdir) == train_metric_rows(straight[0])
    # TensorBoard: the new events file starts by purging what the old one has from step 4.
    from tensorboardX.proto import event_pb2
    newest = max(glob.glob(os.path.join(workdir, "tensorboard", "*tfevents*")),
                 key=os.path.getmtime)
    events = [event_pb2.Event.FromString(r) for r in _event_records(newest)]
    starts = [e.step for e in events if e.HasField("session_log")
              and e.session_log.status == event_pb2.SessionLog.START]
    assert starts == [4]


def test_checkpoints_without_a_manifest_restore_only_if_written_before_manifests(
        straight, tmp_path, capsys):
    workdir = _copy(straight, tmp_path)
    os.remove(os.path.join(workdir, "checkpoints", "6", integrity.MANIFEST))
    # A save killed after orbax finished and before the manifest: its step metadata
    # promises one.
    assert checkpoint.restore_model(workdir).step == 3
    assert ("checkpoint at step 6 is unreadable (integrity.json is missing: the save did not "
            "finish)") in capsys.readouterr().out
    # Written before manifests existed: no promise in the step metadata, restored unchecked.
    meta_path = os.path.join(workdir, "checkpoints", "6", "_CHECKPOINT_METADATA")
    with open(meta_path) as f:
        meta = json.load(f)
    meta["custom_metadata"] = {}
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    assert checkpoint.restore_model(workdir).step == 6
    assert "unreadable" not in capsys.readouterr().out


def test_when_no_checkpoint_is_usable_the_run_stops_naming_each_and_moves_none(
        straight, data_dir, tmp_path):
    workdir = _copy(straight, tmp_path)
    changed = {step: _flip_a_byte_in_params(workdir, step) for step in (3, 6)}
    ckpts = os.path.join(workdir, "checkpoints")
    with pytest.raises(checkpoint.CheckpointError) as e:
        train_and_evaluate(tiny_train_config(data_dir), workdir)
    assert str(e.value).startswith(
        f"no usable checkpoint in {ckpts}: step 6: {changed[6]} differs from its manifest "
        f"(sha256); step 3: {changed[3]} differs from its manifest (sha256). Nothing was moved")
    assert sorted(os.listdir(ckpts)) == ["3", "6"]


def test_resuming_with_another_model_stops_before_training_naming_the_array_and_shapes(
        straight, data_dir, tmp_path):
    workdir = _copy(straight, tmp_path)
    config = tiny_train_config(data_dir)
    config.model_overrides.d_model = 48
    started = time.monotonic()
    with pytest.raises(checkpoint.CheckpointError, match=(
            r"the checkpoint at step 6 in .*/checkpoints does not fit this run: "
            r"params/cross_kv/key_kernel is shape \(1, 32, 2, 16\) there and shape "
            r"\(1, 48, 2, 24\) here; was the model config")):
        train_and_evaluate(config, workdir)
    assert time.monotonic() - started < 30
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["3", "6"]
    assert train_metric_rows(workdir) == train_metric_rows(straight[0])    # untouched


# ---------------------------------------------------------------------------------------------
# The command line: exit statuses, one-line errors.

def _cli(args: list[str]) -> int:
    with pytest.raises(SystemExit) as e:
        train_cli.main(["prog", *args])
    return e.value.code


def test_the_cli_exits_143_after_a_sigterm_and_summary_says_preempted(
        data_dir, tmp_path, monkeypatch):
    workdir = tmp_path / "run"
    config = tiny_train_config(data_dir)
    monkeypatch.setattr(train_cli.configs, "get", lambda name: config)
    real = train_and_evaluate

    def with_sigterm(config, workdir):
        hook = lambda step, m: step == 1 and os.kill(os.getpid(), signal.SIGTERM)  # noqa: E731
        return real(config, workdir, hooks=[hook])
    monkeypatch.setattr("train.trainer.train_and_evaluate", with_sigterm)
    assert _cli(["--config", "copy", "--workdir", str(workdir)]) == 143
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["preempted"] is True and summary["stopped_by"] == "SIGTERM"
    assert summary["step"] == 2 and sorted(checkpoint.manager(str(workdir)).all_steps()) == [2]
    assert (workdir / "model" / "model.safetensors").exists()


def test_cli_errors_a_user_can_fix_are_one_line_and_exit_2(tmp_path, capfd):
    in_the_way = tmp_path / "file"
    in_the_way.write_text("not a directory")
    assert _cli(["--config", "copy", "--workdir", str(in_the_way), "extra_arg"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err == ["error: unexpected argument 'extra_arg': python -m train takes only flags "
                   "(--config NAME_OR_PATH, --workdir DIR, --config.KEY=VALUE, --verbose)"]

    assert _cli(["--config", "copy", "--workdir", str(in_the_way)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err == [f"error: workdir {str(in_the_way)!r} is not a directory (a file is in the "
                   "way)"]
    assert _cli(["--config", "copy", "--workdir", str(in_the_way), "--verbose"]) == 2
    err = capfd.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("error: workdir")
    # A config value that breaks its rule: one line, before any work.
    assert _cli(["--config", "copy", "--workdir", str(tmp_path / "run"),
                 "--config.num_train_steps=-1"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err == ["error: num_train_steps=-1 must be an int >= 0"]


def test_cli_a_bug_inside_the_run_is_an_internal_error_with_its_traceback_exit_1(
        data_dir, tmp_path, capfd, monkeypatch):
    """A plain ValueError (as a library raises one) is not the user's mistake: its
    traceback, a line saying it is a bug, and exit 1; the workdir's lock is released."""
    def broken(data):
        raise ValueError("operands could not be broadcast together")
    monkeypatch.setattr("train.setup.load_dataset", broken)
    workdir = tmp_path / "run"
    assert _cli(["--config", "copy", "--workdir", str(workdir),
                 f"--config.data_dir={data_dir}"]) == 1
    err = capfd.readouterr().err
    assert "Traceback" in err and "in broken" in err
    assert err.strip().splitlines()[-1] == (
        "error: internal error (a bug in jax-transformer-zoo or a library it uses): "
        "ValueError: operands could not be broadcast together")
    workdir_lib.claim(str(workdir)).release()


def test_a_user_error_from_a_host_callback_inside_a_step_is_one_line_and_exit_2(capfd):
    """A reward function's bad value found in `jax.pure_callback` reaches the caller inside
    JAX's runtime error; the command line still reports the user's message alone."""
    from models.errors import UserError, raise_from_host
    from train import cli_errors

    def host(x):
        raise_from_host(UserError(f"sequence.reward='f' gave nan for {int(x)}"))

    @jax.jit
    def step(x):
        return jax.pure_callback(host, jax.ShapeDtypeStruct((), jnp.float32), x)

    try:
        step(jnp.int32(3)).block_until_ready()
        raise AssertionError("the callback's error did not reach the caller")
    except UserError:
        raise
    except Exception as e:                                  # noqa: BLE001 (JAX's own type)
        assert cli_errors.report(e) == 2
    assert capfd.readouterr().err.strip().splitlines()[-1:] == [
        "error: sequence.reward='f' gave nan for 3"]
    try:
        jax.effects_barrier()
    except Exception:                                       # noqa: BLE001
        pass


def test_export_cli_errors_follow_the_same_rule(tmp_path, capfd, monkeypatch):
    from train import export as export_lib
    assert export_lib.main(["--workdir", str(tmp_path)]) == 2          # no checkpoints
    assert capfd.readouterr().err.strip().splitlines() == [
        f"error: no checkpoints in {str(tmp_path)!r} (looked for {tmp_path / 'checkpoints'})"]

    def broken(workdir, step=None):
        raise KeyError("params")
    monkeypatch.setattr(export_lib.checkpoint, "restore_model", broken)
    assert export_lib.main(["--workdir", str(tmp_path)]) == 1
    err = capfd.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1] == (
        "error: internal error (a bug in jax-transformer-zoo or a library it uses): "
        "KeyError: 'params'")


# ---------------------------------------------------------------------------------------------
# Unwritable paths are found fast and named.

def test_an_unwritable_workdir_is_found_before_any_data_preparation(data_dir, tmp_path):
    config = tiny_train_config(data_dir)
    in_the_way = tmp_path / "file"
    in_the_way.write_text("")
    started = time.monotonic()
    with pytest.raises(workdir_lib.WorkdirError, match=f"workdir '{in_the_way}' is not a "
                       r"directory \(a file is in the way\)"):
        train_and_evaluate(config, str(in_the_way))
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "checkpoints").write_text("")
    with pytest.raises(workdir_lib.WorkdirError, match=f"{workdir}/checkpoints is not a "
                       r"directory \(a file is in the way\)"):
        train_and_evaluate(config, str(workdir))
    assert sorted(os.listdir(workdir)) == [".lock", "checkpoints"]     # nothing prepared
    assert time.monotonic() - started < 10


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permissions; the "
                    "file-in-the-way cases above run instead")
def test_a_read_only_workdir_is_found_before_any_data_preparation(data_dir, tmp_path):
    workdir = tmp_path / "run"
    workdir.mkdir()
    workdir.chmod(0o555)
    try:
        with pytest.raises(workdir_lib.WorkdirError, match=f"cannot write in the workdir "
                           f"'{workdir}'"):
            train_and_evaluate(tiny_train_config(data_dir), str(workdir))
    finally:
        workdir.chmod(0o755)


def _tiny_state() -> TrainState:
    return TrainState(step=np.int32(1), params={"w": np.ones(3, np.float32)}, opt_state=(),
                      rng=np.zeros(2, np.uint32), tx=optax.identity())


def test_a_save_into_a_checkpoint_directory_gone_unwritable_fails_fast_naming_it(tmp_path):
    mngr = checkpoint.manager(str(tmp_path))
    checkpoint.save(mngr, 1, _tiny_state(), {}, {}, tok=ByteTokenizer())
    directory = os.path.join(tmp_path, "checkpoints")
    shutil.rmtree(directory)
    with open(directory, "w") as f:           # replaced by a file while the run goes on
        f.write("")
    started = time.monotonic()
    with pytest.raises(workdir_lib.WorkdirError, match=f"{directory} is not a directory"):
        checkpoint.save(mngr, 2, _tiny_state(), {}, {}, tok=ByteTokenizer())
    assert time.monotonic() - started < 10


# ---------------------------------------------------------------------------------------------
# Files written whole.

def test_files_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    path.write_text("old")

    def full_disk(fd):
        raise OSError(28, "No space left on device")
    with monkeypatch.context() as m:
        m.setattr(os, "fsync", full_disk)
        with pytest.raises(workdir_lib.WorkdirError,
                           match=f"cannot write {path}: No space left on device"):
            workdir_lib.write_text(str(path), "new")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["summary.json"]
    workdir_lib.write_text(str(path), "new")
    assert path.read_text() == "new"


def test_the_run_tokenizer_is_saved_whole_or_not_at_all(tmp_path, monkeypatch):
    run = RunConfig.from_config(tiny_train_config("unused"))
    save = ByteTokenizer.save

    def half_then_full_disk(self, directory):
        save(self, directory)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(ByteTokenizer, "save", half_then_full_disk)
    with pytest.raises(OSError, match=f"{tmp_path}/tokenizer"):
        setup.get_tokenizer(run.model, run.data, None, str(tmp_path))
    assert os.listdir(tmp_path) == []             # no half tokenizer for a later run to load
    monkeypatch.setattr(ByteTokenizer, "save", save)
    assert setup.get_tokenizer(run.model, run.data, None, str(tmp_path)).vocab_size == 260
    assert os.listdir(tmp_path) == ["tokenizer"]


# ---------------------------------------------------------------------------------------------
# One run per workdir.

def test_each_process_locks_its_own_file_and_a_second_holder_is_refused(tmp_path):
    lead, other = workdir_lib.claim(str(tmp_path), 0), workdir_lib.claim(str(tmp_path), 1)
    with pytest.raises(workdir_lib.WorkdirInUse, match=f"pid {os.getpid()} on host "):
        workdir_lib.claim(str(tmp_path), 0)
    lead.release()
    other.release()
    workdir_lib.claim(str(tmp_path), 0).release()


@pytest.mark.slow
def test_a_second_run_in_a_busy_workdir_fails_fast_and_the_first_finishes(data_dir, tmp_path):
    workdir = str(tmp_path)
    first = worker(workdir, data_dir, 4, step_seconds=0.3)
    lock = os.path.join(workdir, ".lock")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and first.poll() is None:
        try:
            with open(lock) as f:
                if json.loads(f.read() or "{}").get("pid") == first.pid:
                    break
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    started = time.monotonic()
    with pytest.raises(workdir_lib.WorkdirInUse, match=(
            f"workdir '{workdir}' is in use by another run \\(pid {first.pid} on host .+; "
            f"lock file {lock}\\)")):
        train_and_evaluate(tiny_train_config(data_dir), workdir)
    assert time.monotonic() - started < 20
    summary = worker_summary(first)
    assert summary["step"] == 6 and summary["resumed_from_step"] is None
    assert [r["step"] for r in train_metric_rows(workdir)] == [1, 2, 3, 4, 5, 6]


# ---------------------------------------------------------------------------------------------
# kill -9, twice, and the end is the uninterrupted run's.

@pytest.mark.slow
def test_killed_twice_once_inside_a_save_resuming_gives_the_straight_run_bit_for_bit(
        straight, data_dir, tmp_path):
    """Checkpoints every 2 steps. Kill 1: inside the save of step 4, after orbax finished and
    before the manifest. Kill 2: during step 6 (after step 5's metrics), with step 4 saved
    again. Each restart takes the lock the dead process held."""
    workdir = str(tmp_path)
    every = {"checkpoint_every_steps": 2}
    worker_killed(worker(workdir, data_dir, 4, sigkill_in_save=4, **every))
    step_4 = os.path.join(workdir, "checkpoints", "4")
    assert os.path.isdir(step_4)
    assert not os.path.exists(os.path.join(step_4, integrity.MANIFEST))

    out = worker_killed(worker(workdir, data_dir, 4, sigkill_at=5, **every))
    assert (f"checkpoint at step 4 is unreadable (integrity.json is missing: the save did not "
            f"finish); moved it to {step_4}.unreadable; using step 2") in out
    assert "resumed from step 2" in out

    summary = worker_summary(worker(workdir, data_dir, 4, **every))
    assert summary["resumed_from_step"] == 4 and summary["step"] == 6
    chex.assert_trees_all_equal(_params(workdir), _params(straight[0]))
    assert train_metric_rows(workdir) == train_metric_rows(straight[0])
    assert summary["validation"] == straight[1]["validation"]


def test_a_resumed_run_whose_data_file_changed_says_so_and_reads_the_new_tokens(
        data_dir, tmp_path, capsys):
    """Editing a data file while keeping its line count used to resume on the old tokens
    (the cache was keyed by the example count); now the cache is keyed by the contents and
    the run names the file whose contents changed."""
    train_file, test_file = tmp_path / "train.tsv", tmp_path / "test.tsv"
    pairs = [f"{w} {v}\t{v} {w}" for w in "abcdefgh" for v in "pqrstu"]
    train_file.write_text("\n".join(pairs) + "\n")
    test_file.write_text("\n".join(pairs[:8]) + "\n")
    config = tiny_train_config(data_dir, dataset="local_translation",
                               data_files=f"{train_file},{test_file}", num_train_steps=2,
                               checkpoint_every_steps=2)
    workdir = str(tmp_path / "run")
    train_and_evaluate(config, workdir)
    caches = set(os.listdir(os.path.join(workdir, "cache")))
    train_file.write_text("\n".join(p.replace("\tp", "\tz") for p in pairs) + "\n")
    capsys.readouterr()
    config.num_train_steps = 3
    summary = train_and_evaluate(config, workdir)
    out = capsys.readouterr().out
    assert summary["resumed_from_step"] == 2 and summary["step"] == 3
    assert "warning: the data differ from those of the checkpoint at step 2" in out
    assert f"data file '{train_file}' changed" in out
    assert set(os.listdir(os.path.join(workdir, "cache"))) - caches    # new tokens cached


@pytest.mark.slow
def test_with_one_checkpoint_kept_a_kill_before_its_manifest_still_resumes(
        straight, data_dir, tmp_path, capsys):
    """keep_checkpoints=1: orbax deletes step 2 inside the save of step 4, and the kill comes
    before step 4's manifest. Step 4 is the only checkpoint left: orbax committed it whole,
    so it is used (not a run that can never resume) and its manifest written then."""
    workdir = str(tmp_path)
    settings = {"checkpoint_every_steps": 2, "keep_checkpoints": 1}
    worker_killed(worker(workdir, data_dir, 4, sigkill_in_save=4, **settings))
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["4"]
    summary = train_and_evaluate(tiny_train_config(data_dir, **settings), workdir)
    out = capsys.readouterr().out
    assert "checkpoint at step 4 has no integrity.json" in out
    assert summary["resumed_from_step"] == 4 and summary["step"] == 6
    chex.assert_trees_all_equal(_params(workdir), _params(straight[0]))


def test_the_next_run_removes_what_a_killed_one_left_half_written(tmp_path):
    workdir = str(tmp_path)
    os.makedirs(os.path.join(workdir, ".model.tmp-123-abcd", "inner"))
    with open(os.path.join(workdir, ".summary.json.tmp-123-ef01"), "w") as f:
        f.write("{")
    with open(os.path.join(workdir, ".keep-me"), "w") as f:
        f.write("mine")
    lock = workdir_lib.claim(workdir)
    try:
        assert sorted(os.listdir(workdir)) == [".keep-me", ".lock"]
    finally:
        lock.release()
