"""One verdict from the ranks of a test that runs as N processes (a distributed test).

Each rank's process runs the test's setup, call and teardown and sends its reports;
``one_verdict`` makes them the test's (``distributed.run_ranks`` asks it):

- every rank passed: rank 0's reports, the other ranks' captured output beside its own;
- a rank failed: the first to fail (its first failed report, or its process's end: a
  crash) is the cause (a rank stopped because another ended, having not failed before,
  never is, unless every failed rank was): its reports,
  each failed one's summary line naming it (``rank 1 failed: ValueError: ...``), and a
  section telling every rank's story (failed too, stopped after it, passed);
- every rank skipped (or every one an expected failure): rank 0's reports;
- ranks that disagree on a skip or an expected failure: one setup error naming them.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import pytest

from ..gpu.health import RunEnd, why_probe
from .results import setup_error_reports

SECTION = "gpu-isolate ranks"


@dataclass(frozen=True)
class RankRun:
    """One rank's part of the test: its reports, and how its process ended."""

    rank: int
    reports: list[pytest.TestReport]
    ended_at: float | None  # time.monotonic() when its process was seen to end
    stopped: bool = False  # stopped because another rank ended first (End.expired "group")
    failed_at: float | None = None  # time.monotonic() when its first failed report came


def state_of(reports: list[pytest.TestReport]) -> str:
    """What became of one rank's test: "failed", "skipped", "xfailed", "xpassed" or "passed"."""
    if any(r.failed for r in reports):
        return "failed"
    expected = any(hasattr(r, "wasxfail") for r in reports)
    if any(r.skipped for r in reports):
        return "xfailed" if expected else "skipped"
    return "xpassed" if expected else "passed"


def cause(runs: list[RankRun]) -> RankRun | None:
    """The rank whose failure is the test's: the first to fail, by its first failed
    report or else the end of its process (a crash); a rank stopped for its group that
    had not failed by itself before only where every failed rank was; None: none failed."""
    failed = [run for run in runs if state_of(run.reports) == "failed"]
    if not failed:
        return None

    def first(run: RankRun) -> tuple[bool, float, int]:
        times = [t for t in (run.failed_at, run.ended_at) if t is not None]
        return (run.stopped and run.failed_at is None, min(times, default=math.inf), run.rank)

    return min(failed, key=first)


def one_verdict(item: pytest.Item, runs: list[RankRun]) -> list[pytest.TestReport]:
    """The test's reports from its ranks' (``runs``, in rank order)."""
    states = {run.rank: state_of(run.reports) for run in runs}
    first = cause(runs)
    if first is not None:
        return _failed(runs, first, states)
    kinds = set(states.values())
    if len(kinds) > 1 and kinds & {"skipped", "xfailed", "xpassed"}:
        told = ", ".join(f"rank {rank} {state}" for rank, state in states.items())
        return setup_error_reports(item, f"gpu-isolate: the ranks disagree: {told}")
    reports = [copy.copy(report) for report in runs[0].reports]
    for report in reports:
        report.sections = list(report.sections)
        for run in runs[1:]:
            report.sections += _sections_of(run, report.when)
    _with_properties(reports, [run for run in runs if run is not runs[0]])
    return reports


def _failed(runs: list[RankRun], cause: RankRun, states: dict[int, str]) -> list[pytest.TestReport]:
    """The cause's reports, its failures named by its rank, every rank's story told."""
    reports = [copy.copy(report) for report in cause.reports]
    for report in reports:
        report.sections = list(report.sections)
        if report.failed:  # its own copy: the rank's reports stay as they came
            report.longrepr = copy.deepcopy(report.longrepr)
            _name_rank(report, cause.rank)
    story = []
    for run in runs:
        if run is cause:
            said = f"failed first: {first_line(run.reports)}"
        elif run.stopped and run.failed_at is None:
            said = f"stopped after rank {cause.rank} failed"
        elif states[run.rank] == "failed":
            said = f"failed too: {first_line(run.reports)}"
        else:
            said = states[run.rank]
        story.append(f"rank {run.rank}: {said}")
    folded = [
        (f"{SECTION}: rank {run.rank}", _tail(run.reports))
        for run in runs
        if run is not cause and states[run.rank] == "failed"
    ]
    for report in reports:  # shown with each failure, the other ranks' failures folded
        if report.failed:
            report.sections += [(SECTION, "\n".join(story)), *folded]
    _with_properties(reports, [run for run in runs if run is not cause])
    return reports


def _with_properties(reports: list[pytest.TestReport], others: list[RankRun]) -> None:
    """Give the test's reports the other ranks' ``record_property`` pairs, each name
    followed by its rank (``loss (rank 1)``), beside those of the rank they came from:
    junit takes them from each report, so each rank's are there once."""
    for report in reports:
        report.user_properties = list(report.user_properties) + [
            (f"{name} (rank {run.rank})", value)
            for run in others
            for theirs in run.reports
            if theirs.when == report.when
            for name, value in theirs.user_properties
        ]


def _sections_of(run: RankRun, when: str) -> list[tuple[str, str]]:
    """Rank ``run``'s captured output of the phase ``when``, its titles naming the rank."""
    found = []
    for report in run.reports:
        if report.when == when:
            found += [(f"{title} (rank {run.rank})", text) for title, text in report.sections]
    return found


FOLDED_LINES = 15  # of another failed rank's failure, under the cause's traceback


def _tail(reports: list[pytest.TestReport]) -> str:
    """The last ``FOLDED_LINES`` of a rank's first failure: where it failed and why (or,
    for a rank stopped with its group, where it waited), its full text in the JSON."""
    for report in reports:
        if report.failed:
            lines = str(report.longrepr).rstrip().splitlines()
            cut = len(lines) - FOLDED_LINES
            head = [f"... ({cut} lines above: the JSON report's ranks)"] if cut > 0 else []
            return "\n".join(head + lines[-FOLDED_LINES:])
    return ""


def first_line(reports: list[pytest.TestReport]) -> str:
    """The summary line of a rank's first failed report."""
    for report in reports:
        if report.failed:
            crash = getattr(report.longrepr, "reprcrash", None)
            text = crash.message if crash is not None else str(report.longrepr)
            return text.strip().splitlines()[0] if text.strip() else "failed"
    return "failed"


def _name_rank(report: pytest.TestReport, rank: int) -> None:
    """Make ``report``'s summary line (its crash message, or its text) name ``rank``."""
    longrepr: Any = report.longrepr
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None:
        crash.message = f"rank {rank} failed: {crash.message}"
    elif isinstance(longrepr, str):
        report.longrepr = f"rank {rank} failed: {longrepr}"


def in_doubt(runs: list[RunEnd], stopped: list[bool]) -> RunEnd:
    """The run of the group's (``runs``, in rank order; ``stopped``: each stopped for its
    group) its GPUs' health is judged by: the first that puts them in doubt (a crash, a
    sticky CUDA error, a bound run out), one that did so itself before one stopped for
    its group; rank 0's where none does."""
    order = sorted(range(len(runs)), key=lambda rank: stopped[rank])
    return next((runs[r] for r in order if why_probe(runs[r]) is not None), runs[0])
