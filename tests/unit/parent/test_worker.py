"""The worker's door, without starting a process: what its verbs decide by themselves
(prewarming off, prewarming turned off after a stale process, notices said once)."""

from __future__ import annotations

from types import SimpleNamespace

from pytest_gpuiso.parent.launcher import Launcher
from pytest_gpuiso.parent.prewarm import Prewarmer
from pytest_gpuiso.parent.worker import PREWARM_OFF, Worker


def _worker(tmp_path, depth: int) -> Worker:
    launcher = Launcher(tmp_path, start="spawn")
    prewarmer = Prewarmer(launcher, depth)
    if not depth:
        prewarmer.disabled = PREWARM_OFF
    return Worker(launcher, prewarmer, None)


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
