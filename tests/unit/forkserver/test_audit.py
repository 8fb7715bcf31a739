"""Whether the template may be forked: what its configuring and collecting opened
outside its memory would be shared by every test's process forked from it (a file's
offset, a mapping). A log file opened for writing only is fine, and so are the
descriptors each test's process takes over as its own (pytest's capture files)."""

from __future__ import annotations

import mmap
import os

import pytest

from pytest_gpuiso.forkserver import audit


@pytest.fixture(autouse=True)
def _no_children(monkeypatch):
    monkeypatch.setattr(audit, "live_descendants", list)  # other tests' children are not ours


def test_nothing_new_is_fit():
    assert audit.left_outside(audit.snapshot(), None) is None


def test_a_file_opened_for_reading_is_named_with_its_descriptor(tmp_path):
    data = tmp_path / "data.json"
    data.write_text("{}")
    before = audit.snapshot()
    with open(data) as f:
        problem = audit.left_outside(before, None)
        assert problem == f"it opened {data} for reading (descriptor {f.fileno()})"


def test_a_log_opened_for_writing_only_is_fit(tmp_path):
    before = audit.snapshot()
    with open(tmp_path / "run.log", "a"):
        assert audit.left_outside(before, None) is None


def test_descriptors_each_test_takes_over_are_kept_out(tmp_path):
    before = audit.snapshot()
    with open(tmp_path / "capture", "w+b") as f:
        assert audit.left_outside(before, None) is not None
        assert audit.left_outside(before, None, {f.fileno()}) is None


def test_a_shared_mapping_is_named():
    before = audit.snapshot()
    with mmap.mmap(-1, 4096, flags=mmap.MAP_SHARED):
        problem = audit.left_outside(before, None)
    assert problem is not None and problem.startswith("it made a shared mapping of "), problem


def test_a_started_process_comes_first(monkeypatch):
    monkeypatch.setattr(audit, "live_descendants", lambda: [os.getpid() + 1, os.getpid() + 2])
    problem = audit.left_outside(audit.snapshot(), None)
    assert problem == f"it started process {os.getpid() + 1} and 1 more"
