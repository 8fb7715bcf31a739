"""A group of processes waited for as one (a distributed test's ranks): the first to end
cuts the others' time to a linger, after which each still running is stopped with its
stack; each process's own bounds still hold; what each sent is kept."""

from __future__ import annotations

import os
import pickle
import re
import signal
import time
from pathlib import Path

import psutil

from pytest_gpuiso.gpu.pool import GpuPool
from pytest_gpuiso.parent import group as group_module
from pytest_gpuiso.parent.group import wait_group
from pytest_gpuiso.parent.launcher import Launcher
from pytest_gpuiso.parent.prewarm import Prewarmer
from pytest_gpuiso.parent.supervisor import Running
from pytest_gpuiso.parent.watch import Bounds
from pytest_gpuiso.parent.worker import PREWARM_OFF, Worker
from pytest_gpuiso.settings import Settings
from pytest_gpuiso.wire.jobs import CallJob


def _worker(tmp_path) -> Worker:
    launcher = Launcher(tmp_path, start="spawn")
    prewarmer = Prewarmer(launcher, 0)
    prewarmer.disabled = PREWARM_OFF
    settings = Settings("all", 900.0, "", 5.0, None, start="spawn", prewarm=0)
    return Worker(settings, GpuPool(), (), launcher, prewarmer, None)


def _rank_job() -> str:
    """Rank 1 fails at once; every other rank waits for a peer that never comes."""
    rank = os.environ["RANK"]
    if rank == "1":
        raise ValueError("rank 1 failed")
    if rank == "sleep":
        time.sleep(600)
    return rank


def _stuck_in_a_collective() -> None:
    time.sleep(600)


def _run(tmp_path, func, ranks: list[str], bounds: Bounds, linger: float):
    worker = _worker(tmp_path)
    try:
        group = worker.group([CallJob(func, (), {})] * len(ranks), [{"RANK": r} for r in ranks])
        runnings = [worker.go(started, {}, (), bounds) for started in group]
        return wait_group(runnings, linger)
    finally:
        worker.launcher.close()


def test_a_rank_that_waits_for_a_failed_peer_is_stopped_after_the_linger_with_its_stack(
    tmp_path,
):
    failed, stuck = _run(tmp_path, _rank_job, ["1", "sleep"], Bounds(300, 120, 1), linger=1)
    assert failed.ended_at is not None
    assert failed.outcome.end.expired is None
    assert failed.outcome.sent.exceptions  # its ValueError came back
    assert stuck.ended_at is None
    assert stuck.outcome.end.expired == "group"  # stopped for its group, not its timeout
    assert "_rank_job" in stuck.outcome.end.stack


def test_ranks_that_all_end_are_each_waited_for_in_order_with_what_they_sent(tmp_path):
    ended = _run(tmp_path, _rank_job, ["0", "2", "3"], Bounds(300, 120, 1), linger=30)
    assert [pickle.loads(e.outcome.sent.results[0]) for e in ended] == ["0", "2", "3"]
    assert all(e.ended_at is not None and e.outcome.end.expired is None for e in ended)


def test_a_group_where_none_ends_is_stopped_when_the_first_ranks_timeout_runs_out(tmp_path):
    """The first rank past its own timeout is stopped for it, the others with it (for
    their group, unless their own ran out too by then), long before the linger."""
    ended = _run(tmp_path, _stuck_in_a_collective, ["0", "1"], Bounds(1, 120, 1), linger=600)
    expired = [e.outcome.end.expired for e in ended]
    assert "test" in expired and set(expired) <= {"test", "group"}, expired
    assert all(e.ended_at is None for e in ended)
    assert all("_stuck_in_a_collective" in e.outcome.end.stack for e in ended)


def _ignores_sigterm() -> None:
    """Rank 1 fails at once; the others note when SIGTERM came, ignore it and wait on."""
    rank = os.environ["RANK"]
    if rank == "1":
        raise ValueError("rank 1 failed")
    stamps = Path(os.environ["STAMPS"])

    def noted(signum, frame):
        (stamps / f"term-{rank}").write_text(repr(time.monotonic()))

    signal.signal(signal.SIGTERM, noted)
    while True:
        time.sleep(600)  # a collective that never completes


def test_ranks_left_waiting_are_stopped_together_each_with_its_stack_and_threads(tmp_path):
    """Three ranks that ignore SIGTERM: each got it before any was killed (one grace for
    the group, not one a rank), each is stopped for its group with its Python stack and
    where its threads wait in the kernel."""
    stamps = tmp_path / "stamps"
    stamps.mkdir()
    worker = _worker(tmp_path)
    ranks = ["0", "1", "2", "3"]
    try:
        jobs = [CallJob(_ignores_sigterm, (), {})] * len(ranks)
        group = worker.group(jobs, [{"RANK": r, "STAMPS": str(stamps)} for r in ranks])
        runnings = [worker.go(s, {}, (), Bounds(300, 120, 3)) for s in group]
        ended = wait_group(runnings, 0.5)
    finally:
        worker.launcher.close()
    assert [e.outcome.end.expired for e in ended] == ["group", None, "group", "group"]
    terms = sorted(float((stamps / f"term-{r}").read_text()) for r in ("0", "2", "3"))
    assert terms[-1] - terms[0] < 3, terms  # stopped one after the other: 3 s (grace) apart
    for e in (ended[0], ended[2], ended[3]):
        assert e.outcome.end.signal_name == "SIGKILL"  # it ignored SIGTERM for the grace
        stack = e.outcome.end.stack
        assert "_ignores_sigterm" in stack, stack
        assert "Threads in the kernel (/proc/PID/task/*/wchan):" in stack, stack
        assert re.search(r"thread \d+ \(.+\): state [A-Z]", stack), stack


def test_ctrl_c_in_the_groups_wait_stops_every_rank_and_goes_on_up(tmp_path, monkeypatch):
    """Ctrl-C while the group is waited for: every rank is stopped, reaped and checked
    (``Running.wait`` for each), then KeyboardInterrupt goes on up, as in-process."""

    def interrupted(seen, stop, *, first):
        raise KeyboardInterrupt

    waited = []
    real_wait = Running.wait

    def wait(self):
        outcome = real_wait(self)
        waited.append((self.started.proc.pid, outcome.end.expired))
        return outcome

    monkeypatch.setattr(group_module, "_until", interrupted)
    monkeypatch.setattr(Running, "wait", wait)
    started = time.monotonic()
    try:
        _run(tmp_path, _stuck_in_a_collective, ["0", "1"], Bounds(300, 120, 5), linger=600)
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("KeyboardInterrupt did not go on up")
    assert time.monotonic() - started < 30  # stopped, not waited for to the timeout
    assert [expired for _, expired in waited] == ["group", "group"], waited
    assert not any(psutil.pid_exists(pid) for pid, _ in waited)  # reaped: no zombie left
