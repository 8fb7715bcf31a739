"""Reports of the isolated tests: JSON, terminal summary, Markdown (``shards`` merges them).

Every report is made from the same records (schema version 1; one per isolated test
and attempt: a test rerun by pytest-rerunfailures counts once), so a merged report
of CI shards reads exactly like one session's.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from ..termtext import inert
from ..values import KINDS, count_text
from . import fixtures, mdtext
from .baseline import Summary, baseline_lines, fixed_table
from .files import STEP_SUMMARY_ENV, append_step_summary, step_summary_path, write_text
from .gpu_tables import MARKDOWN_ROWS, health, quarantines, right_size, unassessed
from .mdtext import cell as _cell
from .mdtext import code_cell as _code_cell
from .mdtext import kind_cell as _kind
from .record import (
    Record,
    cause_of,
    cause_rank,
    counted_leaks,
    ending,
    gpu_notes,
    is_number,
    known_count,
)

WORST = 5  # tests listed as worst offenders in the terminal


def _ended(record: Record) -> str | None:
    """'timed out' / 'crashed' text of a record, None for a process that ended normally."""
    ended = ending(record)
    if ended.kind == "timeout":
        return bound(record) + (f", ended by {ended.signal}" if ended.signal else "")
    if ended.kind == "interrupted":  # Ctrl-C: pytest stopped it, it did not crash
        return "interrupted"
    return f"crashed with {ended.signal}" if ended.kind == "crash" else None


def bound(record: Record, test: str = "timed out after") -> str:
    """Which bound a timed-out test ran past: "timed out after 2 s" (``test`` names the
    test's own timeout), "did not finish starting within 300 s", "did not exit within
    300 s after its test"."""
    expired = record["exit"].get("expired") or "test"  # records before it had only tests
    seconds = record.get("startup_timeout")
    within = f" within {seconds:g} s" if is_number(seconds) else ""
    if expired == "startup":
        return f"did not finish starting{within}"
    if expired == "exit":
        return f"did not exit{within} after its test"
    if expired == "group":
        return "was stopped after another rank of its test ended"
    return f"{test} {record['timeout']:g} s"


def leak_counts(records: list[Record]) -> Counter[str]:
    return Counter(leak["kind"] for r in records for leak in counted_leaks(r))


def _tests(records: list[Record]) -> int:
    """How many tests the records are of (a rerun test has one record per attempt)."""
    return len({r["nodeid"] for r in records})


def _ran(record: Record) -> bool:
    """Whether a process of its own ran the test (not: a bad marker, a lease it never got,
    a process that could not start)."""
    start = record.get("start")
    return record.get("pid") is not None and not (isinstance(start, dict) and start.get("error"))


def _attempt(record: Record) -> str:
    """The attempt of a rerun test's record, as " (attempt 2)"; "" for other records."""
    attempt = record.get("attempt", 1)
    return f" (attempt {attempt})" if record["outcome"] == "rerun" or attempt != 1 else ""


def terminal_summary(
    tr: Any,
    records: list[Record],
    path: Path | None,
    baseline: Summary | None = None,
    clock: tuple[float, float] | None = None,
) -> None:
    """``clock``: the session's wall time after collection and every test's own time
    (setup, call, teardown), where one process ran them all (``wall_line``)."""
    timed_out = [r for r in records if ending(r).kind == "timeout"]
    crashed = [r for r in records if ending(r).kind == "crash"]
    escaped = sum(len(r.get("escaped", [])) for r in records)
    reruns = sum(1 for r in records if r["outcome"] == "rerun")
    tr.write_sep("-", "gpu-isolate")
    ran = [r for r in records if _ran(r)]
    unstarted = _tests([r for r in records if not _ran(r) and r["outcome"] == "error"])
    parts = [f"{_tests(ran)} isolated"] + ([f"{unstarted} never started"] if unstarted else [])
    parts += [f"{reruns} rerun"] if reruns else []
    parts += [f"{len(timed_out)} timed out", f"{len(crashed)} crashed"]
    if escaped:
        parts.append(f"{count_text(escaped, 'escaped process', 'escaped processes')} killed")
    tr.write_line("gpu-isolate: " + ", ".join(parts))
    starts = start_counts(records)
    if starts and getattr(tr, "verbosity", 0) > 0:  # how processes started: a detail
        tr.write_line("gpu-isolate: started " + inert(starts))
    cost = cost_line(records)
    if cost:
        tr.write_line("gpu-isolate: " + cost)
        if clock is not None:
            tr.write_line("gpu-isolate: " + wall_line(*clock))
    again = fixtures.rebuilt(records)  # said once a session, where it surprises
    if again:
        tr.write_line("gpu-isolate: " + inert(again), yellow=True)
    folded = sum(r["warnings_folded"] for r in records if is_number(r.get("warnings_folded")))
    if folded:
        tr.write_line(
            f"gpu-isolate: {folded:,} warning{'s' if folded != 1 else ''} repeated by later "
            "tests' processes shown once (--gpu-isolate-warnings=each shows each)"
        )
    for r in timed_out:
        how = f"{cause_rank(r)}{bound(r, test='after')}"
        _flagged(tr, "TIMEOUT", f"{r['nodeid']}{_attempt(r)} ({how})")
    for r in crashed:
        _flagged(
            tr, "CRASHED", f"{r['nodeid']}{_attempt(r)} ({cause_rank(r)}{r['exit']['signal']})"
        )
    for nodeid, device, problem, _ in quarantines(records):
        _flagged(tr, "QUARANTINED", f"GPU {device} after {nodeid}: {problem}")
    for nodeid, device, why in unassessed(records):
        what = f"GPU {device} could not be assessed after {nodeid} ({why})"
        tr.write_line(f"gpu-isolate: {inert(what)}")
    for r in records:  # not the tests' doing: one line each, never blamed
        for note in gpu_notes(r):
            tr.write_line(f"gpu-isolate: {inert(note)} (after {inert(r['nodeid'])})")
    if path is not None:
        tr.write_line(f"gpu-isolate: JSON report written to {inert(path)}")
    leaky = [r for r in records if r.get("leaks")]
    if leaky:
        leak_summary(tr, records)
    if baseline is not None:
        for line in baseline_lines(baseline, WORST):
            tr.write_line(inert(line))


def _flagged(tr: Any, word: str, rest: str, color: str = "red") -> None:
    """A summary line led by a word in pytest's colours (none without a terminal or with
    ``--color=no``: the terminal writer decides), as pytest's own FAILED lines."""
    tw = getattr(tr, "_tw", None)
    flag = tw.markup(word, **{color: True, "bold": True}) if tw is not None else word
    tr.write_line(f"  {flag} {inert(rest)}")


def notable(records: list[Record]) -> bool:
    """Whether the records hold something to look at: a timeout, a crash, an escaped
    process, a reported leak or a noted GPU holder (``-qq`` shows the gpu-isolate summary
    only then)."""
    return bool(quarantines(records) or unassessed(records)) or any(
        r["exit"]["timed_out"]
        or r["exit"]["signal"]
        or r.get("escaped")
        or counted_leaks(r)
        or gpu_notes(r)
        for r in records
    )


def startup_durations(tr: Any, records: list[Record], config: Any) -> None:
    """With ``--durations``: each isolated test's start-up (its turn until it began: the
    process, plugins, the module's import), which the durations table (setup, call,
    teardown, the test's own time) leaves out; slowest first, with its wall time."""
    count, minimum = config.option.durations, config.option.durations_min
    if minimum is None:
        minimum = 0.005 if config.get_verbosity() < 2 else 0.0
    timed = [r for r in records if is_number(r.get("startup"))]
    timed.sort(key=lambda r: -r["startup"])
    if count > 0:
        timed = timed[:count]
    tr.write_sep("=", f"slowest {count or ''} isolated start-ups".replace("  ", " "))
    for n, r in enumerate(timed):
        if r["startup"] < minimum:
            tr.write_line(f"({len(timed) - n} start-ups < {minimum:g}s hidden.)")
            break
        tr.write_line(f"{r['startup']:.2f}s startup {inert(r['nodeid'])} (wall {r['wall']:.2f}s)")


def cost_line(records: list[Record]) -> str:
    """What isolation cost the session, from each record: the time each test's process
    took beyond the test's own setup, call and teardown (``wall - duration``: its start
    from its turn, and its exit), and apart from it the time tests waited for GPUs
    (``lease_wait``: contention, not isolation). "" when no isolated process ran."""
    ran = [r for r in records if is_number(r.get("startup")) and is_number(r.get("wall"))]
    if not ran:
        return ""
    total = sum(max(0.0, r["wall"] - (r.get("duration") or 0.0)) for r in ran)
    each = total / len(ran)
    line = (
        f"isolation cost {_seconds(total)} over {len(ran):,} test{'s' if len(ran) != 1 else ''}"
        f" (~{each * 1000:.0f} ms a test) beyond their own setup, call and teardown"
    )
    waited = sum(r["lease_wait"] for r in records if is_number(r.get("lease_wait")))
    if waited >= 0.05:
        line += f"; {_seconds(waited)} waiting for GPUs"
    return line


def wall_line(wall: float, own: float) -> str:
    """What users compare against: the session's wall clock after collection beside the
    tests' own time (in-process, the two differ by pytest's bookkeeping only)."""
    return (
        f"wall clock {_seconds(wall)} after collection for {_seconds(own)} of the tests' own "
        f"setup, call and teardown: {_seconds(max(0.0, wall - own))} more, about what "
        "running in-process saves"
    )


def _seconds(value: float) -> str:
    return f"{value:.1f} s" if value < 100 else f"{value:,.0f} s"


def start_counts(records: list[Record]) -> str:
    """How the isolated processes started, e.g. "38 forkserver, 2 spawn; 39 prewarmed".

    With the fork server, or prewarmed processes that collected ahead, also how many
    had their module collected before their turn, and why the others were not when
    the fork server gave up on collecting.
    """
    methods: dict[str, int] = {}
    prewarmed = collected = 0
    why = ""
    for r in records:
        start = r.get("start") or {}
        if start.get("method"):
            methods[start["method"]] = methods.get(start["method"], 0) + 1
            prewarmed += bool(start.get("prewarmed"))
            collected += bool(start.get("collected"))
            why = why or start.get("uncollected") or ""
    text = ", ".join(f"{n} {method}" for method, n in sorted(methods.items()))
    if not text:
        return ""
    text += f"; {prewarmed} prewarmed"
    if "forkserver" in methods or collected:
        text += f"; {collected} pre-collected" + (f" ({why})" if why else "")
    return text


def leak_summary(tr: Any, records: list[Record]) -> None:
    """The ``gpu-isolate leak summary`` section: counts per kind, the worst tests."""
    counts = leak_counts(records)
    allowed = sum(1 for r in records for leak in r.get("leaks", []) if leak.get("allowed"))
    tr.write_sep("-", "gpu-isolate leak summary")
    by_test: dict[str, list[dict[str, Any]]] = {}  # every attempt's leaks, a test once
    for r in records:
        if counted_leaks(r):
            by_test.setdefault(r["nodeid"], []).extend(counted_leaks(r))
    line = ", ".join(f"{counts[kind]} {kind}" for kind in KINDS)
    total = count_text(sum(counts.values()), "leak")
    tests = count_text(len(by_test), "test")
    tr.write_line(f"gpu-isolate: {total} in {tests} ({line})", yellow=True)
    if allowed:
        tr.write_line(f"gpu-isolate: {allowed} more allowed by allow_leaks markers")
    known = known_count(records)
    if known:
        tr.write_line(f"gpu-isolate: {known} more known from the leak baseline")
    worst = sorted(by_test.items(), key=lambda test: -len(test[1]))
    for nodeid, leaks in worst[:WORST]:
        kinds = Counter(leak["kind"] for leak in leaks)
        what = ", ".join(f"{n} {kind}" for kind, n in kinds.items())
        # A leak that failed its test was shown with that failure, in full: named only here.
        shown = [leak for leak in leaks if leak.get("level") != "fail"]
        if not shown:
            what += " (the test's error above has the detail)"
        tr.write_line(f"  {inert(nodeid)}: {what}")
        for leak in shown[:3]:
            tr.write_line(f"    {inert(leak['kind'])}: {inert(leak['detail'])}")
        if len(shown) > 3:
            tr.write_line(f"    ... {len(shown) - 3} more in the JSON report")
    if len(worst) > WORST:
        tr.write_line(f"  ... {len(worst) - WORST} more tests with leaks")


def markdown(
    records: list[Record],
    title: str = "pytest-gpuiso",
    baseline: Summary | None = None,
    where: str = "the JSON report",
) -> str:
    """A summary for PR checks: totals, a test x kind x detail table, timeouts and crashes.

    Each table lists at most ``MARKDOWN_ROWS`` rows; the rest are counted, and said to be
    in ``where`` (a session without a JSON report says how to have one).
    """
    counts = leak_counts(records)
    outcomes = Counter(r["outcome"] for r in records)
    ended = [(r, how) for r in records if (how := _ended(r))]
    leaky = [r for r in records if counted_leaks(r)]
    allowed = sum(1 for r in records for leak in r.get("leaks", []) if leak.get("allowed"))
    lines = [f"## {title}", ""]
    outcome_text = ", ".join(f"{n} {_cell(o)}" for o, n in sorted(outcomes.items()))
    lines.append(f"**{_tests(records)} isolated tests** ({outcome_text or 'none'})")
    lines.append("")
    lines.append("| leaks | " + " | ".join(KINDS) + " | timeouts | crashes |")
    lines.append("|---" * (len(KINDS) + 3) + "|")
    timeouts = sum(1 for r in records if ending(r).kind == "timeout")
    crashes = len(ended) - timeouts
    lines.append(
        f"| {sum(counts.values())} in {_tests(leaky)} tests | "
        + " | ".join(str(counts[k]) for k in KINDS)
        + f" | {timeouts} | {crashes} |"
    )
    if allowed:
        leaks = f"{allowed} leak{'s' if allowed != 1 else ''}"
        lines += ["", f"Not counted: {leaks} allowed by `allow_leaks` markers."]
    known = known_count(records)
    if known:
        leaks = f"{known} leak{'s' if known != 1 else ''}"
        lines += ["", f"Not counted: {leaks} known from the leak baseline."]
    if leaky:
        lines += ["", "### Leaks", "", "| test | kind | detail |", "|---|---|---|"]
        rows = [(r["nodeid"], leak) for r in leaky for leak in counted_leaks(r)]
        for nodeid, leak in rows[:MARKDOWN_ROWS]:
            lines.append(
                f"| {_code_cell(nodeid)} | {_kind(leak['kind'])} | {_cell(leak['detail'])} |"
            )
        if len(rows) > MARKDOWN_ROWS:
            more = len(rows) - MARKDOWN_ROWS
            lines += [
                "",
                f"{more} more {'leak is' if more == 1 else 'leaks are'} in {where}.",
            ]
    failed = [(r, how or _failure(r)) for r in records if (how := _ended(r)) or _failed(r)]
    if failed:
        lines += ["", f"### {FAILED_TITLE}", "", "| test | outcome | how it ended |"]
        lines.append("|---|---|---|")
        for r, how in failed[:MARKDOWN_ROWS]:
            how = f"{cause_rank(r)}{how}"  # a distributed test's: the rank that failed first
            lines.append(f"| {_code_cell(r['nodeid'])} | {_cell(r['outcome'])} | {_cell(how)} |")
        if len(failed) > MARKDOWN_ROWS:
            more = len(failed) - MARKDOWN_ROWS
            lines += [
                "",
                f"{more} more failed {'test is' if more == 1 else 'tests are'} in {where}.",
            ]
    if not leaky and not ended:
        lines += ["", "No leaks, timeouts or crashes."]
    more = health(records) + fixed_table(baseline, MARKDOWN_ROWS) + right_size(records, where)
    return mdtext.bounded(lines + more, f"every test is in {where}")


FAILED_TITLE = "Failed tests, timeouts and crashes"


def _failed(record: Record) -> bool:
    return record["outcome"] in ("failed", "error")


def _failure(record: Record) -> str:
    """How a test that ended normally failed: by its leaks, or in its own code (a
    distributed test's: its first failing rank's error)."""
    kinds = sorted({leak["kind"] for leak in counted_leaks(record) if leak.get("level") == "fail"})
    if kinds:
        return f"its leaks failed it ({', '.join(kinds)})"
    entry = cause_of(record)
    if entry is not None and entry.get("error"):
        return f"failed: {entry['error']}"
    return "failed" if record["outcome"] == "failed" else "error in setup or teardown"


def write_markdown(
    path: Path | None,
    records: list[Record],
    baseline: Summary | None = None,
    report: Path | None = None,
) -> list[str]:
    """Write the Markdown summary to ``path`` and append it to ``$GITHUB_STEP_SUMMARY``.

    Returns where it went; a step summary that cannot be written is skipped with its
    reason (a CI convenience must never fail the session). What its tables leave out is
    in ``report``, the session's JSON report (None: said how to have one)."""
    where = (
        f"the JSON report ({report.name})"
        if report
        else "the JSON report of --gpu-isolate-report=PATH"
    )
    text = markdown(records, baseline=baseline, where=where)
    written = []
    if path is not None:
        write_text(path, text)
        written.append(str(path))
    if step_summary_path():
        problem = append_step_summary(text)
        step = f"${STEP_SUMMARY_ENV}"
        written.append(f"not {step} ({problem})" if problem else step)
    return written
