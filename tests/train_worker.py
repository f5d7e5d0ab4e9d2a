"""One training process in a fresh interpreter (run by test_train_loop, not by pytest).

    python tests/train_worker.py WORKDIR DATA_DIR DEVICES [KEY=VALUE ...]

DEVICES fake CPU devices; KEY=VALUE set config keys (JSON values), e.g. `process_id=1`.
Multi-host runs set `distributed=true`, `num_processes`, `process_id` and
`coordinator_address`; collectives then go over gloo on localhost. `sigterm_at=K` makes the
process send itself SIGTERM once step K's metrics are read; `step_seconds=X` makes each step
last at least X seconds (a real step's length: time for a preemption notice to reach every
process before the 6-step run is over). Kills, for the kill tests: `sigkill_at=K` sends
SIGKILL once step K's metrics are read; `sigkill_in_save=K` sends it inside the save of step
K, after orbax has finished writing it and before its integrity manifest; `trace=true`
prints `EVENT save-start K` and `EVENT save-end K` around every save (the soak script tells
from them where a kill landed). `unreadable_step=K` makes this process's integrity check of
checkpoint step K fail (the other processes read it). The summary is printed last, as one
line `SUMMARY {...}`.
"""

import json
import os
import re
import signal
import sys
import time

_devices = int(sys.argv[3])
_flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count={_devices}".strip()
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root

from tests.train_helpers import tiny_train_config  # noqa: E402
from train.trainer import train_and_evaluate  # noqa: E402


def _kill_in_save(k: int) -> None:
    """SIGKILL inside the save of step k: after orbax finished it, before its manifest."""
    from models import atomic
    write_manifest = atomic.write_manifest

    def dying(directory: str, manifest: str) -> None:
        if os.path.basename(directory) == str(k):
            os.kill(os.getpid(), signal.SIGKILL)
        write_manifest(directory, manifest)
    atomic.write_manifest = dying


def _trace_saves() -> None:
    from train import checkpoint
    save = checkpoint.save

    def traced(mngr, step, *args, **kwargs):
        print(f"EVENT save-start {step}", flush=True)
        save(mngr, step, *args, **kwargs)
        print(f"EVENT save-end {step}", flush=True)
    checkpoint.save = traced


def _unreadable(k: int) -> None:
    """This process finds checkpoint step k changed since it was written."""
    from models import atomic
    check_manifest = atomic.check_manifest

    def failing(directory: str, manifest: str):
        if os.path.basename(directory) == str(k):
            return f"unreadable_step={k} fails this process's integrity check"
        return check_manifest(directory, manifest)
    atomic.check_manifest = failing


def main(workdir: str, data_dir: str, settings: list[str]):
    overrides = {k: json.loads(v) for k, v in (s.split("=", 1) for s in settings)}
    sigterm_at = overrides.pop("sigterm_at", 0)
    step_seconds = overrides.pop("step_seconds", 0.0)
    sigkill_at = overrides.pop("sigkill_at", 0)
    if overrides.pop("trace", False):
        _trace_saves()
    if "sigkill_in_save" in overrides:
        _kill_in_save(overrides.pop("sigkill_in_save"))
    if "unreadable_step" in overrides:
        _unreadable(overrides.pop("unreadable_step"))
    hooks = [lambda step, m: time.sleep(step_seconds)] if step_seconds else []
    if sigterm_at:
        hooks.append(lambda step, m: step == sigterm_at and os.kill(os.getpid(), signal.SIGTERM))
    if sigkill_at:
        hooks.append(lambda step, m: step == sigkill_at and os.kill(os.getpid(), signal.SIGKILL))
    summary = train_and_evaluate(tiny_train_config(data_dir, **overrides), workdir, hooks=hooks)
    print("SUMMARY " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[4:])
