"""Shard reports read back and merged (``python -m pytest_gpuiso merge``).

Each JSON report is checked before anything is written: a regular file of bounded
size, JSON, our schema version, and every record usable by the reports; problems are
one ``ReportError`` line naming the file. Merged records name their shard; a test found
in several shards is kept from one (``merge``), so that it counts once.
"""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

from ..termtext import inert
from ..values import KINDS
from .record import SCHEMA_VERSION, Record, is_number, last_attempts

if TYPE_CHECKING:
    from .run_info import Session

# The largest report ``merge`` reads: a record is about 1 KiB, so a million tests.
MAX_REPORT_BYTES = 1 << 30


class ReportError(ValueError):
    """A report file that cannot be read or merged; the message names the file, and is
    inert (``termtext.inert``): it may quote what the file holds (a leak's kind)."""

    def __init__(self, message: str) -> None:
        super().__init__(inert(message))


MAX_INT = (1 << 63) - 1  # no field of ours holds more (bytes, ports, counts)


def _bad_number(value: Any, where: str) -> str | None:
    """The first number in ``value`` (at ``where``) that no record of ours can hold: NaN,
    an infinity (JSON has neither, Python's json reads both) or an int beyond 63 bits."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"{where!r} is {value!r}, not a finite number"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
        return f"{where!r} is an integer of {len(str(abs(value)))} digits, beyond 64 bits"
    if isinstance(value, dict):
        for key, item in value.items():
            found = _bad_number(item, f"{where}.{key}" if where else str(key))
            if found:
                return found
    if isinstance(value, list):
        for n, item in enumerate(value):
            found = _bad_number(item, f"{where}[{n}]")
            if found:
                return found
    return None


def _record_problem(record: Any) -> str | None:
    """What makes a test record unusable for the reports, None if nothing does."""
    if not isinstance(record, dict):
        return "not an object"
    bad = _bad_number(record, "")
    if bad:
        return bad
    for key in ("nodeid", "outcome"):
        if not isinstance(record.get(key), str):
            return f"{key!r} is not a string"
    exit_ = record.get("exit")
    if not isinstance(exit_, dict):
        return "'exit' is not an object"
    if not isinstance(exit_.get("timed_out"), bool):
        return "'exit.timed_out' is not true or false"
    if not (exit_.get("signal") is None or isinstance(exit_["signal"], str)):
        return "'exit.signal' is not a string or null"
    timeout = record.get("timeout")
    if not (is_number(timeout) or (timeout is None and not exit_["timed_out"])):
        return "'timeout' is not a number"
    for key in ("leaks", "escaped"):
        if not isinstance(record.get(key, []), list):
            return f"{key!r} is not a list"
    for n, leak in enumerate(record.get("leaks", [])):
        if not isinstance(leak, dict) or not isinstance(leak.get("detail"), str):
            return f"leak {n} has no 'detail' string"
        if leak.get("kind") not in KINDS:
            return f"leak {n} has kind {leak.get('kind')!r}, expected one of {', '.join(KINDS)}"
    return None


def _read_report(path: str) -> bytes:
    """A report file's bytes: a regular file of at most ``MAX_REPORT_BYTES``.

    Opened without blocking (a FIFO would wait for a writer) and checked before it is
    read (``/dev/zero`` would be read forever).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ReportError(f"{path}: cannot read: {exc.strerror}") from None
    st = os.fstat(fd)
    problem = None
    if stat.S_ISDIR(st.st_mode):
        problem = "cannot read: Is a directory"
    elif not stat.S_ISREG(st.st_mode):
        problem = "not a regular file"
    elif st.st_size > MAX_REPORT_BYTES:
        problem = f"{st.st_size} bytes, more than a report can be ({MAX_REPORT_BYTES} at most)"
    if problem is not None:
        os.close(fd)
        raise ReportError(f"{path}: {problem}")
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(MAX_REPORT_BYTES + 1)
        except OSError as exc:
            raise ReportError(f"{path}: cannot read: {exc.strerror}") from None
    if len(data) > MAX_REPORT_BYTES:  # it grew while we read it
        raise ReportError(f"{path}: more than {MAX_REPORT_BYTES} bytes")
    return data


def load(path: str) -> list[Record]:
    """The records of one JSON report; ``ReportError`` names the file and the problem."""
    return records_of(path, document(path))


def document(path: str) -> dict[str, Any]:
    """A JSON report's document, with its 'tests' list (not yet checked)."""
    found = read_json(path)
    if not isinstance(found, dict) or not isinstance(found.get("tests"), list):
        raise ReportError(f"{path}: not a pytest-gpuiso report (no 'tests' list)")
    return found


def read_json(path: str) -> Any:
    """A JSON file's document (a report, a leak baseline); ``ReportError`` says why not."""
    data = _read_report(path)
    if not data.strip():
        raise ReportError(f"{path}: empty file")
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
        raise ReportError(f"{path}: not JSON (truncated?): {exc}") from None


def records_of(path: str, document: dict[str, Any]) -> list[Record]:
    """The checked records of a report's document (``{"version": 1, "tests": [...]}``)."""
    version = document.get("version")
    if not is_number(version) or version != SCHEMA_VERSION:
        raise ReportError(f"{path}: report version {version!r}, expected {SCHEMA_VERSION}")
    for n, record in enumerate(document["tests"]):
        problem = _record_problem(record)
        if problem:
            raise ReportError(f"{path}: test record {n} is malformed: {problem}")
    return document["tests"]


class Shard(TypedDict):
    """One shard a merged report is made of: where it was read from, and its session
    (as that report had it, unchecked; None where it had none)."""

    path: str
    session: Session | None


OVERLAP_NAMED = 3  # tests named in merge's one line on overlapping shards


@dataclass(frozen=True)
class Merged:
    """What ``merge`` made of several shard reports."""

    records: list[Record]  # each test from one report, each naming its shard
    runs: list[Shard]  # each shard's path and session (a merged one's shards)
    overlapping: dict[str, list[str]]  # a test found in several reports -> those reports


def merge(paths: list[str]) -> Merged:
    """The records of several shard reports, in order; each record names its shard (the
    path it was read from, unless it already names one: a merge of merges).

    A test found in more than one report (shards that overlap) is kept from one, so that
    it counts once, as in one session: every attempt of it in the report that holds its
    last attempt (the later report where they tie), as ``last_attempts`` would choose."""
    found: list[list[Record]] = []  # each report's records
    runs: list[Shard] = []
    for path in paths:
        read = document(path)
        records = records_of(path, read)
        found.append([{**record, "shard": record.get("shard", path)} for record in records])
        if isinstance(read.get("shards"), list):
            runs += [s for s in read["shards"] if isinstance(s, dict)]
        else:
            runs.append({"path": path, "session": read.get("session")})
    reports: dict[str, list[int]] = {}  # node id -> the reports it is in
    last: dict[str, tuple[float, int]] = {}  # node id -> (its last attempt, its report)
    for n, records in enumerate(found):
        for record in records:
            nodeid = record["nodeid"]
            if n not in reports.setdefault(nodeid, []):
                reports[nodeid].append(n)
            attempt = record.get("attempt") if is_number(record.get("attempt")) else 1
            last[nodeid] = max(last.get(nodeid, (attempt, n)), (attempt, n))
    merged = [
        record
        for n, records in enumerate(found)
        for record in records
        if last[record["nodeid"]][1] == n
    ]
    overlapping = {
        nodeid: [paths[n] for n in where] for nodeid, where in reports.items() if len(where) > 1
    }
    return Merged(merged, runs, overlapping)


def overlap_line(overlapping: dict[str, list[str]]) -> str | None:
    """One line on the tests found in more than one shard: how many, the first few with
    their shards, and what merge kept of them; None where there are none."""
    if not overlapping:
        return None
    named = [
        f"{nodeid} ({', '.join(where)})"
        for nodeid, where in list(overlapping.items())[:OVERLAP_NAMED]
    ]
    more = len(overlapping) - len(named)
    tests = f"{len(overlapping)} test{'s are' if len(overlapping) != 1 else ' is'}"
    return (
        f"{tests} in more than one shard (shards that overlap), each counted once, from "
        f"the shard with its last attempt: {', '.join(named)}"
        + (f" and {more} more" if more else "")
    )


def durations(records: list[Record], kept: dict[str, float] | None = None) -> dict[str, float]:
    """pytest-split's durations ({nodeid: seconds}): each test's wall time in its own
    process, start-up included (its last attempt; its duration where no wall time), over
    ``kept`` (the file's entries so far: tests this run did not run keep theirs)."""
    found = dict(kept or {})
    for nodeid, record in last_attempts(records).items():
        seconds = record.get("wall") if is_number(record.get("wall")) else record.get("duration")
        if is_number(seconds) and seconds >= 0:
            found[nodeid] = round(float(seconds), 3)
    return found


def read_durations(path: str | os.PathLike[str]) -> dict[str, float]:
    """The entries of a durations file that is there ({} where there is none yet, or only
    a dangling link); a file that is not ``{nodeid: seconds}`` (a number no float holds
    included) is a ``ReportError`` naming it. Read as a report is (``_read_report``: a FIFO
    or ``/dev/zero`` there hangs nothing)."""
    if not os.path.exists(path):  # a dangling link of yours too: the writer makes its file
        return {}
    data = _read_report(str(path))
    try:
        found = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # not JSON (UnicodeDecodeError is one)
        raise ReportError(f"{path}: not a durations file (not JSON: {exc})") from None
    if isinstance(found, list) and all(
        isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) for e in found
    ):
        found = dict(found)  # pytest-split's format before 0.5: [[nodeid, seconds], ...]
    bad = _bad_number(found, "") if isinstance(found, dict) else None
    if bad:  # NaN, an infinity, an integer no float holds
        raise ReportError(f"{path}: not a durations file ({bad})")
    if not isinstance(found, dict) or not all(
        isinstance(k, str) and is_number(v) and v >= 0 for k, v in found.items()
    ):
        raise ReportError(f"{path}: not a durations file ({{nodeid: seconds}} expected)")
    return {k: float(v) for k, v in found.items()}
