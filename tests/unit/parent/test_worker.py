"""The worker's door: what its verbs decide by themselves (prewarming off, prewarming
turned off after a stale process, notices said once), and a group of processes started
together (spawned: what a distributed test's ranks will ask for)."""

from __future__ import annotations

import os
import pickle
from multiprocessing.connection import wait
from types import SimpleNamespace

import pytest

from pytest_gpuiso.gpu.pool import GpuPool
from pytest_gpuiso.parent.launcher import Launcher, StartError
from pytest_gpuiso.parent.prewarm import Prewarmer
from pytest_gpuiso.parent.watch import Bounds
from pytest_gpuiso.parent.worker import PREWARM_OFF, Worker
from pytest_gpuiso.settings import Settings
from pytest_gpuiso.wire.jobs import CallJob


def _worker(tmp_path, depth: int) -> Worker:
    launcher = Launcher(tmp_path, start="spawn")
    prewarmer = Prewarmer(launcher, depth)
    if not depth:
        prewarmer.disabled = PREWARM_OFF
    settings = Settings("all", 900.0, "", 5.0, None, start="spawn", prewarm=depth)
    return Worker(settings, GpuPool(), (), launcher, prewarmer, None)


def test_with_prewarming_off_nothing_starts_ahead(tmp_path):
    worker = _worker(tmp_path, 0)
    items = [SimpleNamespace(nodeid=f"t.py::test_{i}") for i in range(3)]
    assert worker.ahead == 0
    assert worker.upcoming(items, items[1], parallel=False) == []
    assert worker.waiting(job=None) is None  # no process started while its lease is awaited
    assert worker.take("t.py::test_1") is None


def test_the_next_tests_are_those_after_nextitem_and_under_xdist_only_it(tmp_path):
    worker = _worker(tmp_path, 2)
    items = [SimpleNamespace(nodeid=f"t.py::test_{i}") for i in range(4)]
    assert worker.ahead == 2
    assert worker.upcoming(items, items[1], parallel=False) == items[1:]
    assert worker.upcoming(items, items[1], parallel=True) == [items[1]]
    assert worker.upcoming(items, None, parallel=False) == []


def test_a_stale_process_turns_prewarming_off_and_each_notice_is_said_once(tmp_path):
    worker = _worker(tmp_path, 2)
    items = [SimpleNamespace(nodeid=f"t.py::test_{i}") for i in range(2)]
    worker.prewarmer.stale = "a conftest initialised CUDA"  # what ``again`` learns from
    worker.notice("prewarming stops: a conftest initialised CUDA")
    assert worker.changed() == ["prewarming stops: a conftest initialised CUDA"]
    assert worker.prewarmer.disabled == "a conftest initialised CUDA"
    assert worker.upcoming(items, items[0], parallel=False) == []
    assert worker.changed() == []


def _rank() -> tuple[int, str]:
    return os.getpid(), os.environ.get("RANK", "")


def test_a_group_of_processes_starts_together_each_with_its_environment(tmp_path):
    """N processes for one job: all started before any is waited for, each alive and
    waiting for its go, each with its own environment; each then runs the job."""
    worker = _worker(tmp_path, 0)
    try:
        group = worker.group([CallJob(_rank, (), {})] * 3, [{"RANK": str(r)} for r in range(3)])
        assert len({s.pid for s in group}) == 3
        assert not wait([s.sentinel for s in group], 0)  # all alive, none ran yet
        seen = []
        for started in group:
            outcome = worker.go(started, {}, (), Bounds(30, 60, 1)).wait()
            seen.append(pickle.loads(outcome.sent.results[0]))
        assert [rank for _, rank in seen] == ["0", "1", "2"]
        assert [pid for pid, _ in seen] == [s.pid for s in group]
    finally:
        worker.launcher.close()


def test_a_group_that_cannot_start_whole_leaves_no_process(tmp_path):
    worker = _worker(tmp_path, 0)
    try:
        with pytest.raises(StartError, match="could not start the isolated process"):
            worker.group([CallJob(lambda: None, (), {})] * 2, [{}, {}])  # a lambda does not pickle
        assert worker.launcher.live == {}
    finally:
        worker.launcher.close()
