"""A group of processes waited for as one (a distributed test's ranks): the first to end
cuts the others' time to a linger, after which each still running is stopped with its
stack; each process's own bounds still hold; what each sent is kept."""

from __future__ import annotations

import os
import pickle
import time

from pytest_gpuiso.gpu.pool import GpuPool
from pytest_gpuiso.parent.group import wait_group
from pytest_gpuiso.parent.launcher import Launcher
from pytest_gpuiso.parent.prewarm import Prewarmer
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
