"""A test's process that could not start, as pytest's process counts it: its own words
(the first line; a pytest INTERNALERROR's last), never a guess; the same failure twice
in a row fails the tests after at once, and a session where none began stops."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pytest_gpuiso.parent import start_failures
from pytest_gpuiso.parent.outcome import End, Outcome, Sent
from pytest_gpuiso.wire import frames


def _outcome(expired: str | None = None, began: float | None = None, **sent) -> Outcome:
    """A process (exit status 1) that sent ``sent`` (``Sent``'s fields)."""
    return Outcome(End(4242, 1, expired, 0.2, began), sent=Sent(**sent))


def test_the_processs_first_line_is_the_failure():
    error = "internal error in the isolated process: RuntimeError: no plugin here\nTraceback..."
    failure = start_failures.of(_outcome(errors=[error]))
    assert failure is not None
    assert failure.line == "RuntimeError: no plugin here"
    assert "Traceback" in failure.text


def test_a_heading_gives_way_to_pytests_last_internalerror_line():
    said = (
        "INTERNALERROR> Traceback (most recent call last):\nINTERNALERROR> E   ValueError: bad ini"
    )
    failure = start_failures.of(_outcome(errors=[said]))
    assert failure is not None and failure.line == "ValueError: bad ini"


@pytest.mark.parametrize(
    "fields",
    [
        {"began": 0.1, "errors": ["x"]},  # its test began: the outcome is the test's
        {"expired": "startup", "errors": ["x"]},  # stopped: not its own words
        {"errors": []},  # it said nothing: nothing to repeat
        {"errors": [f"{frames.UNCOLLECTED}'t.py::x': boom"]},  # it started, and could not collect
        {"errors": ["x"], "reports": [{"when": "setup"}]},  # it reported: the test's own
    ],
    ids=["began", "timed-out", "silent", "uncollected", "reported"],
)
def test_only_a_process_that_ended_by_itself_before_its_test_failed_to_start(fields):
    assert start_failures.of(_outcome(**fields)) is None


def _count() -> SimpleNamespace:
    return SimpleNamespace(began=False, start_failed=None, cannot_start=None)


def test_the_same_failure_twice_fails_the_rest_and_stops_a_session_where_none_began():
    count, failure = _count(), start_failures.StartFailure("E: bad", "E: bad\n...")
    assert start_failures.note(count, _outcome(errors=["E: bad"]), failure) is None
    assert count.cannot_start is None  # once may be this test's own bad luck
    halt = start_failures.note(count, _outcome(errors=["E: bad"]), failure)
    assert count.cannot_start == failure
    assert halt == "gpu-isolate: no test's process can start: E: bad"


def test_once_a_test_began_the_session_goes_on_and_a_different_failure_starts_over():
    count = _count()
    start_failures.note(count, _outcome(began=0.1), None)
    assert count.began
    first = start_failures.StartFailure("E: one", "")
    second = start_failures.StartFailure("E: two", "")
    assert start_failures.note(count, _outcome(errors=["E: one"]), first) is None
    assert start_failures.note(count, _outcome(errors=["E: two"]), second) is None
    assert count.cannot_start is None  # two different failures in a row: not the same cause
    assert start_failures.note(count, _outcome(errors=["E: two"]), second) is None  # no halt
    assert count.cannot_start == second  # but the tests after fail at once
