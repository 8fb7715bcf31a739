"""A REPORT frame's data, as pytest's process checks it before pytest rebuilds it: a
report of another test, or of a shape pytest's reporting cannot take, is named in one
line; a report's text with no crash line renders whole and adds nothing to the summary."""

from __future__ import annotations

import io

import pytest
from _pytest._io import TerminalWriter

from pytest_gpuiso.parent.results import TextRepr, report_problem

NODEID = "t.py::test_a"


def _data(**changes) -> dict:
    data = {
        "$report_type": "TestReport",
        "nodeid": NODEID,
        "when": "call",
        "outcome": "passed",
        "location": ["t.py", 3, "test_a"],
        "keywords": {"test_a": 1},
        "sections": [],
        "user_properties": [],
        "longrepr": None,
        "duration": 0.01,
    }
    return data | changes


def test_a_report_of_this_test_in_pytests_shape_is_taken():
    assert report_problem(_data(), NODEID) is None


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"nodeid": "t.py::test_other"}, "nodeid 't.py::test_other', not this test's"),
        ({"$report_type": "CollectReport"}, "$report_type 'CollectReport', not TestReport"),
        ({"when": "later"}, "its when is 'later'"),
        ({"outcome": "won"}, "its outcome is 'won'"),
        ({"duration": float("nan")}, "its duration is nan"),
        ({"location": ["t.py", "3", "test_a"]}, "its location is"),
    ],
    ids=["forged-nodeid", "collect-report", "phase", "outcome", "nan", "location"],
)
def test_a_report_pytest_cannot_take_is_named_in_one_line(changes, named):
    problem = report_problem(_data(**changes), NODEID)
    assert problem is not None and problem.startswith(named), problem
    assert "\n" not in problem


def test_a_text_with_no_crash_line_renders_whole_and_has_no_crash_message():
    text = "file t.py, line 3\n  def test_a(tmp_path):\nE       fixture 'tmp_path' not found"
    repr_ = TextRepr(text)
    out = io.StringIO()
    repr_.toterminal(TerminalWriter(out))
    assert out.getvalue().splitlines() == text.splitlines()
    assert str(repr_).splitlines() == text.splitlines()
    assert not hasattr(repr_, "reprcrash")  # pytest's short summary then quotes nothing
