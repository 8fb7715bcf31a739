"""Each isolated test's JSON record, built once, after every report of the test is final,
and put on its last report (``reports.record`` reads it)."""

from __future__ import annotations

from typing import Any, Protocol

import pytest

from ..gpu.health import Checkup
from ..leaks import Verdict
from ..reports.record import RECORD_ATTR, RankEntry, Record
from ..settings import IsolationSpec
from .outcome import Outcome


def final_outcome(reports: list[pytest.TestReport]) -> str:
    """The test's one-word outcome, by one rule for every path.

    A failed call is ``failed``; any other failed phase (setup, teardown: the test's
    own or the parent's, a leak that fails the test) is ``error``, as pytest counts
    it; otherwise what the call (or a skipped setup) says.
    """
    by_phase = {r.when: r for r in reports}
    call = by_phase.get("call")
    if call is not None and call.failed:
        return "failed"
    if any(r.failed for r in reports):
        return "error"
    if call is not None:
        if hasattr(call, "wasxfail"):
            return "xfailed" if call.skipped else "xpassed"
        if call.skipped:
            return "skipped"
    setup = by_phase.get("setup")
    if setup is not None and setup.skipped:
        return "xfailed" if hasattr(setup, "wasxfail") else "skipped"
    return "passed"


class Run(Protocol):
    """What a record is made of: one attempt of a test (``verdict.Ran``)."""

    reports: list[pytest.TestReport]
    spec: IsolationSpec | None
    outcome: Outcome | None  # None: no process ran (a bad marker, a lease timeout, a skip)
    lease: Any
    verdict: Verdict | None
    peak: int | None  # the most GPU memory its processes held on one GPU (NVML)
    port: int | None  # its MASTER_PORT
    health: Checkup | None  # its GPUs' probe after it (None: not probed)
    leak_checks: tuple[str, ...]
    folded: int  # its warnings an earlier test's process gave (not replayed again)
    gpu_notes: tuple[str, ...]  # GPU holders on its GPUs that were not its: not blamed
    start_failure: Any  # its process could not start (``supervisor.StartFailure``), or None
    ranks: tuple[RankEntry, ...]  # a distributed test's ranks (none: one process)


def build_record(
    nodeid: str,
    location: tuple[str, int | None, str] | None,
    run: Run,
    attempt: int = 1,
    rerun: bool = False,
) -> Record:
    """One test's entry in the JSON report (schema version 1): one per attempt.

    ``attempt`` counts a test's runs from 1 (pytest-rerunfailures: a fresh process
    each); ``rerun``: this attempt failed and the test ran again (outcome "rerun").
    """
    reports, outcome, verdict = run.reports, run.outcome, run.verdict
    # Interrupted before its call was reported: it neither passed nor failed.
    stopped = (
        outcome is not None and outcome.sent.interrupted and all(r.when != "call" for r in reports)
    )
    result = "rerun" if rerun else "interrupted" if stopped else final_outcome(reports)
    record: Record = {
        "nodeid": nodeid,
        "outcome": result,
        "attempt": attempt,
        # What the test ran (setup, call, teardown), as pytest and junit count it; a
        # timeout or crash counts until the process was stopped or ended.
        "duration": round(sum(r.duration for r in reports), 6) if outcome else 0.0,
        **_process_fields(outcome, run.spec),
        "leaks": verdict.records if verdict is not None else [],
        "leak_checks": list(run.leak_checks),  # the kinds checked after it (none: no check ran)
        "start": {
            "method": outcome.launch.method if outcome else None,
            "prewarmed": outcome.launch.prewarmed if outcome else False,
            "collected": outcome.launch.collected if outcome else False,
            "uncollected": outcome.launch.uncollected if outcome else None,
        },
    }
    failure = run.start_failure
    if failure is not None:  # its process's own words; "tried": false, none was started
        record["start"].update(error=failure.line, traceback=failure.text, tried=bool(outcome))
    if location is not None and location[1] is not None:  # a file and line: where it is
        record["location"] = {"file": location[0], "line": location[1] + 1}
    record.update(_optional_fields(run))
    return record


def _process_fields(outcome: Outcome | None, spec: IsolationSpec | None) -> Record:
    """How the test's process ran and ended (none: it never ran)."""
    if outcome is None:
        return {
            "startup": None,
            "wall": 0.0,
            "pid": None,
            "timeout": None,
            "startup_timeout": None,
            "exit": {"code": None, "signal": None, "timed_out": False, "expired": None},
            "escaped": [],
        }
    ended = outcome.end
    return {
        # Seconds from the test's turn until its protocol began (start-up; None: never),
        # and until its process had ended.
        "startup": None if ended.began is None else round(ended.began, 6),
        "wall": round(ended.duration, 6),
        "pid": ended.pid,
        "timeout": spec.timeout if spec else None,
        "startup_timeout": spec.startup_timeout if spec else None,
        "exit": {
            "code": ended.exitcode,
            "signal": ended.signal_name,
            "timed_out": ended.timed_out,
            # which bound stopped it: "startup", "test" (its timeout) or "exit"; None
            "expired": ended.expired,
        },
        "escaped": list(ended.escaped),
    }


def _optional_fields(run: Run) -> Record:
    """The fields a record has only where they apply: fixtures set up anew, CUDA loaded
    without a GPU, its port, its GPUs and their health, warnings folded, GPU notes."""
    outcome, lease = run.outcome, run.lease
    fields: Record = {}
    if outcome is not None and outcome.sent.fixtures:  # set up anew in its process
        fields["fixtures"] = [
            {"name": name, "scope": scope} for name, scope in dict.fromkeys(outcome.sent.fixtures)
        ]
    if outcome is not None and outcome.sent.driver:  # it leased no GPU (there were GPUs)
        fields["cuda_without_gpu"] = outcome.sent.driver  # and loaded CUDA's driver or NVML
    if run.port is not None:
        fields["master_port"] = run.port  # leased for the test (MASTER_ADDR=127.0.0.1)
    if lease is not None:
        fields["gpus"] = list(lease.devices)
        fields["lease_wait"] = round(lease.waited, 6)
        # Bytes it leased on each GPU (None: the GPUs' size is unknown), and the most its
        # processes held on one of them (NVML, sampled; None: unknown)
        fields["gpu_memory"] = lease.memory or None
        fields["gpu_memory_peak"] = run.peak
    if run.health is not None:  # its GPUs: {devices, quarantined, probed?, unassessed?, xids?}
        fields["gpu_health"] = run.health.as_record()
    if run.folded:
        fields["warnings_folded"] = run.folded
    if run.gpu_notes:
        fields["gpu_notes"] = list(run.gpu_notes)
    if run.ranks:
        fields["ranks"] = list(run.ranks)
    return fields


def attach_record(reports: list[pytest.TestReport], record: Record) -> None:
    """Put the record on the test's last report (none: pytest.exit() before any report)."""
    if reports:
        setattr(reports[-1], RECORD_ATTR, record)
