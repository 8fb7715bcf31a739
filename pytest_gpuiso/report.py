"""Reports of the isolated tests: JSON, terminal summary, Markdown, and the merge of shards.

Every report is made from the same records (one per isolated test, schema
version 1), so a merged report of CI shards reads exactly like one session's.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from .leaks import KINDS

SCHEMA_VERSION = 1
MARKDOWN_ROWS = 200  # leak rows in the Markdown table; GitHub truncates huge summaries
WORST = 5  # tests listed as worst offenders in the terminal


class ReportError(ValueError):
    """A report file that cannot be read or merged; the message names the file."""


def write_json(path: Path, records: list[dict[str, Any]]) -> None:
    """Write the report atomically (a reader never sees half a file)."""
    document = {"version": SCHEMA_VERSION, "tests": records}
    _write_atomic(path, json.dumps(document, indent=2, ensure_ascii=False) + "\n")


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".gpuiso-", suffix=path.suffix, dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _reported(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The record's leaks that count (those a marker allowed do not)."""
    return [leak for leak in record.get("leaks", []) if not leak.get("allowed")]


def _ended(record: dict[str, Any]) -> str | None:
    """'timed out' / 'crashed' text of a record, None for a process that ended normally."""
    exit_ = record["exit"]
    if exit_["timed_out"]:
        how = f", ended by {exit_['signal']}" if exit_["signal"] else ""
        return f"timed out after {record['timeout']:g} s{how}"
    if exit_["signal"]:
        return f"crashed with {exit_['signal']}"
    return None


def leak_counts(records: list[dict[str, Any]]) -> Counter[str]:
    return Counter(leak["kind"] for r in records for leak in _reported(r))


def terminal_summary(tr: Any, records: list[dict[str, Any]], path: Path | None) -> None:
    timed_out = [r for r in records if r["exit"]["timed_out"]]
    crashed = [r for r in records if r["exit"]["signal"] and not r["exit"]["timed_out"]]
    escaped = sum(len(r.get("escaped", [])) for r in records)
    tr.write_sep("-", "gpu-isolate")
    parts = [f"{len(records)} isolated", f"{len(timed_out)} timed out", f"{len(crashed)} crashed"]
    if escaped:
        parts.append(f"{escaped} escaped processes killed")
    tr.write_line("gpu-isolate: " + ", ".join(parts))
    for r in timed_out:
        tr.write_line(f"  TIMEOUT {r['nodeid']} (after {r['timeout']:g} s)")
    for r in crashed:
        tr.write_line(f"  CRASHED {r['nodeid']} ({r['exit']['signal']})")
    if path is not None:
        tr.write_line(f"gpu-isolate: JSON report written to {path}")
    leaky = [r for r in records if r.get("leaks")]
    if leaky:
        leak_summary(tr, records)


def leak_summary(tr: Any, records: list[dict[str, Any]]) -> None:
    """The ``gpu-isolate leak summary`` section: counts per kind, the worst tests."""
    counts = leak_counts(records)
    allowed = sum(1 for r in records for leak in r.get("leaks", []) if leak.get("allowed"))
    tr.write_sep("-", "gpu-isolate leak summary")
    tests = sum(1 for r in records if _reported(r))
    line = ", ".join(f"{counts[kind]} {kind}" for kind in KINDS)
    tr.write_line(f"gpu-isolate: {sum(counts.values())} leaks in {tests} tests ({line})")
    if allowed:
        tr.write_line(f"gpu-isolate: {allowed} more allowed by allow_leaks markers")
    worst = sorted((r for r in records if _reported(r)), key=lambda r: -len(_reported(r)))
    for r in worst[:WORST]:
        leaks = _reported(r)
        kinds = Counter(leak["kind"] for leak in leaks)
        what = ", ".join(f"{n} {kind}" for kind, n in kinds.items())
        tr.write_line(f"  {r['nodeid']}: {what}")
        for leak in leaks[:3]:
            tr.write_line(f"    {leak['kind']}: {leak['detail']}")
        if len(leaks) > 3:
            tr.write_line(f"    ... {len(leaks) - 3} more in the JSON report")
    if len(worst) > WORST:
        tr.write_line(f"  ... {len(worst) - WORST} more tests with leaks")


def _cell(text: Any) -> str:
    """Text safe inside a Markdown table cell."""
    return str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    return "`" + text.replace("`", "'") + "`"


def markdown(records: list[dict[str, Any]], title: str = "pytest-gpuiso") -> str:
    """A summary for PR checks: totals, a test x kind x detail table, timeouts and crashes."""
    counts = leak_counts(records)
    outcomes = Counter(r["outcome"] for r in records)
    ended = [(r, _ended(r)) for r in records if _ended(r)]
    leaky = [r for r in records if _reported(r)]
    lines = [f"## {title}", ""]
    outcome_text = ", ".join(f"{n} {o}" for o, n in sorted(outcomes.items()))
    lines.append(f"**{len(records)} isolated tests** ({outcome_text or 'none'})")
    lines.append("")
    lines.append("| leaks | " + " | ".join(KINDS) + " | timeouts | crashes |")
    lines.append("|---" * (len(KINDS) + 3) + "|")
    timeouts = sum(1 for r in records if r["exit"]["timed_out"])
    crashes = len(ended) - timeouts
    lines.append(
        f"| {sum(counts.values())} in {len(leaky)} tests | "
        + " | ".join(str(counts[k]) for k in KINDS)
        + f" | {timeouts} | {crashes} |"
    )
    if leaky:
        lines += ["", "### Leaks", "", "| test | kind | detail |", "|---|---|---|"]
        rows = [(r["nodeid"], leak) for r in leaky for leak in _reported(r)]
        for nodeid, leak in rows[:MARKDOWN_ROWS]:
            lines.append(f"| {_cell(_code(nodeid))} | {leak['kind']} | {_cell(leak['detail'])} |")
        if len(rows) > MARKDOWN_ROWS:
            lines.append(f"\n{len(rows) - MARKDOWN_ROWS} more leaks are in the JSON report.")
    if ended:
        lines += ["", "### Timeouts and crashes", "", "| test | outcome | how it ended |"]
        lines.append("|---|---|---|")
        for r, how in ended:
            lines.append(f"| {_cell(_code(r['nodeid']))} | {r['outcome']} | {_cell(how)} |")
    if not leaky and not ended:
        lines += ["", "No leaks, timeouts or crashes."]
    return "\n".join(lines) + "\n"


def write_markdown(path: Path | None, records: list[dict[str, Any]]) -> list[str]:
    """Write the Markdown summary to ``path`` and append it to ``$GITHUB_STEP_SUMMARY``.

    Returns where it went. A step summary that cannot be written is skipped with
    its reason (a CI convenience must never fail the session).
    """
    text = markdown(records)
    written = []
    if path is not None:
        _write_atomic(path, text)
        written.append(str(path))
    step = os.environ.get("GITHUB_STEP_SUMMARY")
    if step:
        try:
            with open(step, "a", encoding="utf-8") as f:
                f.write(text)
            written.append("$GITHUB_STEP_SUMMARY")
        except OSError as exc:
            written.append(f"not $GITHUB_STEP_SUMMARY ({exc.strerror}: {step})")
    return written


def load(path: str) -> list[dict[str, Any]]:
    """The records of one JSON report; ``ReportError`` names the file and the problem."""
    try:
        with open(path, encoding="utf-8") as f:
            document = json.load(f)
    except OSError as exc:
        raise ReportError(f"{path}: cannot read: {exc.strerror}") from None
    except ValueError as exc:
        raise ReportError(f"{path}: not JSON: {exc}") from None
    if not isinstance(document, dict) or not isinstance(document.get("tests"), list):
        raise ReportError(f"{path}: not a pytest-gpuiso report (no 'tests' list)")
    if document.get("version") != SCHEMA_VERSION:
        raise ReportError(
            f"{path}: report version {document.get('version')!r}, expected {SCHEMA_VERSION}"
        )
    for n, record in enumerate(document["tests"]):
        if not (
            isinstance(record, dict)
            and isinstance(record.get("nodeid"), str)
            and isinstance(record.get("exit"), dict)
            and isinstance(record.get("leaks", []), list)
        ):
            raise ReportError(f"{path}: test record {n} is malformed")
    return document["tests"]


def merge(paths: list[str]) -> list[dict[str, Any]]:
    """The records of several shard reports, in order; each record names its shard."""
    merged = []
    for path in paths:
        for record in load(path):
            merged.append({**record, "shard": record.get("shard", path)})
    return merged
