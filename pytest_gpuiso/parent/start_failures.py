"""Tests' processes that could not start, as pytest's process counts them.

A process that said why it ended before its test began (an error: the project's
configuration, a plugin, a conftest in that process) failed to start: its own words are
its test's error (``StartFailure``), and another process would fail alike, so none is
started in its place. The session keeps count (``note``): the same failure twice in a
row, and the tests after fail at once with it; where no test's process began its test
yet, none can, and the session stops with one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import pytest

from ..wire import frames
from .outcome import Outcome
from .results import setup_error_reports

_PREFIX = "internal error in the isolated process: "  # child.bootstrap.internal_error's


@dataclass(frozen=True)
class StartFailure:
    """Why a test's process ended before its test began, in the process's own words."""

    line: str  # what went wrong, in one line
    text: str  # everything it said (the traceback)

    def reports(self, item: pytest.Item) -> list[pytest.TestReport]:
        """The test's reports: an error at setup, the line, then the traceback (with -v)
        or where to see it."""
        verbose = item.config.get_verbosity() > 0
        more = self.text if verbose else "(-v shows the traceback of the test's process)"
        return setup_error_reports(
            item, f"the test's process could not start: {self.line}\n\n{more}"
        )


def of(outcome: Outcome) -> StartFailure | None:
    """The process's own error when it ended, unkilled and in time, before its test began
    and before it reported anything; None otherwise (the test's outcome is its own)."""
    if outcome.end.began is not None or outcome.end.timed_out or outcome.end.signal_name:
        return None
    if outcome.sent.reports or not outcome.sent.errors:
        return None
    if any(error.startswith(frames.UNCOLLECTED) for error in outcome.sent.errors):
        return None  # it started, and could not collect its test: the test's own error
    text = "\n\n".join(outcome.sent.errors)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return StartFailure("(it said nothing more)", text)
    line = lines[0].removeprefix(_PREFIX)
    if line.endswith(":"):  # a heading (pytest's INTERNALERROR): the error is its last line
        line = lines[-1].removeprefix("INTERNALERROR>").strip().removeprefix("E").strip()
    return StartFailure(line, text)


class Count(Protocol):
    """Where the session keeps count (``session.State``)."""

    began: bool  # a test's process began its test in this session
    start_failed: StartFailure | None  # the last test's process could not start
    cannot_start: StartFailure | None  # the same twice in a row: later tests fail at once


def note(count: Count, outcome: Outcome, failure: StartFailure | None) -> str | None:
    """Count one test's process (``failure``: ``of(outcome)``). Returns why the session
    stops after this test (no test's process can start), or None."""
    if failure is None:
        count.began = count.began or outcome.end.began is not None
        count.start_failed = None
        return None
    again = count.start_failed is not None and count.start_failed.line == failure.line
    count.start_failed = failure
    if not again:
        return None
    count.cannot_start = failure
    return None if count.began else f"gpu-isolate: no test's process can start: {failure.line}"
