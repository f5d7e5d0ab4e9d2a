"""The checkpoint step that processes agree on (train.checkpoint_steps.Agreement), with the
processes played by threads whose gathers meet at a barrier: each checks steps newest first,
lazily, and all of them end on the newest step every one can use, or none, or the same
error. (Two real processes over gloo: test_train_loop.)"""

import threading

import numpy as np
import pytest

from train import checkpoint_steps as steps_lib


class _Verdicts:
    """A process's view: `bad` maps the steps it cannot use to why; `checked` lists the
    steps it was asked about, in the order first asked."""

    def __init__(self, bad: dict[int, str], refuse: int | None = None):
        self.bad, self.refuse, self.checked, self.failed = bad, refuse, [], {}

    def reason(self, step, unverified_ok=False):
        if step not in self.checked:
            self.checked.append(step)
        if step == self.refuse:
            raise steps_lib.CheckpointError(f"step {step} does not fit this run")
        return self.failed.get(step) or self.bad.get(step)

    def fail(self, step, reason):
        self.failed[step] = reason


def _as_processes(monkeypatch, bodies) -> list:
    """Runs each of `bodies` in its own thread as one process, `_gather` meeting at a barrier
    as `process_allgather` does; their results (or the exceptions they raised)."""
    n, rows, barrier, local = len(bodies), {}, threading.Barrier(len(bodies), timeout=20), \
        threading.local()

    def gather(row):
        rows[local.index] = list(row)
        barrier.wait()
        every = np.asarray([rows[p] for p in range(n)], np.int32)
        barrier.wait()
        return every

    monkeypatch.setattr(steps_lib, "_gather", gather)
    results = [None] * n

    def run(i):
        local.index = i
        try:
            results[i] = bodies[i]()
        except Exception as e:  # noqa: BLE001 (returned to the test)
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a process waits in a gather alone"
    return results


def _agree(verdicts, steps=(9, 6, 3), restore_fails=None):
    """A process's whole search: the steps it settles on, None when there is none."""
    def body():
        agreement = steps_lib.Agreement(list(steps), verdicts)
        while (step := agreement.next()) is not None:
            fails = restore_fails is not None and step in restore_fails
            if agreement.settle(step, "orbax cannot read it" if fails else None):
                return step
        return None
    return body


def test_processes_agree_on_the_newest_step_all_can_use(monkeypatch):
    """Process 0 cannot use 9, process 1 cannot use 6: 9 -> 6 -> 3, each checking a step
    once, and none checking below what they agree on."""
    views = [_Verdicts({9: "changed"}), _Verdicts({6: "changed"})]
    assert _as_processes(monkeypatch, [_agree(v) for v in views]) == [3, 3]
    assert [v.checked for v in views] == [[9, 6, 3], [9, 6, 3]]
    every = [_Verdicts({}), _Verdicts({})]
    assert _as_processes(monkeypatch, [_agree(v) for v in every]) == [9, 9]
    assert [v.checked for v in every] == [[9], [9]]


def test_a_step_one_process_cannot_restore_is_passed_over_by_all(monkeypatch):
    views = [_Verdicts({}), _Verdicts({})]
    got = _as_processes(monkeypatch, [_agree(views[0]), _agree(views[1], restore_fails={9})])
    assert got == [6, 6]
    assert views[1].failed == {9: "orbax cannot read it"} and views[0].failed == {}


def test_no_step_for_one_process_is_no_step_for_any(monkeypatch):
    views = [_Verdicts({}), _Verdicts({9: "a", 6: "b", 3: "c"})]
    assert _as_processes(monkeypatch, [_agree(v) for v in views]) == [None, None]
    seen_none = [_Verdicts({}), _Verdicts({})]
    got = _as_processes(monkeypatch, [_agree(seen_none[0]), _agree(seen_none[1], steps=())])
    assert got == [None, None]


def test_a_step_of_another_model_stops_every_process_with_its_message(monkeypatch):
    views = [_Verdicts({}), _Verdicts({9: "changed"}, refuse=6)]
    got = _as_processes(monkeypatch, [_agree(v) for v in views])
    assert all(isinstance(e, steps_lib.CheckpointError) for e in got)
    assert [str(e) for e in got] == ["step 6 does not fit this run"] * 2


def test_one_process_agrees_with_itself_without_collectives():
    view = _Verdicts({9: "changed"})
    assert _agree(view)() == 6 and view.checked == [9, 6]
    with pytest.raises(steps_lib.CheckpointError, match="step 9 does not fit"):
        _agree(_Verdicts({}, refuse=9))()


def test_the_lead_learns_one_process_reason_for_each_newer_step(monkeypatch):
    """Each step newer than the agreed one with the lowest numbered process's reason, and
    the processes that see no checkpoint; long reasons in any script fit the exchange."""
    monkeypatch.setattr(steps_lib.jax, "process_count", lambda: 2)
    views = [_Verdicts({}), _Verdicts({})]
    views[0].reasons = {9: "changed here", 3: "older than the agreed step"}
    views[1].reasons = {9: "changed there", 6: "cut short"}
    got = _as_processes(monkeypatch, [lambda: steps_lib.shared_reasons(views[0], 3, 3),
                                      lambda: steps_lib.shared_reasons(views[1], 3, 0)])
    want = {9: "process 0: changed here", 6: "process 1: cut short"}
    assert got == [(want, [1]), (want, [1])]
    views[1].reasons = {s: "é" * 400 for s in range(20)}
    got = _as_processes(monkeypatch, [lambda: steps_lib.shared_reasons(views[0], -1, 3),
                                      lambda: steps_lib.shared_reasons(views[1], -1, 20)])
    assert got[0] == got[1] and got[0][0][19] == "process 1: " + "é" * 300
