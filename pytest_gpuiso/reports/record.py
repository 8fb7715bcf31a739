"""The JSON record of one isolated test, read: its schema's helpers.

``Record`` is the schema, written once (docs/json-report.md documents each field;
a test holds the two together). Records ride on the test's last report
(``RECORD_ATTR``), so under xdist the controller receives every worker's records test
by test, even from a worker that later crashes. ``parent.recording`` builds them;
``report`` writes them out (JSON, Markdown, terminal). A record read back from a file
may be an older version's or a hostile one's: readers use ``.get`` and check types.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypedDict

SCHEMA_VERSION = 1
RECORD_ATTR = "gpu_isolate"  # attribute of the last report; survives xdist serialization


class Exit(TypedDict):
    code: int | None  # negative: killed by that signal number
    signal: str | None  # "SIGSEGV", ...
    timed_out: bool
    expired: str | None  # the bound that ran out: "test", "startup", "exit" or "group"


class Escaped(TypedDict):
    """A descendant still running after the test's process ended (then killed)."""

    pid: int
    cmdline: str


class _Started(TypedDict):
    method: str | None  # "spawn" or "forkserver"
    prewarmed: bool
    collected: bool
    uncollected: str | None  # why the template gave up collecting


class Start(_Started, total=False):
    """How the test's process started; the last three only where it could not."""

    error: str  # what it said, in one line
    traceback: str  # everything it said
    tried: bool  # false: not started again after the same failure repeated


class Location(TypedDict, total=False):
    file: str  # relative to pytest's rootdir
    line: int  # 1-based
    path: str  # relative to the checkout (added where findings are made)


class Fixture(TypedDict):
    """A fixture of a scope broader than the test that the test's process set up."""

    name: str
    scope: str  # "session", "package", "module" or "class"


class RankEntry(TypedDict):
    """One rank of a distributed test (``ranks=N``): what became of it, how it ended."""

    rank: int
    outcome: str  # "passed", "failed", "skipped", "xfailed" or "xpassed"
    pid: int | None
    exit: int | None  # its exit status (negative: the signal that ended it)
    signal: str | None  # that signal's name
    expired: str | None  # the bound it ran past ("group": stopped after another ended)
    duration: float  # seconds from its go to its end
    error: str | None  # its first failure's summary line
    stack: str | None  # where it was when stopped past a bound: its threads' stacks
    leaks: list[dict[str, Any]]


class _Always(TypedDict):
    nodeid: str
    outcome: str
    attempt: int
    duration: float
    startup: float | None
    wall: float
    pid: int | None
    timeout: float | None
    startup_timeout: float | None
    exit: Exit
    escaped: list[Escaped]
    leaks: list[dict[str, Any]]
    leak_checks: list[str]
    start: Start


class Record(_Always, total=False):
    """One isolated test's attempt in the JSON report (schema ``SCHEMA_VERSION``)."""

    location: Location
    fixtures: list[Fixture]
    cuda_without_gpu: str
    master_port: int
    gpus: list[str]
    lease_wait: float
    gpu_memory: int | None
    gpu_memory_peak: int | None
    gpu_health: dict[str, Any]
    warnings_folded: int
    gpu_notes: list[str]  # GPU holders on its GPUs that were not its process tree's
    ranks: list[RankEntry]  # a distributed test's ranks, in order
    shard: str  # merged reports only: the file it came from


def is_number(value: Any) -> bool:
    """A record's number field holds one (JSON's true and false are not numbers here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def last_attempts(records: list[Record]) -> dict[str, Record]:
    """Each test's last attempt (pytest-rerunfailures: a record per attempt), by node id."""
    found: dict[str, Record] = {}
    for record in records:
        attempt = record.get("attempt") if is_number(record.get("attempt")) else 1
        kept = found.get(record["nodeid"])
        if kept is None or attempt >= (kept.get("attempt") or 1):
            found[record["nodeid"]] = record
    return found


@dataclass(frozen=True)
class Ending:
    """How a test's process ended, read once from its record (``ending``)."""

    kind: str  # "timeout", "crash", "interrupted" (Ctrl-C, pytest.exit) or "normal"
    signal: str | None  # the signal that ended it, if one did
    expired: str | None = None  # a timeout's bound: "test", "startup", "exit" or "group"

    @property
    def abnormal(self) -> bool:
        """It timed out or crashed: what reports, findings and ``compare`` name."""
        return self.kind in ("timeout", "crash")


def ending(record: Record) -> Ending:
    """How the record's process ended: a timeout first (a bound ran out, whatever ended
    it), then an interrupted test (pytest stopped it: no crash), then a signal (a crash)."""
    exit_ = record.get("exit") or {}
    signal = exit_.get("signal") or None
    if exit_.get("timed_out"):
        return Ending("timeout", signal, exit_.get("expired") or "test")  # old records: test
    if record.get("outcome") == "interrupted":
        return Ending("interrupted", signal)
    if signal:
        return Ending("crash", signal)
    return Ending("normal", None)


def counted_leaks(record: Record) -> list[dict[str, Any]]:
    """The record's leaks that count: not allowed by its marker, not known (the baseline)."""
    return [
        leak
        for leak in record.get("leaks", [])
        if not leak.get("allowed") and leak.get("level") != "known"
    ]


def gpu_notes(record: Record) -> list[str]:
    """The record's notes of GPU holders that were not its test's (its text ones)."""
    notes = record.get("gpu_notes")
    return [n for n in notes if isinstance(n, str)] if isinstance(notes, list) else []


def known_count(records: list[Record]) -> int:
    """How many reported leaks the leak baseline knew (not counted)."""
    return sum(1 for r in records for leak in r.get("leaks", []) if leak.get("level") == "known")


def leak_kinds(record: Record) -> dict[str, str]:
    """Leak kind -> the first such leak's detail, of the record's leaks its marker did not
    allow (known ones included)."""
    kinds: dict[str, str] = {}
    for leak in record.get("leaks", []):
        if not leak.get("allowed"):
            kinds.setdefault(leak["kind"], leak["detail"])
    return kinds


def record_of(report: Any) -> Record | None:
    """The record a report carries, if it is a test's last report."""
    record = getattr(report, RECORD_ATTR, None)
    return record if isinstance(record, dict) else None


def cause_of(record: Record) -> RankEntry | None:
    """A distributed test's failing record's rank entry whose process is the record's
    (the cause's: the first rank to fail), else None."""
    for entry in record.get("ranks") or []:
        if entry.get("pid") == record.get("pid") and entry.get("outcome") in ("failed", "error"):
            return entry
    return None


def cause_rank(record: Record) -> str:
    """ "rank K " where the record's cause is rank K's (``cause_of``), else "": what names
    the rank in a line about the test."""
    entry = cause_of(record)
    return f"rank {entry['rank']} " if entry is not None else ""
