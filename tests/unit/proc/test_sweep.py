"""The process sweep's own paths, on real child processes of this test: what it reports
for a process it cannot kill or may not signal (signals swallowed or refused through
monkeypatched psutil). Whole sessions with leftovers are in test_leaks.py.

The sleeper carries a call's mark, and the sweeps here take only what carries it: this
xdist worker may be a child subreaper (after a run_isolated test), and the orphans of
other tests' processes that it adopts meanwhile are not this test's."""

from __future__ import annotations

import os
import subprocess
import time
import uuid

import psutil

from pytest_gpuiso.leaks import RunInfo, process

MARK = process.Mark(uuid.uuid4().hex)


def _sleeper():
    """A ``sleep 60`` child with ``MARK``, returned once it runs as such (not mid-exec)."""
    sleeper = subprocess.Popen(["sleep", "60"], env={**os.environ, **MARK.env})
    deadline = time.monotonic() + 10
    while psutil.Process(sleeper.pid).cmdline() != ["sleep", "60"]:
        assert time.monotonic() < deadline, "sleep did not start"
        time.sleep(0.01)
    return sleeper


def test_a_leftover_that_survives_sigkill_is_reported_as_not_killed(monkeypatch) -> None:
    """A leftover the sweep cannot kill (another user's process, say: here its signals
    are swallowed) is still reported, and the report does not claim it was killed."""
    before = process.descendant_keys()
    sleeper = _sleeper()
    monkeypatch.setattr(psutil.Process, "terminate", lambda self: None)
    monkeypatch.setattr(psutil.Process, "kill", lambda self: None)
    monkeypatch.setattr(process, "REAP_WAIT", 0.2)
    try:
        probe = process.ProcessProbe(mark=MARK)
        [leak] = probe.check(before, RunInfo(0, time.time(), time.time(), 0.1))
        assert leak.fields == {"pid": sleeper.pid, "cmdline": "sleep 60"}
        assert leak.detail == (
            f"process {sleeper.pid} still running after the test ended (not killed: it "
            "survived SIGKILL (another user's process?)): sleep 60"
        )
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_late_process_that_may_not_be_signalled_is_reported_not_waited_for(
    monkeypatch,
) -> None:
    """What a listing finds after the leftovers were killed is stopped; one this process
    may not signal (another user's) is reported as not killed and left out of the kill
    and the wait, instead of costing REAP_WAIT every round or being dropped."""
    seen = process.descendant_keys()
    sleeper = _sleeper()

    def refuse(self):
        raise psutil.AccessDenied(self.pid)

    monkeypatch.setattr(psutil.Process, "suspend", refuse)
    try:
        late, found, grown = process._stop_late(seen, frozenset(), settle=False, mark=MARK)
        assert late == []
        assert found == [
            {"pid": sleeper.pid, "cmdline": "sleep 60", "not_killed": "not allowed to signal it"}
        ]
        assert {pid for pid, _ in grown - seen} == {sleeper.pid}
        assert sleeper.poll() is None  # neither stopped nor killed
    finally:
        sleeper.kill()
        sleeper.wait()
