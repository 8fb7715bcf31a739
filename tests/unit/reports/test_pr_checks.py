"""Leak reports where reviewers look: GitHub annotations at the tests' lines,
GitLab's Code Quality report, the known-leaks baseline, and compare's annotations.

The pull request-shaped pair at the end runs real sessions from fixtures/programs/
test_pr_leaks.py (one leak new, one fixed, one known) and the commands the CI recipe in
docs/ci.md runs; the rest are in-process units, under a second in all."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from pytest_gpuiso.__main__ import main
from pytest_gpuiso.reports import baseline, findings
from pytest_gpuiso.reports.record import SCHEMA_VERSION
from pytest_gpuiso.reports.shards import ReportError
from pytest_gpuiso.values import SpecError, parse_annotations
from tests.helpers import REPORT, ROOT, program


def _line(test: str) -> int:
    """The line of ``def test`` in fixtures/programs/reports/test_pr_leaks.py."""
    lines = (program("test_pr_leaks.py")).read_text().splitlines()
    return lines.index(f"def {test}():") + 1


def _record(nodeid, leaks=(), signal=None, timed_out=False, expired=None, line=3, **more):
    return {
        "nodeid": nodeid,
        "outcome": "failed" if signal or timed_out else "passed",
        "attempt": 1,
        "pid": 100,
        "exit": {"code": 0, "signal": signal, "timed_out": timed_out, "expired": expired},
        "timeout": 2.0,
        "startup_timeout": 300.0,
        "leaks": list(leaks),
        "leak_checks": ["shm", "process"],
        "location": {"file": nodeid.split("::")[0], "line": line},
        **more,
    }


def _leak(kind="shm", level="warn", detail="segment /dev/shm/x (4 bytes) left in /dev/shm"):
    leak = {"kind": kind, "detail": detail}
    if level == "allowed":
        leak["allowed"] = True
    else:
        leak["level"] = level
    return leak


# ------------------------------------------------------------------------ the findings


def test_each_leak_crash_and_timeout_becomes_one_finding_at_its_tests_line():
    records = [
        _record("t.py::test_fail", [_leak(level="fail")], line=10),
        _record("t.py::test_warn", [_leak("process", "warn", "process 7 (sleep) killed")]),
        _record("t.py::test_known", [_leak(level="known")]),
        _record("t.py::test_allowed", [_leak(level="allowed")]),
        _record("t.py::test_crash", signal="SIGSEGV"),
        _record("t.py::test_hang", signal="SIGKILL", timed_out=True, expired="test"),
        _record("t.py::test_slow_start", timed_out=True, expired="startup"),
        _record("t.py::test_stopped", signal="SIGINT") | {"outcome": "interrupted"},
    ]
    found = {(f.nodeid, f.check): f for f in findings.of_records(records)}
    assert {key: f.level for key, f in found.items()} == {
        ("t.py::test_fail", "leak-shm"): "error",
        ("t.py::test_warn", "leak-process"): "warning",
        ("t.py::test_known", "leak-shm"): "notice",
        ("t.py::test_crash", "crash"): "error",
        ("t.py::test_hang", "timeout"): "error",
        ("t.py::test_slow_start", "startup-timeout"): "error",
    }
    fail = found["t.py::test_fail", "leak-shm"]
    assert (fail.file, fail.line, fail.title) == ("t.py", 10, "pytest-gpuiso: shm leak")
    assert fail.message == (
        "t.py::test_fail left a /dev/shm segment behind: segment /dev/shm/x (4 bytes) left "
        "in /dev/shm. It failed the test (--gpu-isolate-leaks)."
    )
    assert "Known: it is in the leak baseline" in found["t.py::test_known", "leak-shm"].message
    assert found["t.py::test_hang", "timeout"].message == (
        "t.py::test_hang timed out after 2 s, and was ended by SIGKILL; its stack at the "
        "timeout is in the test's report."
    )
    assert (
        "did not finish starting within 300 s"
        in found["t.py::test_slow_start", "startup-timeout"].message
    )
    assert found["t.py::test_crash", "crash"].message.endswith("killed by SIGSEGV.")


def test_a_rerun_test_is_annotated_once_from_its_last_attempt():
    first = _record("t.py::test_flaky", signal="SIGSEGV") | {"outcome": "rerun"}
    last = _record("t.py::test_flaky", [_leak(level="warn")]) | {"attempt": 2}
    assert [f.check for f in findings.of_records([first, last, first])] == ["leak-shm"]


def test_workflow_commands_are_escaped_so_a_tests_text_stays_its_message():
    """A message keeps to one line (a test's text can never start a workflow command of
    its own); ``:`` and ``,`` are escaped in properties."""
    detail = "100% of it\n::add-mask::x\r, here: there"
    record = _record("sub/t.py::test_x", [_leak(level="fail", detail=detail)], line=7)
    [line] = findings.github(findings.of_records([record]))
    assert line.startswith("::error file=sub/t.py,line=7,title=pytest-gpuiso%3A shm leak::")
    assert "100%25 of it%0A::add-mask::x%0D, here: there" in line
    assert "\n" not in line and "\r" not in line
    odd = findings.Finding("warning", "a", "c", "x: y, z", "m", "d,e:f.py", None)
    assert findings.github([odd]) == ["::warning file=d%2Ce%3Af.py,title=x%3A y%2C z::m"]


@pytest.mark.parametrize("env", [findings.WORKSPACE_ENV, "CI_PROJECT_DIR", None])
def test_paths_are_the_checkouts_and_kept_in_the_record(tmp_path, monkeypatch, env):
    """The file is named relative to the checkout (GitHub's, GitLab's, else the current
    directory), kept in the record for compare on another machine; a file outside keeps
    its rootdir-relative name."""
    for name in findings.CHECKOUT_ENVS:
        monkeypatch.delenv(name, raising=False)
    if env is None:
        monkeypatch.chdir(tmp_path)
    else:
        monkeypatch.setenv(env, str(tmp_path))
    record = _record("sub/t.py::test_x", [_leak(level="fail")], line=7)
    findings.locate(record, tmp_path / "pkg")
    assert record["location"] == {"file": "sub/t.py", "line": 7, "path": "pkg/sub/t.py"}
    [line] = findings.github(findings.of_records([record]))
    assert line.startswith("::error file=pkg/sub/t.py,line=7,")
    outside = _record("sub/t.py::test_x", [_leak(level="fail")], line=7)
    findings.locate(outside, Path("/elsewhere"))
    assert "path" not in outside["location"]
    assert findings.github(findings.of_records([outside]))[0].startswith("::error file=sub/t.py,")


DECORATED = """import pytest


@pytest.mark.gpu_isolated(timeout=5)
@pytest.mark.parametrize(
    "n",
    ["def", "@x"],  # a def in a string, a comment: def
)
def test_marked(n):
    pass


class TestGroup:
    @pytest.mark.gpu_isolated
    async def test_method(self):
        pass


def test_plain():
    pass
"""


def test_a_decorated_tests_finding_is_at_its_def_not_its_first_decorator(tmp_path, monkeypatch):
    """pytest's location of a decorated test is its first decorator's line (the function's
    co_firstlineno); GitHub showed the annotation there. locate moves it to the def, once
    (locating again changes nothing), and leaves a plain test's line and unreadable files'
    lines as they are."""
    monkeypatch.setenv(findings.WORKSPACE_ENV, str(tmp_path))
    (tmp_path / "t.py").write_text(DECORATED)
    lines = DECORATED.splitlines()
    expected = {
        4: lines.index("def test_marked(n):") + 1,
        14: lines.index("    async def test_method(self):") + 1,
        19: lines.index("def test_plain():") + 1,
    }
    assert lines[3].startswith("@") and lines[13].lstrip().startswith("@")  # 1-based 4, 14
    for pytests_line, def_line in expected.items():
        record = _record("t.py::test_x", [_leak(level="fail")], line=pytests_line)
        findings.locate(record, tmp_path)
        findings.locate(record, tmp_path)
        assert record["location"] == {"file": "t.py", "line": def_line, "path": "t.py"}
        [command] = findings.github(findings.of_records([record]))
        assert command.startswith(f"::error file=t.py,line={def_line},")
    (tmp_path / "broken.py").write_text("@decorator(\n")
    assert findings.def_line(str(tmp_path / "broken.py"), 1) == 1
    assert findings.def_line(str(tmp_path / "absent.py"), 4) == 4


def test_a_tests_leaks_of_one_kind_are_one_annotation():
    """Twelve processes left by one test are one annotation (GitHub shows ten a step), and
    one Code Quality issue with a fingerprint of its own."""
    procs = [_leak("process", "fail", f"process {n} (sleep) killed") for n in range(12)]
    record = _record("t.py::test_spawner", [*procs, _leak(level="warn")])
    found = findings.of_records([record])
    assert [(f.check, f.level) for f in found] == [
        ("leak-process", "error"),
        ("leak-shm", "warning"),
    ]
    assert found[0].message == (
        "t.py::test_spawner left 12 processes running behind: process 0 (sleep) killed (and "
        "11 more in the reports). It failed the test (--gpu-isolate-leaks)."
    )
    issues = json.loads(findings.code_quality(found))
    assert len({i["fingerprint"] for i in issues}) == 2


def test_past_githubs_limit_one_last_notice_counts_the_rest_and_names_their_tests():
    records = [_record(f"t.py::test_{n:02}", [_leak(level="fail")]) for n in range(12)]
    records.append(_record("t.py::test_warned", [_leak(level="warn")]))
    lines = findings.github(findings.of_records(records))
    errors = [line for line in lines if line.startswith("::error")]
    assert errors == [line for line in lines[: findings.PER_LEVEL]]
    assert all(f"test_{n:02}" in line for n, line in enumerate(errors))
    assert lines[findings.PER_LEVEL].startswith("::warning file=t.py,")
    assert len(lines) == findings.PER_LEVEL + 2
    notice = lines[-1]
    assert notice.startswith("::notice title=pytest-gpuiso%3A 2 more not shown::2 more findings")
    assert "(2 errors; GitHub shows 10 annotations of each level a step, 50 a job)" in notice
    assert "in t.py::test_10, t.py::test_11;" in notice


def test_new_findings_and_the_pull_requests_files_come_first():
    """New (errors, warnings) before known (the baseline's notices); among each, tests in
    the files the pull request changed; past ten notices, the ninth is the last shown so
    that the notice counting the rest is seen."""
    known = [_record(f"a.py::test_k{n:02}", [_leak(level="known")]) for n in range(12)]
    warned = [_record(f"a.py::test_w{n}", [_leak(level="warn")]) for n in range(2)]
    changed = [_record("b.py::test_c", [_leak(level="warn")])]
    lines = findings.github(findings.of_records(known + warned + changed), frozenset({"b.py"}))
    assert [line.split(",")[0] for line in lines[:3]] == [
        "::warning file=b.py",
        "::warning file=a.py",
        "::warning file=a.py",
    ]
    notices = [line for line in lines if line.startswith("::notice file=")]
    assert len(notices) == findings.PER_LEVEL - 1 and "test_k00" in notices[0]
    assert lines[-1].startswith("::notice title=pytest-gpuiso%3A 3 more not shown::")
    assert "(3 notices;" in lines[-1]
    # Nothing past the limits: every finding, and no notice about the rest.
    assert len(findings.github(findings.of_records(warned + changed))) == 3


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_changed_files_of_githubs_merge_commit_in_a_shallow_checkout(tmp_path, monkeypatch):
    """Without origin/BASE (actions/checkout fetches the merge commit alone), the merge
    commit's first parent is the base; outside a pull request's run, or where git cannot
    tell (not a repository), no file is changed."""

    def git(*args):
        subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
            cwd=tmp_path,
            check=True,
            capture_output=True,
        )

    monkeypatch.setenv(findings.WORKSPACE_ENV, str(tmp_path))
    monkeypatch.setenv(findings.BASE_REF_ENV, "main")
    assert findings.changed_files() == frozenset()  # not a repository
    (tmp_path / "kept.py").write_text("")
    git("init", "-q", "-b", "main")
    git("add", "kept.py")
    git("commit", "-qm", "base")
    git("checkout", "-qb", "pr")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "t é.py").write_text("")
    git("add", "sub")
    git("commit", "-qm", "pr")
    git("checkout", "-q", "main")
    assert findings.changed_files() == frozenset()  # HEAD is no merge commit
    git("merge", "-q", "--no-ff", "-m", "merge", "pr")
    assert findings.changed_files() == frozenset({"sub/t é.py"})
    monkeypatch.delenv(findings.BASE_REF_ENV)
    assert findings.changed_files() == frozenset()


def test_annotations_are_wanted_on_github_only_unless_asked(monkeypatch):
    monkeypatch.delenv(findings.GITHUB_ENV, raising=False)
    assert [findings.wanted(m) for m in ("auto", "github", "off")] == [False, True, False]
    monkeypatch.setenv(findings.GITHUB_ENV, "true")
    assert [findings.wanted(m) for m in ("auto", "github", "off")] == [True, True, False]


def test_the_code_quality_report_is_gitlabs_format():
    records = [
        _record("t.py::test_a", [_leak(level="fail"), _leak("gpu_memory", "known")], line=4),
        _record("t.py::test_b", signal="SIGABRT") | {"location": None},
    ]
    issues = json.loads(findings.code_quality(findings.of_records(records)))
    assert [(i["check_name"], i["severity"], i["location"]) for i in issues] == [
        ("pytest-gpuiso/leak-shm", "major", {"path": "t.py", "lines": {"begin": 4}}),
        ("pytest-gpuiso/leak-gpu_memory", "info", {"path": "t.py", "lines": {"begin": 4}}),
        ("pytest-gpuiso/crash", "major", {"path": "t.py", "lines": {"begin": 1}}),
    ]
    fingerprints = [i["fingerprint"] for i in issues]
    assert len(set(fingerprints)) == 3  # stable per test and check: GitLab diffs by them
    again = json.loads(findings.code_quality(findings.of_records(records)))
    assert [i["fingerprint"] for i in again] == fingerprints
    assert issues[0]["description"].startswith("pytest-gpuiso: shm leak: t.py::test_a left")


# ------------------------------------------------------------------------ the baseline


def _report(path: Path, *records: dict) -> str:
    path.write_text(json.dumps({"version": SCHEMA_VERSION, "tests": list(records)}))
    return str(path)


def test_a_baseline_from_a_report_round_trips_and_says_what_was_fixed(tmp_path):
    report = _report(
        tmp_path / "base.json",
        _record("t.py::test_a", [_leak(level="warn"), _leak("process", "fail")]),
        _record("t.py::test_b", [_leak(level="allowed")]),
        _record("t.py::test_c", [_leak(level="known")]),
    )
    assert main(["compare", "--write-baseline", str(tmp_path / "known.json"), report]) == 0
    written = baseline.load(str(tmp_path / "known.json"))
    from_report = baseline.load(report)  # a report serves as a baseline too
    expected = {"t.py::test_a": {"shm", "process"}, "t.py::test_c": {"shm"}}
    assert written.known == from_report.known == expected
    assert written.kinds("t.py::test_a") == {"shm", "process"} and not written.kinds("t.py::x")
    now = [
        _record("t.py::test_a", [_leak("process", "known")]),
        _record("t.py::test_c", signal="SIGKILL"),  # crashed: maybe before its leak
    ]
    assert written.fixed(now) == [("t.py::test_a", "shm")]
    unchecked = [
        _record("t.py::test_a", [_leak("process", "known")]) | {"leak_checks": ["process"]}
    ]
    assert written.fixed(unchecked) == []  # shm=off: its leak was not looked for
    for stopped in (
        _record("t.py::test_c", timed_out=True, expired="test"),
        _record("t.py::test_c") | {"outcome": "skipped"},
        _record("t.py::test_c") | {"outcome": "interrupted"},
    ):
        assert written.fixed([stopped]) == []
    assert written.fixed([_record("t.py::test_c")]) == [("t.py::test_c", "shm")]
    assert written.not_run(now) == []
    assert written.not_run(now[:1]) == ["t.py::test_c"]
    summary = written.summary(now)
    assert (summary["entries"], summary["known"]) == (3, 1)
    assert summary["fixed"] == [{"nodeid": "t.py::test_a", "kind": "shm"}]


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("", "empty file"),
        ("  \n", "empty file"),
        ('{"format": "pytest-gpuiso leak baseline", "version": 1, "leaks": [', "not JSON"),
        ('{"format": "pytest-gpuiso leak baseline", "version": 2, "leaks": []}', "version 2"),
        ('{"format": "pytest-gpuiso leak baseline", "version": 1}', "'leaks' is not a list"),
        ('{"format": "pytest-gpuiso leak baseline", "version": 1, "leaks": [3]}', "entry 0 is"),
        (
            '{"format": "pytest-gpuiso leak baseline", "version": 1, "leaks": [{"kind": "shm"}]}',
            "entry 0 has no 'nodeid' string",
        ),
        (
            '{"format": "pytest-gpuiso leak baseline", "version": 1, '
            '"leaks": [{"nodeid": "t.py::x", "kind": "disk"}]}',
            "entry 0 has kind 'disk', expected one of shm, process, gpu_memory",
        ),
        ('{"leaks": []}', "neither a leak baseline nor a pytest-gpuiso JSON report"),
        ('{"version": 7, "tests": []}', "report version 7, expected 1"),
        ('{"version": 1, "tests": null}', "neither a leak baseline nor a pytest-gpuiso JSON"),
    ],
)
def test_a_baseline_that_cannot_serve_is_one_line_naming_the_file(tmp_path, content, problem):
    path = tmp_path / "known.json"
    path.write_text(content)
    with pytest.raises(ReportError) as raised:
        baseline.load(str(path))
    assert str(raised.value).startswith(f"{path}: ") and problem in str(raised.value)
    assert "\n" not in str(raised.value)


def test_an_empty_list_of_leaks_is_a_baseline_that_knows_nothing(tmp_path):
    path = tmp_path / "known.json"
    path.write_text('{"format": "pytest-gpuiso leak baseline", "version": 1, "leaks": []}')
    assert baseline.load(str(path)).known == {}


def test_a_missing_baseline_file_knows_nothing_and_says_so_in_one_line(tmp_path):
    """The CI recipe's first run names a baseline no run has written yet: read as empty,
    said in one line of the summary, where it used to stop the session."""
    path = tmp_path / "known-leaks.json"
    found = baseline.load(str(path))
    assert (found.known, found.missing) == ({}, True)
    summary = found.summary([_record("t.py::test_a", [_leak(level="warn")])])
    assert summary["missing"] is True and summary["entries"] == 0
    assert baseline.baseline_lines(summary, 5) == [
        f"gpu-isolate: leak baseline {path}: no such file, read as empty (no known leaks); "
        "write it with python -m pytest_gpuiso compare --write-baseline FILE REPORT"
    ]
    (tmp_path / "known.json").write_text(baseline.text([]))
    assert baseline.load(str(tmp_path / "known.json")).missing is False


def test_a_path_there_that_is_no_baseline_stays_an_error(tmp_path):
    """Only nothing at all is empty: a dangling link or a folder is the user's mistake."""
    (tmp_path / "link.json").symlink_to(tmp_path / "nowhere.json")
    (tmp_path / "folder.json").mkdir()
    for name, problem in (
        ("link.json", "cannot read: No such file or directory"),
        ("folder.json", "cannot read: Is a directory"),
    ):
        with pytest.raises(ReportError) as raised:
            baseline.load(str(tmp_path / name))
        assert str(raised.value) == f"{tmp_path / name}: {problem}"


def test_the_baseline_file_docs_ci_md_shows_is_one_that_loads(tmp_path):
    """docs/ci.md documents the file's format with an example: it is one."""
    text = (ROOT / "docs" / "ci.md").read_text().split("### The baseline file", 1)[1]
    example = text.split("```json\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "known.json"
    path.write_text(example)
    assert baseline.load(str(path)).known == {
        "tests/test_io.py::test_loader": frozenset({"shm", "process"})
    }


# ------------------------------------------------------------------------ compare's side


def test_compare_annotates_what_is_new_and_writes_it_for_gitlab(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(findings.GITHUB_ENV, raising=False)
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    base = _report(tmp_path / "b.json", _record("t.py::test_a"), _record("t.py::test_b"))
    head = _report(
        tmp_path / "h.json",
        _record("t.py::test_a", [_leak(level="fail")], line=12),
        _record("t.py::test_b"),
    )
    quality = tmp_path / "cq.json"
    assert main(["compare", base, head, "--code-quality", str(quality)]) == 1
    out = capsys.readouterr().out
    assert not [line for line in out.splitlines() if line.startswith("::")]  # not on GitHub
    [issue] = json.loads(quality.read_text())
    assert (issue["check_name"], issue["location"]["lines"]["begin"]) == (
        "pytest-gpuiso/new-leak-shm",
        12,
    )
    monkeypatch.setenv(findings.GITHUB_ENV, "true")
    assert main(["compare", base, head]) == 1
    commands = [line for line in capsys.readouterr().out.splitlines() if line.startswith("::")]
    assert commands == [
        "::error file=t.py,line=12,title=pytest-gpuiso%3A new against the base%3A leak shm::"
        "t.py::test_a: leak shm: segment /dev/shm/x (4 bytes) left in /dev/shm (not in the "
        "base's report)."
    ]
    assert main(["compare", base, head, "--annotations", "off"]) == 1
    assert "::error" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["compare", "a.json"], "give two reports, BASE and HEAD (one only with --write-baseline)"),
        (["compare", "a", "b", "c"], "compare: error: unrecognized arguments: c"),
        (["compare"], "give two reports, BASE and HEAD (one only with --write-baseline)"),
        (["compare", "a", "b", "--peak-growth", "nan"], "--peak-growth: not a number >= 0: 'nan'"),
        (["compare", "a", "b", "--startup-growth", "-1"], "--startup-growth: not a number >= 0"),
        (["compare", "a", "b", "--annotations", "loud"], "invalid choice: 'loud'"),
        (
            ["compare", "a", "--write-baseline", "k.json", "--markdown", "c.md"],
            "--markdown and --code-quality need two reports, BASE and HEAD",
        ),
    ],
)
def test_compare_usage_errors_exit_2(args, problem, capsys):
    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code == 2 and problem in capsys.readouterr().err


# ------------------------------------------------------------ a pull request, end to end


@pytest.mark.installation
def test_a_pull_request_with_one_leak_new_one_fixed_one_known(gpuiso_spawn, monkeypatch):
    """The pull request's run under xdist on GitHub Actions, leaks failing, with a
    baseline of the base branch's two leaks and a test since removed: the new leak fails
    its test and is one error annotation at its line (once, from the controller), the
    known one is a notice and fails nothing, the fixed one is reported fixed, the removed
    test named; the same findings in the Code Quality report, the Markdown and the JSON.
    (The base branch's run, the baseline it writes and compare: the CI recipe's test.)"""
    shm = f"gpuiso-pr-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("GPUISO_SHM_NAME", shm)
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    path = gpuiso_spawn.path
    gpuiso_spawn.copy("test_pr_leaks.py")
    known = path / "known.json"
    entries = [
        {"nodeid": f"test_pr_leaks.py::{name}", "kind": "shm"}
        for name in ("test_known", "test_fixed", "test_removed")
    ]
    known.write_text(json.dumps({"format": baseline.FORMAT, "version": 1, "leaks": entries}))
    monkeypatch.setenv("PR_SIDE", "head")
    monkeypatch.setenv(findings.GITHUB_ENV, "true")
    monkeypatch.setenv(findings.WORKSPACE_ENV, str(path))
    try:
        head = gpuiso_spawn.run(
            "-n",
            "2",
            "--gpu-isolate",
            "--gpu-isolate-leaks=fail",
            "--gpu-isolate-leak-baseline=known.json",
            "--gpu-isolate-report=head.json",
            "--gpu-isolate-code-quality=quality.json",
            "--gpu-isolate-summary=summary.md",
        )
    finally:
        for leaked in Path("/dev/shm").glob(f"{shm}-*"):
            leaked.unlink()
    head.assert_outcomes(passed=3, errors=1)  # test_new's leak fails its teardown
    out = head.stdout.str()
    commands = [line for line in out.splitlines() if line.startswith("::")]
    assert [c.split("::")[1] for c in commands] == [
        f"error file=test_pr_leaks.py,line={_line('test_new')},title=pytest-gpuiso%3A shm leak",
        f"notice file=test_pr_leaks.py,line={_line('test_known')},"
        "title=pytest-gpuiso%3A shm leak (known)",
    ]
    assert (
        f"test_pr_leaks.py::test_new left a /dev/shm segment behind: segment /dev/shm/{shm}-new"
        in commands[0]
    )
    head.stdout.fnmatch_lines(
        [
            f"gpu-isolate: leak baseline {known}: 1 known leaks reported, 1 of its 3 entries "
            "fixed, 1 of its tests not run",
            "  FIXED test_pr_leaks.py::test_fixed: shm (no longer leaks)",
            "gpu-isolate: not run here (*): test_pr_leaks.py::test_removed",
        ]
    )
    report = json.loads((path / "head.json").read_text())
    assert report["baseline"]["fixed"] == [
        {"nodeid": "test_pr_leaks.py::test_fixed", "kind": "shm"}
    ]
    levels = {t["nodeid"]: [leak["level"] for leak in t["leaks"]] for t in report["tests"]}
    assert levels == {
        "test_pr_leaks.py::test_known": ["known"],
        "test_pr_leaks.py::test_fixed": [],
        "test_pr_leaks.py::test_new": ["fail"],
    }
    quality = json.loads((path / "quality.json").read_text())
    assert sorted((i["severity"], i["location"]["lines"]["begin"]) for i in quality) == [
        ("info", _line("test_known")),
        ("major", _line("test_new")),
    ]
    summary = (path / "summary.md").read_text()
    assert "Not counted: 1 leak known from the leak baseline." in summary
    assert "### Fixed since the leak baseline" in summary


@pytest.mark.installation
def test_a_baseline_no_run_has_written_yet_is_read_as_empty(gpuiso_spawn, monkeypatch):
    """The CI recipe's first run: the baseline's file is not there; the session runs, with
    no known leaks, and says so in one line (it used to stop at its start)."""
    monkeypatch.setenv("PR_SIDE", "head")
    gpuiso_spawn.copy("test_pr_leaks.py")
    args = ("--gpu-isolate-leak-baseline=known.json", "-k", "test_fixed", REPORT)
    result = gpuiso_spawn.run("--gpu-isolate", *args)
    result.assert_outcomes(passed=1)
    assert result.ret == 0
    [said] = [line for line in result.stdout.lines if "leak baseline" in line]
    assert said == (
        f"gpu-isolate: leak baseline {gpuiso_spawn.path}/known.json: no such file, read as "
        "empty (no known leaks); write it with python -m pytest_gpuiso compare "
        "--write-baseline FILE REPORT"
    )
    assert gpuiso_spawn.report()["baseline"]["missing"] is True


@pytest.mark.installation
@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (
            ["--gpu-isolate-leak-baseline=known.json"],
            "--gpu-isolate-leak-baseline: {path}/known.json: empty file",
        ),
        (
            ["--gpu-isolate-annotations=loud"],
            "invalid value 'loud' for --gpu-isolate-annotations: expected auto, github, off",
        ),
    ],
)
def test_a_bad_option_stops_the_session_in_one_line(gpuiso_spawn, args, problem):
    gpuiso_spawn.copy("test_pr_leaks.py")
    (gpuiso_spawn.path / "known.json").write_text("")
    result = gpuiso_spawn.run("--gpu-isolate", *args, REPORT)
    assert result.ret == 4
    problem = problem.format(path=gpuiso_spawn.path)
    assert result.stderr.lines[0] == f"ERROR: gpu-isolate: {problem}"
    assert "Traceback" not in result.stderr.str() + result.stdout.str()


# ------------------------------------------------------------- the CI recipe's commands


def _recipe() -> tuple[list[str], list[str]]:
    """The CI recipe's workflow in docs/ci.md: its matrix's groups, and the ``pytest`` and
    ``python -m pytest_gpuiso`` commands of its ``run:`` steps, continuation lines joined."""
    text = (ROOT / "docs" / "ci.md").read_text()
    workflow = text.split("## A CI recipe: GitHub Actions", 1)[1].split("```yaml\n", 1)[1]
    workflow = workflow.split("```", 1)[0]
    groups = re.search(r"^\s+group: \[(.*)\]$", workflow, re.M).group(1).split(", ")
    commands, lines = [], workflow.splitlines()
    for n, line in enumerate(lines):
        step = re.match(r"^(\s*)(?:- )?run: (.*)$", line)
        if step is None:
            continue
        script = [step.group(2)] if step.group(2) != "|" else []
        for more in lines[n + 1 :]:
            if more.strip() and len(more) - len(more.lstrip()) <= len(step.group(1)):
                break
            script.append(more.strip())
        for command in "\n".join(script).replace("\\\n", " ").splitlines():
            if command.startswith(("pytest ", "python -m pytest_gpuiso ")):
                commands.append(command)
    return groups, commands


SLOW = "import time\n\n\ndef test_model():\n    pass\n\n\ndef test_slow():\n    time.sleep(1.5)\n"


def _split(ran: subprocess.CompletedProcess) -> float:
    """The estimated duration pytest-split says its group has."""
    found = re.search(
        r"\[pytest-split\] Running group \d+/\d+ \(estimated duration: ([\d.]+)s\)", ran.stdout
    )
    assert found, ran.stdout
    return float(found.group(1))


@pytest.mark.installation
def test_the_ci_recipes_commands_on_a_pull_request(tmp_path, monkeypatch):
    """The recipe's own commands, run as its workflow runs them: the base branch's shards
    (its first run: no durations, so pytest-split splits by count; no baseline file yet,
    read as empty, so its two leaks fail), merged, its durations and its leaks written;
    then the pull request's shards, split by the durations the base's isolated runs
    measured, merged and compared with the base's report: the new leak fails its shard and
    the comparison (exit 1) and is its one annotation, the known one fails nothing, the
    fixed one is listed."""
    pytest.importorskip("pytest_split")
    groups, commands = _recipe()
    shard, merge, compare = commands[0], commands[1], commands[2]
    assert groups == ["1", "2"] and len(commands) == 3
    split = "pytest tests --splits 2 --group ${{ matrix.group }} --durations-path .test_durations "
    assert shard.startswith(split) and "--gpu-isolate " in shard
    assert merge.startswith("python -m pytest_gpuiso merge shard-*.json --json report.json")
    assert merge.endswith(" --durations .test_durations")
    assert compare.startswith("python -m pytest_gpuiso compare base/report.json report.json")
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    (tmp_path / "tests" / "models").mkdir()
    shutil.copy(program("test_pr_leaks.py"), tmp_path / "tests" / "unit")
    (tmp_path / "tests" / "models" / "test_model.py").write_text(SLOW)
    shm = f"gpuiso-ci-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        "PYTEST_ADDOPTS": "-p gpuiso -p xdist -p pytest_split.plugin -p no:cacheprovider "
        "--gpu-isolate-preload=none",
        # -n auto is a worker per GPU slot; on this machine without GPUs, none (xdist's
        # knob): the annotations' xdist path is the pull request test's above
        "PYTEST_XDIST_AUTO_NUM_WORKERS": "0",
        "GPUISO_SHM_NAME": shm,
        findings.GITHUB_ENV: "true",
        findings.WORKSPACE_ENV: str(tmp_path),
        "GITHUB_STEP_SUMMARY": str(tmp_path / "step-summary.md"),
    }

    def run(command: str, side: str) -> subprocess.CompletedProcess:
        ran = subprocess.run(
            ["bash", "-c", command],
            cwd=tmp_path,
            env={**env, "PR_SIDE": side},
            capture_output=True,
            text=True,
            timeout=300,
        )
        for leaked in Path("/dev/shm").glob(f"{shm}-*"):
            leaked.unlink()
        return ran

    def shards(side: str) -> dict[str, tuple[int, float, list[str]]]:
        """Each group's exit status, pytest-split's estimate and the tests it ran."""
        found = {}
        for group in groups:
            ran = run(shard.replace("${{ matrix.group }}", group), side)
            assert not [line for line in ran.stdout.splitlines() if line.startswith("::")]
            tests = json.loads((tmp_path / f"shard-{group}.json").read_text())["tests"]
            found[group] = (ran.returncode, _split(ran), [t["nodeid"] for t in tests])
        ran_tests = sorted(t for _, _, tests in found.values() for t in tests)
        assert len(ran_tests) == 5 and len(set(ran_tests)) == 5  # each test once
        return found

    (tmp_path / ".test_durations").write_text("{}")  # the recipe's first run: none yet
    base = shards("base")
    assert sorted(code for code, _, _ in base.values()) in ([0, 1], [1, 1])  # its two leaks
    assert run(merge, "base").returncode == 0
    durations = json.loads((tmp_path / ".test_durations").read_text())
    assert sorted(durations) == sorted(t for _, _, tests in base.values() for t in tests)
    assert durations["tests/models/test_model.py::test_slow"] >= 1.5  # its process's wall time
    written = run(
        "python -m pytest_gpuiso compare --write-baseline known-leaks.json report.json", "base"
    )
    assert written.returncode == 0 and "(2 leaks of report.json)" in written.stdout
    (tmp_path / "base").mkdir()
    (tmp_path / "report.json").rename(tmp_path / "base" / "report.json")  # the artifact

    # The pull request's run splits by the durations the base's isolated runs measured:
    # each group's estimate is what the file says of its tests. pytest-split's default
    # (duration_based_chunks) cuts the tests, in order, into runs of about half the total:
    # the first overshoots it by at most one test, so the groups differ by at most two
    # tests' time (each estimate is printed to 0.01 s).
    head = shards("head")
    for _code, estimate, tests in head.values():
        assert estimate == pytest.approx(sum(durations[t] for t in tests), abs=0.011)
    one, two = (estimate for _, estimate, _ in head.values())
    assert abs(one - two) <= 2 * max(durations.values()) + 0.011
    [leaking] = [g for g, (_, _, tests) in head.items() if any("test_new" in t for t in tests)]
    assert head[leaking][0] == 1  # the new leak fails its shard; the known one not
    unit = json.loads((tmp_path / f"shard-{leaking}.json").read_text())
    assert {t["nodeid"]: t["outcome"] for t in unit["tests"]}[
        "tests/unit/test_pr_leaks.py::test_new"
    ] == "error"
    assert run(merge, "head").returncode == 0
    compared = run(compare, "head")
    assert compared.returncode == 1, compared.stderr
    runs, out = compared.stdout.splitlines()[:2], compared.stdout.splitlines()[2:]
    # what run each side is of, from the merged shards' sessions (the same runner here)
    assert runs[0].startswith("base: started ") and runs[1].startswith("head: started ")
    assert "warning" not in compared.stderr
    new = f"NEW    tests/unit/test_pr_leaks.py::test_new: leak shm: segment /dev/shm/{shm}-new ("
    assert out[0].startswith(new)
    assert out[1:3] == [
        "FIXED  tests/unit/test_pr_leaks.py::test_fixed: leak shm",
        "compared 5 tests: 1 new, 1 fixed",
    ]
    [annotation] = [line for line in out if line.startswith("::")]
    where = f"file=tests/unit/test_pr_leaks.py,line={_line('test_new')}"
    assert annotation.startswith(f"::error {where},title=pytest-gpuiso%3A new against the base")
    step = (tmp_path / "step-summary.md").read_text()
    # each session's summary (a step of its own in the workflow) and the two merges'
    assert step.splitlines().count("## pytest-gpuiso") == 6
    assert "## pytest-gpuiso: against the base" in step and "### New" in step
    assert "### New" in (tmp_path / "compare.md").read_text()


@pytest.mark.parametrize("value", ["loud", "", "githubb"])
def test_a_bad_annotations_value_names_the_option(value):
    with pytest.raises(SpecError) as raised:
        parse_annotations(value, "--gpu-isolate-annotations")
    assert str(raised.value) == (
        f"invalid value {value!r} for --gpu-isolate-annotations: expected auto, github, off"
    )
    assert parse_annotations(" GitHub ", "ini gpu_isolate_annotations") == "github"
