"""The partial report a killed session leaves: written at each test's start and end, at a
pace its size allows, and never missing the test that runs now."""

from __future__ import annotations

import itertools
import json
import time
from types import SimpleNamespace

import pytest

from pytest_gpuiso import recorder as recorder_module
from pytest_gpuiso.reports import files
from tests.helpers import wait_until


def _recorder(tmp_path, monkeypatch, write_seconds):
    """A controller's Recorder whose report takes ``write_seconds`` to write (a large
    report, a slow disk)."""
    path = tmp_path / "report.json"
    controller = SimpleNamespace(report_path=path, records=[])
    config = SimpleNamespace(invocation_params=SimpleNamespace(args=("tests",)))
    real = files.write_json
    writes = []

    def slow_write(*args, **kwargs):
        time.sleep(write_seconds)
        real(*args, **kwargs)
        writes.append(json.loads(path.read_text())["session"]["running"])

    monkeypatch.setattr(files, "write_json", slow_write)
    return recorder_module.Recorder(config, SimpleNamespace(), controller), path, writes


def _running(path):
    return json.loads(path.read_text())["session"]["running"]


def test_a_held_back_write_names_the_test_that_runs_now(tmp_path, monkeypatch):
    """A test that starts while the report may not be written yet (the last write was
    slow) is named by a later write all the same, though no other test starts or ends (it
    hangs until the session is killed)."""
    recorder, path, writes = _recorder(tmp_path, monkeypatch, write_seconds=0.05)
    recorder.pytest_runtest_logstart("t.py::test_quick")
    recorder.pytest_runtest_logfinish("t.py::test_quick")  # held back: 10 x 50 ms to wait
    recorder.pytest_runtest_logstart("t.py::test_hangs")  # held back too
    assert writes == [["t.py::test_quick"]]
    wait_until(lambda: writes[-1] == ["t.py::test_hangs"], "the held-back write")
    assert _running(path) == ["t.py::test_hangs"]
    assert len(writes) == 2  # one write for both held-back events, not one each


def test_a_fast_report_is_written_at_each_start_and_end(tmp_path, monkeypatch):
    """Each write takes 1 ms by the recorder's clock (a loaded machine's real clock may
    make a write of this tiny report take over the 20 ms that hold the next one back)."""
    recorder, path, writes = _recorder(tmp_path, monkeypatch, write_seconds=0)
    ticks = itertools.count(100.0, 0.001)
    clock = SimpleNamespace(monotonic=lambda: next(ticks), time=time.time)
    monkeypatch.setattr(recorder_module, "time", clock)
    recorder.pytest_runtest_logstart("t.py::a")
    recorder.pytest_runtest_logfinish("t.py::a")
    recorder.pytest_runtest_logstart("t.py::b")
    assert writes == [["t.py::a"], [], ["t.py::b"]]
    assert recorder.later is None


def test_nothing_partial_is_written_after_the_final_report(tmp_path, monkeypatch):
    """The session ends while a write is held back: the timer is cancelled, so the final
    report is not overwritten by a partial one."""
    recorder, path, writes = _recorder(tmp_path, monkeypatch, write_seconds=0.05)
    recorder.pytest_runtest_logstart("t.py::a")
    recorder.pytest_runtest_logfinish("t.py::a")
    timer = recorder.later
    assert timer is not None
    with recorder.lock:
        recorder.closed = True
        timer.cancel()
    timer.join(5)
    time.sleep(0.6)  # past the pace's wait
    recorder._save_partial()
    assert writes == [["t.py::a"]]


@pytest.mark.parametrize("controller", [None, SimpleNamespace(report_path=None, records=[])])
def test_no_report_no_partial_writes(tmp_path, controller):
    config = SimpleNamespace(invocation_params=SimpleNamespace(args=()))
    recorder = recorder_module.Recorder(config, SimpleNamespace(), controller)
    recorder.pytest_runtest_logstart("t.py::a")
    assert recorder.later is None and list(tmp_path.iterdir()) == []
