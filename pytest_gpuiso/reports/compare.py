"""What a pull request changed against its base: ``python -m pytest_gpuiso compare``.

Two JSON reports (or merged shards) are read as ``merge`` reads them (``shards.load``)
and compared test by test, on each test's last attempt:

* new: a leak kind a test reports now and did not (not counting leaks its marker
  allows), a crash or a timeout it did not have, a start-up that grew by more than
  ``startup_growth`` seconds, a GPU memory peak that grew by more than ``peak_growth``;
* fixed: a leak kind, a crash or a timeout it had and no longer has;
* a test only in head: listed, and what it does wrong (a leak its marker does not allow, a
  crash, a timeout) is new, as it would be in a test that had none of it;
* a test only in base: listed, informational.

The result is text for a terminal and Markdown for a pull request; new findings make the
command's exit status 1 (a required check can fail on them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..termtext import inert
from .mdtext import bounded, cell, code_cell
from .record import Record, ending, is_number, last_attempts, leak_kinds

STARTUP_GROWTH = 2.0  # seconds more of start-up that count as a regression
PEAK_GROWTH = 512 << 20  # bytes more of GPU memory peak that count as a regression


@dataclass(frozen=True)
class Change:
    nodeid: str
    what: str  # "leak shm", "crash", "timeout", "start-up", "GPU memory peak"
    detail: str


@dataclass
class Comparison:
    new: list[Change] = field(default_factory=list)
    fixed: list[Change] = field(default_factory=list)
    only_base: list[str] = field(default_factory=list)
    only_head: list[str] = field(default_factory=list)
    compared: int = 0


def _ended(record: Record) -> str | None:
    """ "timeout", "crash" or None: how its process ended, when not as it should."""
    ended = ending(record)
    return ended.kind if ended.abnormal else None


def _new_test(old: Record | None) -> str:
    return "" if old else " (a test only in head)"


def _grew(base: Any, head: Any, by: float) -> bool:
    return is_number(base) and is_number(head) and head - base > by


def compare(
    base: list[Record],
    head: list[Record],
    startup_growth: float = STARTUP_GROWTH,
    peak_growth: int = PEAK_GROWTH,
) -> Comparison:
    before, after = last_attempts(base), last_attempts(head)
    result = Comparison(
        only_base=sorted(set(before) - set(after)),
        only_head=sorted(set(after) - set(before)),
    )
    for nodeid in sorted(after):  # a test only in head: what it does wrong is new
        now, old = after[nodeid], before.get(nodeid, {})
        result.compared += bool(old)
        old_leaks, new_leaks = leak_kinds(old), leak_kinds(now)
        for kind in sorted(set(new_leaks) - set(old_leaks)):
            result.new.append(Change(nodeid, f"leak {kind}", new_leaks[kind] + _new_test(old)))
        for kind in sorted(set(old_leaks) - set(new_leaks)):
            result.fixed.append(Change(nodeid, f"leak {kind}", old_leaks[kind]))
        was, is_ = _ended(old) if old else None, _ended(now)
        if is_ and is_ != was:
            signal = now["exit"]["signal"] or "the timeout"
            result.new.append(Change(nodeid, is_, f"ended by {signal}{_new_test(old)}"))
        if was and was != is_:
            result.fixed.append(Change(nodeid, was, f"was ended by {old['exit']['signal']}"))
        if _grew(old.get("startup"), now.get("startup"), startup_growth):
            detail = f"{old['startup']:.2f} s -> {now['startup']:.2f} s"
            result.new.append(Change(nodeid, "start-up", detail))
        if _grew(old.get("gpu_memory_peak"), now.get("gpu_memory_peak"), peak_growth):
            mib = [int(r["gpu_memory_peak"]) >> 20 for r in (old, now)]  # JSON: maybe a float
            detail = f"{mib[0]} MiB -> {mib[1]} MiB"
            result.new.append(Change(nodeid, "GPU memory peak", detail))
    return result


def text(result: Comparison) -> str:
    """For a terminal: a line per change, then the totals (the reports' text inert)."""
    lines = [f"NEW    {inert(c.nodeid)}: {c.what}: {inert(c.detail)}" for c in result.new]
    lines += [f"FIXED  {inert(c.nodeid)}: {c.what}" for c in result.fixed]
    lines += [f"ONLY IN BASE {inert(nodeid)}" for nodeid in result.only_base]
    lines += [f"ONLY IN HEAD {inert(nodeid)}" for nodeid in result.only_head]
    lines.append(_totals(result))
    return "\n".join(lines) + "\n"


def _totals(result: Comparison) -> str:
    sides = ""
    if result.only_base or result.only_head:
        sides = f"; {len(result.only_base)} only in base, {len(result.only_head)} only in head"
    return (
        f"compared {result.compared} tests: {len(result.new)} new, {len(result.fixed)} fixed"
        + sides
    )


def markdown(result: Comparison, title: str = "pytest-gpuiso: against the base") -> str:
    """For a pull request comment or the step summary."""
    lines = [f"## {title}", "", f"**{_totals(result)}**"]
    for heading, changes in (("New", result.new), ("Fixed", result.fixed)):
        if changes:
            lines += ["", f"### {heading}", "", "| test | what | detail |", "|---|---|---|"]
            for c in changes[:ROWS]:
                lines.append(f"| {code_cell(c.nodeid)} | {cell(c.what)} | {cell(c.detail)} |")
            lines += _more(len(changes))
    sides = (("Only in base", result.only_base), ("Only in head", result.only_head))
    for heading, nodeids in sides:
        if nodeids:
            lines += ["", f"### {heading}", ""] + [f"- {code_cell(n)}" for n in nodeids[:ROWS]]
            lines += _more(len(nodeids))
    if not result.new and not result.fixed:
        lines += ["", "Nothing new, nothing fixed."]
    return bounded(lines, "compare's terminal output lists every one")


ROWS = 200  # of each section of the Markdown


def _more(count: int) -> list[str]:
    """The line after a section cut at ``ROWS``."""
    if count <= ROWS:
        return []
    return ["", f"{count - ROWS} more not shown: compare's terminal output lists every one."]
