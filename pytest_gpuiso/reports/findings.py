"""Findings at the tests' lines: GitHub Actions annotations and GitLab's Code Quality report.

One list of ``Finding``s, made from a session's records (each leak, crash and timeout of
each test's last attempt: once per test, however many workers or attempts) or from a
comparison with the base branch (what is new), is written out as

* GitHub Actions workflow commands (``::error file=F,line=L,title=T::message``) on the
  step's output, which GitHub shows at the test's line in the pull request. GitHub shows
  ``PER_LEVEL`` of each level a step and ``PER_JOB`` a job and drops the rest silently,
  so they are chosen on purpose: new findings before known ones (the baseline's notices),
  tests in the files the pull request changed first (``changed_files``), errors before
  warnings; what does not fit is counted in one last "N more not shown" notice;
* a GitLab Code Quality report (JSON), which a merge request shows in its widget.

Each workflow command is a line of its own that needs no earlier line, with one limit:
GitHub reads none after ``::stop-commands::TOKEN`` until ``::TOKEN::``. The test's text
pytest-gpuiso prints (a leak's detail) starts no line (``termtext.inert``), but what a
test writes to the step's output itself (``-s``, ``capsys.disabled()``, a process of its
own) can stop them, and no later line resumes without its token (docs/security.md).
"""

from __future__ import annotations

import hashlib
import json
import linecache
import os
import subprocess
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..termtext import escaped
from .record import Record, ending, last_attempts
from .report import bound

GITHUB_ENV = "GITHUB_ACTIONS"  # "true" on GitHub Actions' runners
WORKSPACE_ENV = "GITHUB_WORKSPACE"  # the checkout, which annotation paths are relative to
PER_LEVEL = 10  # annotations of one level GitHub shows for a step
PER_JOB = 50  # annotations GitHub shows for a job, all its steps together
BASE_REF_ENV = "GITHUB_BASE_REF"  # a pull request's base branch, on its workflow runs
GIT_TIMEOUT = 10.0  # seconds git may take to name the changed files
LEVELS = ("error", "warning", "notice")
SEVERITY = {"error": "major", "warning": "minor", "notice": "info"}  # Code Quality's
LEAKED = {  # what a test left behind: one, and {n} of them
    "shm": ("a /dev/shm segment", "{n} /dev/shm segments"),
    "process": ("a process running", "{n} processes running"),
    "gpu_memory": ("GPU memory in use", "{n} GPU memory leaks"),
}
WHY = {  # a leak's level in its record: what became of it
    "fail": "It failed the test (--gpu-isolate-leaks).",
    "warn": "Reported, not failed (--gpu-isolate-leaks=warn).",
    "known": "Known: it is in the leak baseline, so it does not fail the test.",
}
LEVEL = {"fail": "error", "warn": "warning", "known": "notice"}  # its annotation's
CHECKOUT_ENVS = (WORKSPACE_ENV, "CI_PROJECT_DIR")  # GitHub's checkout, GitLab's
STARTUP = " (interpreter, plugins, conftests, imports)"
TIMEOUTS = {  # the bound a process ran past -> its check, its title, what to add to it
    "startup": ("startup-timeout", "start-up timed out", STARTUP),
    "exit": ("exit-timeout", "process did not exit", ""),
    "test": ("timeout", "test timed out", ""),
    "group": ("rank-stopped", "rank stopped after another ended", ""),
}
STACK = "; its stack at the timeout is in the test's report"


@dataclass(frozen=True)
class Finding:
    level: str  # LEVELS
    nodeid: str
    check: str  # "leak-shm", "crash", "timeout", "startup-timeout", "exit-timeout", "new-..."
    title: str
    message: str  # understood without the log
    file: str | None = None  # the test's file, relative to the checkout (else the rootdir)
    line: int | None = None  # 1-based


def wanted(mode: str) -> bool:
    """Whether GitHub annotations are written: ``github``, or ``auto`` on GitHub Actions."""
    return mode == "github" or (mode == "auto" and os.environ.get(GITHUB_ENV) == "true")


def locate(record: Record, rootdir: Path) -> None:
    """Make the record's location the one GitHub and GitLab show a finding at: its line
    the test's ``def`` (``def_line``), and its ``path`` the test file's relative to the
    checkout (``GITHUB_WORKSPACE``, GitLab's ``CI_PROJECT_DIR``, else the current
    directory), where it lies inside. Kept in the JSON report, so that ``compare`` on
    another machine names the same place. Called again on a located record, it changes
    nothing."""
    location = record.get("location")
    if not isinstance(location, dict) or not isinstance(location.get("file"), str):
        return
    full = os.path.normpath(os.path.join(rootdir, location["file"]))
    if isinstance(location.get("line"), int) and not isinstance(location["line"], bool):
        location["line"] = def_line(full, location["line"])
    top = next((os.environ[name] for name in CHECKOUT_ENVS if os.environ.get(name)), "")
    top = os.path.abspath(top or os.getcwd())
    if os.path.commonpath([full, top]) == top:
        location["path"] = os.path.relpath(full, top)


def def_line(file: str, line: int) -> int:
    """The line (1-based) of the ``def`` that the decorator at ``line`` of ``file`` starts:
    pytest's location of a decorated test is its first decorator's line (the function's
    ``co_firstlineno``), where a reviewer looks for the test's name. ``line`` itself where
    that is no decorator, or the file cannot be read or read as Python."""
    lines = linecache.getlines(file)
    if not 0 < line <= len(lines) or not lines[line - 1].lstrip().startswith("@"):
        return line
    try:  # a decorator's arguments may span lines, hold strings, comments, brackets
        for token in tokenize.generate_tokens(iter(lines[line - 1 :]).__next__):
            if token.type == tokenize.NAME and token.string in ("def", "class"):
                return line + token.start[0] - 1
    except (tokenize.TokenError, SyntaxError):  # IndentationError is one
        pass
    return line


def _where(record: Record) -> tuple[str | None, int | None]:
    """The test's file (relative to the checkout where known, else to the rootdir) and
    line; without a location, the file its node id names."""
    location = record.get("location")
    if isinstance(location, dict) and isinstance(location.get("file"), str):
        line = location.get("line")
        path = location.get("path")
        file = path if isinstance(path, str) else location["file"]
        whole = isinstance(line, int) and not isinstance(line, bool)  # JSON's true is no line
        return file, line if whole and line > 0 else None
    return record["nodeid"].split("::")[0] or None, None


def _ending(record: Record) -> tuple[str, str, str] | None:
    """(check, title, what happened) of a process that timed out or crashed; None else."""
    ended = ending(record)
    if ended.kind == "timeout":
        check, title, more = TIMEOUTS[ended.expired or "test"]
        by = f", and was ended by {ended.signal}" if ended.signal else ""
        return check, title, f"{bound(record)}{more}{by}" + (STACK if check == "timeout" else "")
    if ended.kind == "crash":
        return "crash", "test process crashed", f"its process was killed by {ended.signal}"
    return None


def of_records(records: list[Record]) -> list[Finding]:
    """Each test's crash or timeout (an error) and leaks (an error where it failed the
    test, a warning where it was warned of, a notice where the baseline knows it)."""
    found = []
    for nodeid, record in sorted(last_attempts(records).items()):
        file, line = _where(record)
        ended = _ending(record)
        if ended is not None:
            check, title, what = ended
            message = f"{nodeid} {what}."
            found.append(
                Finding("error", nodeid, check, f"pytest-gpuiso: {title}", message, file, line)
            )
        groups: dict[tuple[str, str], list[str]] = {}  # (kind, level) -> the details
        for leak in record.get("leaks", []):
            level = leak.get("level", "warn")
            if not (leak.get("allowed") or leak.get("ignored")) and level in WHY:
                groups.setdefault((leak["kind"], level), []).append(leak["detail"])
        for (kind, level), details in groups.items():
            one, many = LEAKED.get(kind, (f"a {kind} leak", "{n} " + kind + " leaks"))
            what = one if len(details) == 1 else many.format(n=len(details))
            more = f" (and {len(details) - 1} more in the reports)" if len(details) > 1 else ""
            message = f"{nodeid} left {what} behind: {details[0]}{more}. {WHY[level]}"
            title = f"pytest-gpuiso: {kind} leak" + (" (known)" if level == "known" else "")
            found.append(Finding(LEVEL[level], nodeid, f"leak-{kind}", title, message, file, line))
    return found


def of_changes(new: list[Any], head: list[dict[str, Any]]) -> list[Finding]:
    """An error for each change ``compare`` found new, at its test's line in HEAD."""
    last = last_attempts(head)
    found = []
    for change in new:
        file, line = _where(last[change.nodeid])
        check = "new-" + change.what.replace(" ", "-").lower()
        title = f"pytest-gpuiso: new against the base: {change.what}"
        message = f"{change.nodeid}: {change.what}: {change.detail} (not in the base's report)."
        found.append(Finding("error", change.nodeid, check, title, message, file, line))
    return found


def _data(text: str) -> str:
    """A workflow command's message, escaped (GitHub's rules for ``%`` and line breaks;
    any other unprintable character, a lone surrogate too, as its Python escape)."""
    text = escaped(text, keep="\r\n")
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _property(text: str) -> str:
    """A workflow command's property value, escaped (``:`` and ``,`` end one)."""
    return _data(text).replace(":", "%3A").replace(",", "%2C")


def _command(finding: Finding) -> str:
    props = []
    if finding.file is not None:
        props.append(f"file={_property(finding.file)}")
        if finding.line is not None:
            props.append(f"line={finding.line}")
    props.append(f"title={_property(finding.title)}")
    return f"::{finding.level} {','.join(props)}::{_data(finding.message)}"


def changed_files() -> frozenset[str]:
    """The files a pull request changed, relative to the checkout (as ``locate`` names
    them), on a pull request's workflow run (``GITHUB_BASE_REF``): against the base
    branch's merge base (``origin/BASE...HEAD``), else, where HEAD is GitHub's merge
    commit of the pull request (a shallow checkout), against its first parent; empty
    where git cannot tell (no git, no repository, the base not fetched)."""
    base = os.environ.get(BASE_REF_ENV)
    if not base:
        return frozenset()
    top = next((os.environ[name] for name in CHECKOUT_ENVS if os.environ.get(name)), None)
    said = _git(top, "diff", "-z", "--name-only", "--relative", f"origin/{base}...HEAD", "--")
    if said is None and _git(top, "rev-parse", "-q", "--verify", "HEAD^2") is not None:
        said = _git(top, "diff", "-z", "--name-only", "--relative", "HEAD^1", "HEAD", "--")
    return frozenset(os.fsdecode(p) for p in (said or b"").split(b"\0") if p)


def _git(where: str | None, *args: str) -> bytes | None:
    """What ``git ARGS`` printed in ``where``; None where it failed or could not run."""
    try:
        ran = subprocess.run(
            ["git", *args],
            cwd=where,
            capture_output=True,
            timeout=GIT_TIMEOUT,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError):  # no git, a hung one, no such folder
        return None
    return ran.stdout if ran.returncode == 0 else None


def _first(finding: Finding, changed: frozenset[str]) -> tuple[bool, bool, int]:
    """The order annotations are chosen in: new before known, the pull request's files
    first, then by level."""
    known = finding.level == "notice"  # a leak the baseline knows
    return known, finding.file not in changed, LEVELS.index(finding.level)


def workflow_commands(findings: list[Finding]) -> list[str]:
    """``github`` of the findings in the pull request's order (git is asked only when
    there is something to annotate)."""
    return github(findings, changed_files() if findings else frozenset())


def github(findings: list[Finding], changed: frozenset[str] = frozenset()) -> list[str]:
    """The workflow commands of the findings GitHub will show (``_first`` chooses them,
    ``changed``: the pull request's files), and where some do not fit, a last notice
    saying how many more there are and in which tests."""
    ordered = sorted(findings, key=lambda f: _first(f, changed))  # stable: report order
    shown = _fit(ordered, PER_LEVEL, PER_JOB)
    if len(shown) < len(ordered):  # room for the notice that says so
        shown = _fit(ordered, PER_LEVEL, PER_JOB - 1, notices=PER_LEVEL - 1)
    lines = [_command(f) for f in shown]
    chosen = set(map(id, shown))
    rest = [f for f in ordered if id(f) not in chosen]
    if rest:
        counts = ", ".join(
            f"{n} {level}{'s' if n != 1 else ''}"
            for level in LEVELS
            if (n := sum(f.level == level for f in rest))
        )
        tests = list(dict.fromkeys(f.nodeid for f in rest))
        names = ", ".join(tests[:20]) + (f" and {len(tests) - 20} more" if len(tests) > 20 else "")
        title = f"pytest-gpuiso: {len(rest)} more not shown"
        message = (
            f"{len(rest)} more findings not shown ({counts}; GitHub shows {PER_LEVEL} "
            f"annotations of each level a step, {PER_JOB} a job), in {names}; all are in "
            "the log's gpu-isolate summary and the reports."
        )
        lines.append(f"::notice title={_property(title)}::{_data(message)}")
    return lines


def _fit(
    ordered: list[Finding], per_level: int, total: int, notices: int = PER_LEVEL
) -> list[Finding]:
    """The first findings of ``ordered`` that fit: ``per_level`` of errors and warnings,
    ``notices`` notices, ``total`` in all."""
    room = {level: per_level for level in LEVELS} | {"notice": notices}
    shown = []
    for finding in ordered:
        if len(shown) < total and room[finding.level] > 0:
            room[finding.level] -= 1
            shown.append(finding)
    return shown


def code_quality(findings: list[Finding]) -> str:
    """GitLab's Code Quality report (a JSON list) of the findings; its text escaped
    (``termtext.escaped``): a lone surrogate is no JSON every parser takes."""
    issues = []
    for f in findings:
        path = escaped(f.file or f.nodeid.split("::")[0])
        key = f"{f.nodeid}\0{f.check}\0{f.level}".encode("utf-8", "surrogatepass")
        fingerprint = hashlib.sha256(key).hexdigest()  # a node id may hold a lone surrogate
        issues.append(
            {
                "description": escaped(f"{f.title}: {f.message}"),
                "check_name": f"pytest-gpuiso/{f.check}",
                "fingerprint": fingerprint,
                "severity": SEVERITY[f.level],
                "location": {"path": path, "lines": {"begin": f.line or 1}},
            }
        )
    return json.dumps(issues, indent=2, ensure_ascii=False) + "\n"
