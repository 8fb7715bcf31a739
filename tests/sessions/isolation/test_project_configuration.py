"""The project's own configuration is law: a strict project (warnings as errors, strict
markers and config, xfail_strict, live logs) runs isolated as it runs in-process, and a
test's process that cannot start says its own reason, once the same reason repeats for
every later test at once, and stops a session where none can start. Each test runs the
programs in fixtures/programs/isolation/ through a real pytest session."""

from __future__ import annotations

import json
import os
import re

import pytest

from tests.helpers import REPORT

STRICT = "strict_project"
FAILS = "start_fails"
STRICT_OUTCOMES = {"passed": 4, "failed": 1, "xfailed": 1}
CAUSE = "RuntimeError: this plugin cannot run here"


def _summary(result: pytest.RunResult) -> set[str]:
    """The short test summary's line of each test (-rA), e.g. "PASSED test_strict.py::x"."""
    return {
        line for line in result.outlines if re.match(r"(PASSED|FAILED|ERROR|XFAIL) \S+::", line)
    }


def _strict(gpuiso, monkeypatch) -> None:
    """The strict project, with a plugin distribution that lists pytest_gpuiso's files (as
    an installed wheel does) on the path: pytest marks it for rewriting at start-up."""
    gpuiso.copy(STRICT)
    site = gpuiso.path / STRICT / "site"
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", f"{site}{os.pathsep}{path}" if path else str(site))


def _unloadable_under_warnings_as_errors() -> list[str]:
    """``-p no:`` for an installed plugin that cannot be loaded at all, in-process either,
    once warnings are errors from the interpreter's start: pytest-cov before 4 marks its
    hooks the old way (``@pytest.mark.tryfirst``), which pytest 8 deprecates as it
    registers the plugin (CI's lowest versions: pytest-cov 2.12.1)."""
    try:
        from pytest_cov import plugin
    except ImportError:
        return []
    old = hasattr(plugin.pytest_load_initial_conftests, "pytestmark")
    return ["-p", "no:pytest_cov"] if old else []


# pytest's configuration (rewrite marks, config-time warnings) and the installed plugins:
# CI's wheel stage runs them with pytest-gpuiso installed from the wheel
@pytest.mark.installation
@pytest.mark.parametrize(
    "warnings", ["ini", "-W error", "PYTHONWARNINGS=error", "--import-mode=importlib"]
)
def test_a_strict_project_ends_isolated_as_in_process(gpuiso, monkeypatch, warnings) -> None:
    """filterwarnings = error (ini), -W error, PYTHONWARNINGS=error (the interpreter's own,
    from its start: our bootstrap too) and importlib mode: the same outcomes as in-process,
    test by test; no process failed to start."""
    _strict(gpuiso, monkeypatch)
    args = ["--gpu-isolate", "--gpu-isolate-report=report.json", "-rA"]
    if warnings.startswith("-"):
        args += warnings.split()
    elif warnings.startswith("PYTHONWARNINGS"):
        monkeypatch.setenv("PYTHONWARNINGS", "error")
        args += _unloadable_under_warnings_as_errors()
    in_process = gpuiso.run_as_installed("--no-gpu-isolate", *args[2:], STRICT)
    in_process.assert_outcomes(**STRICT_OUTCOMES)
    result = gpuiso.run_as_installed(*args, STRICT)
    result.assert_outcomes(**STRICT_OUTCOMES)
    assert _summary(result) == _summary(in_process)
    records = gpuiso.records()
    assert len(records) == 6
    assert all("error" not in r["start"] and r["pid"] for r in records.values()), records
    result.stdout.fnmatch_lines(["gpu-isolate: 6 isolated, 0 timed out, 0 crashed"])


@pytest.mark.parametrize(
    "plugin",
    ["tmpdir", "legacypath", "logging", "warnings", "junitxml", "faulthandler", "monkeypatch"],
)
def test_a_builtin_plugin_turned_off_changes_nothing_isolated(gpuiso, plugin) -> None:
    """-p no:NAME of one of pytest's own plugins: the tests that need it end as they do
    in-process (an error: no such fixture), the others pass; no process fails to start."""
    gpuiso.copy("builtin_fixtures")
    args = ("-p", f"no:{plugin}", "-rA", "builtin_fixtures")
    in_process = gpuiso.run("--no-gpu-isolate", *args)
    result = gpuiso.run("--gpu-isolate", *args)
    assert result.parseoutcomes() == in_process.parseoutcomes()
    assert _summary(result) == _summary(in_process), result.stdout.str()
    assert "could not start" not in result.stdout.str()


def test_a_named_file_python_files_does_not_match_is_rewritten(gpuiso) -> None:
    """pytest rewrites the asserts of a file named on the command line; so does the test's
    process (its collection stands in for pytest's, which tells the rewrite hook)."""
    gpuiso.copy("sem_rewrite_named.py")
    result = gpuiso.run("--gpu-isolate", "-p", "no:randomly", "sem_rewrite_named.py")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["E       assert 1 == 2"])


def test_a_doctest_modules_plain_asserts_stay_plain_as_in_process(gpuiso) -> None:
    """--doctest-modules on a package: pytest starts from the package, so its modules keep
    their plain asserts (each doctest expects assert's own message); the test's process,
    which collects only its test's file, must not take that file for one pytest started
    from. A module named on the command line is rewritten, in-process and isolated."""
    gpuiso.copy("doctest_plain_asserts")
    # In-process (pytest's own behaviour): the package's doctests pass, the named file's fails.
    package = ("-p", "no:randomly", "doctest_plain_asserts/pkg")
    gpuiso.run("--gpu-isolate", *package).assert_outcomes(passed=2)
    named = ("-p", "no:randomly", "doctest_plain_asserts/pkg/checked.py")
    result = gpuiso.run("--gpu-isolate", *named)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*AssertionError: empty", "*assert ''"])


def test_a_plugins_error_at_the_sessions_end_is_not_a_tests(gpuiso) -> None:
    """A warning a plugin gives in pytest_unconfigure, an error by filterwarnings: after
    the tests in-process, and after each test in its process, where it is not the test's
    (pytest's own process meets it at its end, as in-process)."""
    gpuiso.copy("session_end_warns")
    args = ("-p", "no:randomly", "session_end_warns")
    in_process = gpuiso.run("--no-gpu-isolate", *args)
    result = gpuiso.run("--gpu-isolate", *args)
    in_process.assert_outcomes(passed=2)
    result.assert_outcomes(passed=2)
    assert "UserWarning: said at the session's end" in result.stdout.str() + result.stderr.str()


def test_subtests_end_isolated_as_in_process(gpuiso) -> None:
    """Each subtest's report (pytest 9 sends one more report per subtest) is taken and
    shown as in-process; the test with a failed subtest fails."""
    gpuiso.copy("sem_subtests.py")
    args = ("-rA", "-p", "no:randomly", "sem_subtests.py")
    in_process = gpuiso.run("--no-gpu-isolate", *args)
    result = gpuiso.run("--gpu-isolate", *args)
    assert result.parseoutcomes() == in_process.parseoutcomes()
    summary = {line for line in result.outlines if re.match(r"[A-Z]+(\[.*\])? \S+::", line)}
    assert summary == {
        line for line in in_process.outlines if re.match(r"[A-Z]+(\[.*\])? \S+::", line)
    }
    assert "cannot take" not in result.stdout.str()


def test_a_process_that_cannot_start_says_why_and_the_session_stops(gpuiso, monkeypatch) -> None:
    """No test's process can start: its own error is the test's (the traceback with -v),
    not retried; the second test's same error stops the session at once, in one line;
    the records say why, with the process's pid; the summary counts the tests that never
    started apart from the isolated ones."""
    gpuiso.copy(FAILS)
    monkeypatch.setenv("START_FAILS", "always")
    # its folder named: its conftest is an initial one, which the process loads as it starts
    result = gpuiso.run("--gpu-isolate", REPORT, "-p", "no:randomly", FAILS)
    result.assert_outcomes(errors=2)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(
        [
            "*ERROR at setup of test_1*",
            f"gpu-isolate: the test's process could not start: {CAUSE}",
            "(-v shows the traceback of the test's process)",
            "gpu-isolate: 0 isolated, 2 never started, 0 timed out, 0 crashed",
            f"*Interrupted: gpu-isolate: no test's process can start: {CAUSE}*",
        ]
    )
    text = result.stdout.str()
    assert "another process" not in text and "INTERNALERROR" not in text
    records = gpuiso.records()
    assert sorted(records) == [f"{FAILS}/test_start_fails.py::test_{n}" for n in (1, 2)]
    for record in records.values():
        assert record["outcome"] == "error"
        assert isinstance(record["pid"], int)
        start = record["start"]
        assert (start["error"], start["tried"]) == (CAUSE, True)
        assert "start_fails/conftest.py" in start["traceback"], start["traceback"]
    verbose = gpuiso.run(
        "--gpu-isolate", "-v", "-p", "no:randomly", f"{FAILS}/test_start_fails.py::test_1"
    )
    verbose.assert_outcomes(errors=1)
    verbose.stdout.fnmatch_lines(
        [f"gpu-isolate: the test's process could not start: {CAUSE}", "*Traceback*", CAUSE]
    )


def test_a_repeated_start_failure_fails_later_tests_at_once(gpuiso_spawn, tmp_path, monkeypatch):
    """A test's process ran its test, then two could not start with the same error: the
    session goes on, and the tests after fail at once with that error, no process started
    for them (each started afresh: no prewarming, which would configure them early)."""
    gpuiso_spawn.copy(FAILS)
    monkeypatch.setenv("START_FAILS", str(tmp_path / "flag"))
    result = gpuiso_spawn.run("--gpu-isolate", "--gpu-isolate-prewarm=0", REPORT, FAILS)
    result.assert_outcomes(passed=1, errors=4)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        ["gpu-isolate: 1 isolated, 4 never started, 0 timed out, 0 crashed"]
    )
    records = gpuiso_spawn.records()
    tried = {nodeid.rsplit("_", 1)[1]: r["start"].get("tried") for nodeid, r in records.items()}
    assert tried == {"1": None, "2": True, "3": True, "4": False, "5": False}
    assert {r["start"].get("error") for r in records.values()} == {None, CAUSE}
    report = json.loads((gpuiso_spawn.path / "report.json").read_text())
    assert [r["pid"] is None for r in report["tests"]] == [False, False, False, True, True]


def test_a_conftest_that_asks_for_xdist_workers_runs_its_tests_isolated(gpuiso) -> None:
    """The conftest sets -n in pytest_cmdline_main where the process is no xdist worker (a
    test's process is none): there it runs its one test, and starts no workers."""
    gpuiso.copy("conftest_sets_workers")
    result = gpuiso.run("--gpu-isolate", "-p", "no:randomly", "conftest_sets_workers")
    result.assert_outcomes(passed=1)
    assert "could not start" not in result.stdout.str()


@pytest.mark.installation
def test_our_modules_are_not_rewritten_where_pytest_marks_them(gpuiso, monkeypatch) -> None:
    """pytest marks an installed plugin's package for assertion rewriting; ours takes
    itself off that list, so that its modules load from their installed bytecode in
    pytest's process, the fork server and each test's process (not compiled again by the
    rewriter in each, where bytecode is not written). Installed as a wheel is, with a
    strict project's warnings on (no "already imported" warning either)."""
    _strict(gpuiso, monkeypatch)
    gpuiso.copy("sem_plain_imports.py")
    args = ("-W", "error", "sem_plain_imports.py")
    gpuiso.run_as_installed("--no-gpu-isolate", *args).assert_outcomes(passed=1)
    gpuiso.run_as_installed("--gpu-isolate", *args).assert_outcomes(passed=1)
