"""`parallel="sharded"` end to end: a checkpoint written on one mesh resumes on another and
on one device, and two processes over one fsdp mesh train as one process does.

Every run is `tiny_train_config` (the `copy` task, 6 steps of 8 global rows, checkpoints
every 3 steps); the reference is the straight pmap run over 4 fake devices. Tolerance: the
pmap tests' (float32 sums in another order; adam divides by their root mean square).
"""

import os
import shutil
import signal

import chex
import jax
import numpy as np
import pytest

from tests.train_helpers import (
    free_port,
    straight_run,
    tiny_train_config,
    worker,
    worker_summary,
)
from train import checkpoint
from train.trainer import train_and_evaluate

SHARDED = dict(parallel="sharded")


@pytest.fixture(scope="module")
def straight(data_dir):
    return straight_run(data_dir)


def _params(workdir: str):
    return checkpoint.restore_model(workdir).params


@pytest.mark.slow
def test_a_run_stopped_on_fsdp4_resumes_on_fsdp2_tensor2_and_on_one_device(
        straight, data_dir, tmp_path):
    first = str(tmp_path / "first")
    config = tiny_train_config(data_dir, **SHARDED, mesh_shape=(1, 4, 1))
    stop = lambda step, metrics: step == 2 and os.kill(os.getpid(), signal.SIGTERM)  # noqa: E731
    stopped = train_and_evaluate(config, first, hooks=[stop])
    assert stopped["stopped_by"] == "SIGTERM" and stopped["step"] == 3
    one_device = str(tmp_path / "one_device")
    shutil.copytree(first, one_device)
    # The saved arrays are whole, whatever mesh wrote them: read back without any mesh.
    saved = checkpoint.restore_model(first).params
    assert all(isinstance(x, np.ndarray) or x.is_fully_addressable
               for x in jax.tree.leaves(saved))

    resumed = train_and_evaluate(tiny_train_config(data_dir, **SHARDED, mesh_shape=(1, 2, 2)),
                                 first)
    assert resumed["resumed_from_step"] == 3 and resumed["step"] == 6
    chex.assert_trees_all_close(_params(first), _params(straight[0]), atol=2e-5)
    np.testing.assert_allclose(resumed["validation"]["loss"],
                               straight[1]["validation"]["loss"], rtol=1e-5)

    # One device, 8 rows on it: the same global batch.
    alone = worker_summary(worker(one_device, data_dir, 1, per_device_batch_size=8,
                                  **SHARDED))
    assert alone["resumed_from_step"] == 3 and alone["step"] == 6
    chex.assert_trees_all_close(_params(one_device), _params(straight[0]), atol=2e-5)


@pytest.mark.slow
def test_two_processes_over_one_fsdp4_mesh_equal_one_process(straight, data_dir, tmp_path):
    """Two processes x 2 devices (gloo on localhost), the parameters and adam moments
    sharded over all four, checkpointing every 3 steps: the same parameters as one process
    with pmap over 4."""
    workdir = str(tmp_path)
    common = dict(distributed=True, num_processes=2,
                  coordinator_address=f"localhost:{free_port()}", **SHARDED,
                  mesh_shape=[1, 4, 1])
    procs = [worker(workdir, data_dir, 2, process_id=i, **common) for i in range(2)]
    summaries = [worker_summary(p) for p in procs]
    assert [s["step"] for s in summaries] == [6, 6]
    chex.assert_trees_all_close(_params(workdir), _params(straight[0]), atol=2e-5)
    np.testing.assert_allclose(summaries[0]["validation"]["loss"],
                               straight[1]["validation"]["loss"], rtol=1e-5)
