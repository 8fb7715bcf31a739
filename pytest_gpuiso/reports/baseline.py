"""Known leaks: the leak baseline (``--gpu-isolate-leak-baseline FILE``).

A suite that cannot fix every leak at once lists the leaks it knows of in a baseline,
written by ``python -m pytest_gpuiso compare --write-baseline FILE REPORT`` (or a JSON
report used as one). A leak in it (its test, its kind) is reported as known and never
fails the test; a leak not in it is judged by ``--gpu-isolate-leaks`` as ever; an entry
whose test ran and no longer leaks that kind is reported as fixed, so the file shrinks.

The file::

    {"format": "pytest-gpuiso leak baseline", "version": 1,
     "leaks": [{"nodeid": "tests/t.py::test_x", "kind": "shm", "detail": "..."}]}

``detail`` is for the reader; a test and a kind are what match. A path with nothing
there is a baseline that knows nothing (a CI recipe's first run, before one is written),
said in one line of the summary; a file there that cannot serve is an error.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TypedDict

from ..values import KINDS
from .mdtext import code_cell, kind_cell
from .record import Record, ending, known_count, last_attempts, leak_kinds
from .shards import ReportError, read_json, records_of

FORMAT = "pytest-gpuiso leak baseline"
VERSION = 1


class Entry(TypedDict, total=False):
    """A leak the baseline knows: a test and a leak kind (``detail``: what it was, where
    the baseline was made from a report)."""

    nodeid: str
    kind: str
    detail: str


class Summary(TypedDict):
    """What a session made of its baseline (the JSON report's ``baseline``)."""

    path: str
    missing: bool  # nothing was at the path: read as empty
    entries: int  # the leaks it knew of, test by test and kind by kind
    known: int  # the reported leaks it knew (not counted)
    fixed: list[Entry]  # its entries that the session found fixed (nodeid, kind)
    not_run: list[str]  # the tests it names that did not run isolated


@dataclass(frozen=True)
class Baseline:
    path: str
    known: dict[str, frozenset[str]]  # node id -> the leak kinds known of it
    missing: bool = False  # nothing was at the path: read as empty

    def kinds(self, nodeid: str) -> frozenset[str]:
        return self.known.get(nodeid, frozenset())

    @property
    def entries(self) -> int:
        return sum(len(kinds) for kinds in self.known.values())

    def fixed(self, records: list[Record]) -> list[tuple[str, str]]:
        """(test, kind) of each entry whose test's last attempt ran to its end (neither
        skipped, nor stopped by a timeout, a crash or Ctrl-C), had that kind checked
        (not ``off``; GPU memory only with a lease and NVML) and did not leak it."""
        last = last_attempts(records)
        found = []
        for nodeid, kinds in sorted(self.known.items()):
            record = last.get(nodeid)
            if record is None or not _ran_through(record):
                continue
            leaking = {leak["kind"] for leak in record.get("leaks", [])}
            checked = set(record.get("leak_checks") or ())
            found += [(nodeid, kind) for kind in sorted(kinds & checked - leaking)]
        return found

    def not_run(self, records: list[Record]) -> list[str]:
        """The tests it names that this session did not run isolated (deselected, in
        another shard, renamed or removed)."""
        ran = {r["nodeid"] for r in records}
        return sorted(set(self.known) - ran)

    def summary(self, records: list[Record]) -> Summary:
        """What the session made of the baseline, for the reports: its file (and whether
        it was missing), the leaks it knew, its entries now fixed, the tests it names that
        did not run."""
        return {
            "path": self.path,
            "missing": self.missing,
            "entries": self.entries,
            "known": known_count(records),
            "fixed": [Entry(nodeid=n, kind=k) for n, k in self.fixed(records)],
            "not_run": self.not_run(records),
        }


def _ran_through(record: Record) -> bool:
    """Whether the test ran as far as it goes: a leak it no longer reports is gone, not
    skipped over."""
    return ending(record).kind == "normal" and record.get("outcome") not in ("skipped", "rerun")


def load(path: str) -> Baseline:
    """The baseline in ``path`` (or a JSON report's leaks), empty where nothing is there
    (not even a dangling link); ``ReportError`` names the file and the problem in one line."""
    if not os.path.lexists(path):
        return Baseline(path, {}, missing=True)
    document = read_json(path)
    if isinstance(document, dict) and isinstance(document.get("tests"), list):
        return Baseline(path, _known(entries(records_of(path, document))))
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise ReportError(f"{path}: neither a leak baseline nor a pytest-gpuiso JSON report")
    if document.get("version") != VERSION:
        raise ReportError(f"{path}: baseline version {document.get('version')!r}, expected 1")
    leaks = document.get("leaks")
    if not isinstance(leaks, list):
        raise ReportError(f"{path}: 'leaks' is not a list")
    for n, entry in enumerate(leaks):
        if not isinstance(entry, dict):
            raise ReportError(f"{path}: entry {n} is not an object")
        if not isinstance(entry.get("nodeid"), str) or not entry["nodeid"]:
            raise ReportError(f"{path}: entry {n} has no 'nodeid' string")
        if entry.get("kind") not in KINDS:
            expected = ", ".join(KINDS)
            raise ReportError(
                f"{path}: entry {n} has kind {entry.get('kind')!r}, expected one of {expected}"
            )
    return Baseline(path, _known(leaks))


def _known(leaks: list[Entry]) -> dict[str, frozenset[str]]:
    known: dict[str, set[str]] = {}
    for entry in leaks:
        known.setdefault(entry["nodeid"], set()).add(entry["kind"])
    return {nodeid: frozenset(kinds) for nodeid, kinds in known.items()}


def entries(records: list[Record]) -> list[Entry]:
    """A baseline's entries from a report's records: each test's last attempt, each leak
    kind it reported once (known ones too; not those its marker allows)."""
    found: list[Entry] = []
    for nodeid, record in sorted(last_attempts(records).items()):
        kinds = sorted(leak_kinds(record).items())
        found += [Entry(nodeid=nodeid, kind=k, detail=d) for k, d in kinds]
    return found


def text(leaks: list[Entry]) -> str:
    """The baseline file of its entries (``entries``)."""
    document = {"format": FORMAT, "version": VERSION, "leaks": leaks}
    return json.dumps(document, indent=2, ensure_ascii=False) + "\n"


def baseline_lines(summary: Summary, most: int) -> list[str]:
    """The terminal's lines on what became of the baseline (``Baseline.summary``): known
    leaks, fixed entries (at most ``most`` named), tests not run."""
    fixed, not_run = summary["fixed"], summary["not_run"]
    if summary["missing"]:
        return [
            f"gpu-isolate: leak baseline {summary['path']}: no such file, read as empty (no "
            "known leaks); write it with python -m pytest_gpuiso compare --write-baseline "
            "FILE REPORT"
        ]
    lines = [
        f"gpu-isolate: leak baseline {summary['path']}: {summary['known']} known leaks "
        f"reported, {len(fixed)} of its {summary['entries']} entries fixed, "
        f"{len(not_run)} of its tests not run"
    ]
    lines += [f"  FIXED {e['nodeid']}: {e['kind']} (no longer leaks)" for e in fixed[:most]]
    if len(fixed) > most:
        lines.append(f"  ... {len(fixed) - most} more fixed entries in the JSON report")
    if fixed:
        lines.append(
            "gpu-isolate: fixed entries can leave the baseline: write it again with "
            "python -m pytest_gpuiso compare --write-baseline FILE REPORT"
        )
    if not_run:
        more = f" and {len(not_run) - most} more" if len(not_run) > most else ""
        lines.append(
            "gpu-isolate: not run here (deselected, in another shard, renamed or removed): "
            f"{', '.join(not_run[:most])}{more}"
        )
    return lines


def fixed_table(summary: Summary | None, rows: int) -> list[str]:
    """The Markdown's "Fixed since the leak baseline" part (at most ``rows`` rows)."""
    if not summary or not summary["fixed"]:
        return []
    fixed = summary["fixed"]
    lines = ["", "### Fixed since the leak baseline", ""]
    lines += ["No longer leaking: write the baseline again to drop them.", ""]
    lines += ["| test | kind |", "|---|---|"]
    lines += [f"| {code_cell(e['nodeid'])} | {kind_cell(e['kind'])} |" for e in fixed[:rows]]
    if len(fixed) > rows:
        lines += ["", f"{len(fixed) - rows} more in the JSON report."]
    return lines
