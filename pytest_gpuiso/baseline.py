"""Known leaks: the leak baseline (``--gpu-isolate-leak-baseline FILE``).

A suite that cannot fix every leak at once lists the leaks it knows of in a baseline,
written by ``python -m pytest_gpuiso compare --write-baseline FILE REPORT`` (or a JSON
report used as one). A leak in it (its test, its kind) is reported as known and never
fails the test; a leak not in it is judged by ``--gpu-isolate-leaks`` as ever; an entry
whose test ran and no longer leaks that kind is reported as fixed, so the file shrinks.

The file::

    {"format": "pytest-gpuiso leak baseline", "version": 1,
     "leaks": [{"nodeid": "tests/t.py::test_x", "kind": "shm", "detail": "..."}]}

``detail`` is for the reader; a test and a kind are what match.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .record import last_attempts
from .settings import KINDS
from .shards import ReportError, read_json, records_of

FORMAT = "pytest-gpuiso leak baseline"
VERSION = 1


@dataclass(frozen=True)
class Baseline:
    path: str
    known: dict[str, frozenset[str]]  # node id -> the leak kinds known of it

    def kinds(self, nodeid: str) -> frozenset[str]:
        return self.known.get(nodeid, frozenset())

    @property
    def entries(self) -> int:
        return sum(len(kinds) for kinds in self.known.values())

    def fixed(self, records: list[dict[str, Any]]) -> list[tuple[str, str]]:
        """(test, kind) of each entry whose test's last attempt ran to its leak check
        and did not leak that kind."""
        last = last_attempts(records)
        found = []
        for nodeid, kinds in sorted(self.known.items()):
            record = last.get(nodeid)
            if record is None or record.get("pid") is None or record["outcome"] == "interrupted":
                continue  # not run here, or never checked
            leaking = {leak["kind"] for leak in record.get("leaks", [])}
            found += [(nodeid, kind) for kind in sorted(kinds - leaking)]
        return found

    def not_run(self, records: list[dict[str, Any]]) -> list[str]:
        """The tests it names that this session did not run isolated (deselected, in
        another shard, renamed or removed)."""
        ran = {r["nodeid"] for r in records}
        return sorted(set(self.known) - ran)

    def summary(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """What the session made of the baseline, for the reports: its file, the leaks
        it knew, its entries now fixed, the tests it names that did not run."""
        known = sum(
            1 for r in records for leak in r.get("leaks", []) if leak.get("level") == "known"
        )
        return {
            "path": self.path,
            "entries": self.entries,
            "known": known,
            "fixed": [{"nodeid": n, "kind": k} for n, k in self.fixed(records)],
            "not_run": self.not_run(records),
        }


def load(path: str) -> Baseline:
    """The baseline in ``path`` (or a JSON report's leaks); ``ReportError`` names the file
    and the problem in one line."""
    document = read_json(path)
    if isinstance(document, dict) and "tests" in document and "format" not in document:
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


def _known(leaks: list[dict[str, Any]]) -> dict[str, frozenset[str]]:
    known: dict[str, set[str]] = {}
    for entry in leaks:
        known.setdefault(entry["nodeid"], set()).add(entry["kind"])
    return {nodeid: frozenset(kinds) for nodeid, kinds in known.items()}


def entries(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A baseline's entries from a report's records: each test's last attempt, each leak
    kind it reported once (known ones too; not those its marker allows)."""
    found = []
    for nodeid, record in sorted(last_attempts(records).items()):
        kinds: dict[str, str] = {}
        for leak in record.get("leaks", []):
            if not leak.get("allowed"):
                kinds.setdefault(leak["kind"], leak["detail"])
        found += [{"nodeid": nodeid, "kind": k, "detail": d} for k, d in sorted(kinds.items())]
    return found


def text(records: list[dict[str, Any]]) -> str:
    """The baseline file of a report's records."""
    document = {"format": FORMAT, "version": VERSION, "leaks": entries(records)}
    return json.dumps(document, indent=2, ensure_ascii=False) + "\n"
