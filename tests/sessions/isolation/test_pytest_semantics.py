"""pytest's own semantics for isolated tests: warning filters on our warnings, --setup-show,
--durations, --pdb/--trace, ini report paths, -qq, --help's ini types, overlapping shards.
Each test runs the programs in fixtures/programs/ (sem_*) through a real pytest session."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import pytest_gpuiso
from tests.helpers import program

# pytest's report formats, hooks and internals: CI's lowest-versions stage runs them all
pytestmark = pytest.mark.versions

LEAKS = "sem_leak_warnings.py"
FIXTURES = "sem_debugger_fixtures.py"
LEAK_ERROR = "-W error::pytest_gpuiso.GpuIsoLeakWarning"
KEEP = "-W default::pytest_gpuiso.GpuIsoLeakWarning"


def _warning_lines(result: pytest.RunResult, category: str) -> list[str]:
    return [line for line in result.outlines if f"{category}: " in line]


# --------------------------------------------------------------------------- warnings


def test_the_warning_classes_are_pytest_warnings_exported_by_the_package() -> None:
    assert issubclass(pytest_gpuiso.GpuIsoLeakWarning, pytest.PytestWarning)
    assert issubclass(pytest_gpuiso.GpuIsoStartWarning, pytest.PytestWarning)
    assert {"GpuIsoLeakWarning", "GpuIsoStartWarning"} <= set(pytest_gpuiso.__all__)


def test_leak_warnings_obey_the_tests_filterwarnings_mark(gpuiso_spawn, shm_name) -> None:
    gpuiso_spawn.copy(LEAKS)
    result = gpuiso_spawn.run("--gpu-isolate-cleanup", "-rA", LEAKS)
    result.assert_outcomes(passed=3)
    warned = _warning_lines(result, "GpuIsoLeakWarning")
    assert len(warned) == 1, result.stdout.str()
    assert f"{shm_name}-plain" in warned[0]
    result.stdout.fnmatch_lines(
        ["*sem_leak_warnings.py::test_leaks_file", "*GpuIsoLeakWarning: shm:*"]
    )


def test_a_leak_warning_turned_error_fails_the_leaking_test(
    gpuiso_spawn, shm_name, monkeypatch
) -> None:
    """Not a crash of pytest: the leaking test gets an error in teardown (as the ``fail``
    level gives it); the test whose mark ignores the warning, and the clean one, pass.
    The records say so (the first leak's level is ``fail``, the second is ``ignored``),
    and so do GitHub's annotations: an error for the first, nothing for the second."""
    gpuiso_spawn.copy(LEAKS)
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    result = gpuiso_spawn.run(
        "--gpu-isolate-cleanup", "--gpu-isolate-report=report.json", *LEAK_ERROR.split(), LEAKS
    )
    result.assert_outcomes(passed=3, errors=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_leaks_file*",
            "*the test left 1 leak behind*GpuIsoLeakWarning is an error by -W/filterwarnings:"
            " to keep leaks warnings, add default::pytest_gpuiso.GpuIsoLeakWarning to "
            "filterwarnings after error*",
            f"*shm: *{shm_name}-plain-*",
            "What to do:",
            '  shm: to fix: unlink the segment before the test ends*allow_leaks=?"shm"?*',
            "ERROR sem_leak_warnings.py::test_leaks_file*",  # pytest 8.0 adds no " - message"
        ]
    )
    assert _warning_lines(result, "GpuIsoLeakWarning") == []  # an error, not also a warning
    leaks = {r["nodeid"]: r["leaks"] for r in gpuiso_spawn.report()["tests"]}
    [failed] = leaks[f"{LEAKS}::test_leaks_file"]
    [ignored] = leaks[f"{LEAKS}::test_leaks_file_ignored_by_mark"]
    assert (failed["level"], failed.get("ignored")) == ("fail", None)
    assert (ignored["level"], ignored["ignored"]) == ("warn", True)
    annotations = [line for line in result.stdout.lines if line.startswith("::")]
    assert [line.split(",")[0] for line in annotations] == [f"::error file={LEAKS}"]
    # as the failure says: a later filter keeps the leak a warning, with what to do
    kept = gpuiso_spawn.run(
        "--gpu-isolate-cleanup", *LEAK_ERROR.split(), *KEEP.split(), "-p", "no:randomly", LEAKS
    )
    kept.assert_outcomes(passed=3, warnings=1)
    [warned] = _warning_lines(kept, "GpuIsoLeakWarning")
    assert f"{shm_name}-plain" in warned and "(to fix: unlink the segment" in warned


def test_ini_filterwarnings_ignore_drops_the_leak_warning(gpuiso_spawn, shm_name) -> None:
    gpuiso_spawn.copy(LEAKS)
    gpuiso_spawn.pytester.makeini(
        "[pytest]\nfilterwarnings =\n    ignore::pytest_gpuiso.GpuIsoLeakWarning\n"
    )
    result = gpuiso_spawn.run("--gpu-isolate-cleanup", LEAKS)
    result.assert_outcomes(passed=3)
    assert _warning_lines(result, "GpuIsoLeakWarning") == []
    assert "warnings summary" not in result.stdout.str()
    # The leak is still checked and recorded: only the warning is dropped.
    result.stdout.fnmatch_lines(["gpu-isolate: 2 leaks in 2 tests (2 shm, 0 process, *"])


@pytest.mark.parametrize("error", ["error::pytest_gpuiso.GpuIsoStartWarning", "error"])
def test_the_debuggers_notice_is_information_under_w_error(gpuiso_spawn, error) -> None:
    """``--pdb`` with isolation on by the ini file, under ``-W error``: the notice that the
    tests run in-process is shown, never a usage error; ``ignore`` drops it."""
    gpuiso_spawn.copy(FIXTURES)
    gpuiso_spawn.pytester.makeini("[pytest]\ngpu_isolate = true\n")
    result = gpuiso_spawn.run("--pdb", "-W", error, FIXTURES)
    result.assert_outcomes(passed=2, warnings=1)
    [notice] = _warning_lines(result, "GpuIsoStartWarning")
    assert "gpu-isolate: --pdb: every test runs in-process" in notice
    ignored = gpuiso_spawn.run("--pdb", "-W", "ignore::pytest_gpuiso.GpuIsoStartWarning", FIXTURES)
    ignored.assert_outcomes(passed=2)
    assert _warning_lines(ignored, "GpuIsoStartWarning") == []


# --------------------------------------------------------------------------- setup-show, durations


def test_setup_show_shows_the_isolated_tests_fixtures(gpuiso) -> None:
    gpuiso.copy(FIXTURES)
    result = gpuiso.run("--setup-show", "-q", f"{FIXTURES}::test_uses_resource")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "*SETUP    F resource",
            f"*{FIXTURES}::test_uses_resource (fixtures used: *resource*)*",
            "*TEARDOWN F resource*",
        ]
    )


def test_durations_list_isolated_tests_and_their_start_up(gpuiso_spawn) -> None:
    gpuiso_spawn.copy(FIXTURES)
    result = gpuiso_spawn.run("--durations=0", "--durations-min=0", FIXTURES)
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        [
            "*= slowest isolated start-ups =*",
            f"*s startup {FIXTURES}::test_* (wall *s)",
            f"*s startup {FIXTURES}::test_* (wall *s)",
            "*= slowest durations =*",
        ]
    )
    for phase in ("setup", "call", "teardown"):
        result.stdout.fnmatch_lines([f"*s {phase} *{FIXTURES}::test_uses_resource"])


# --------------------------------------------------------------------------- --pdb, --trace


@pytest.mark.parametrize("debugger", ["--pdb", "--trace"])
def test_a_debugger_runs_the_tests_in_process_and_says_so_under_q(
    gpuiso_spawn, tmp_path, monkeypatch, debugger
) -> None:
    gpuiso_spawn.copy(FIXTURES)
    where = tmp_path / "where"
    monkeypatch.setenv("GPUISO_WHERE", str(where))
    pytester = gpuiso_spawn.pytester
    result = pytester.run(
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:randomly",
        *gpuiso_spawn.start_options,
        "-q",
        debugger,
        f"{FIXTURES}::test_where",
        stdin=b"c\n" * 4,  # --trace stops at the test's start: continue
        timeout=120,
    )
    assert result.ret == 0, result.stdout.str()
    assert where.read_text() == "pytest"
    result.stdout.fnmatch_lines(
        [
            f"*GpuIsoStartWarning: gpu-isolate: {debugger}: every test runs in-process, "
            "so the debugger reaches it"
        ]
    )


# --------------------------------------------------------------------------- report paths, -qq


def test_ini_report_paths_are_relative_to_the_inifile_cli_paths_to_the_cwd(
    gpuiso_spawn, monkeypatch
) -> None:
    pytester = gpuiso_spawn.pytester
    sub = pytester.path / "sub"
    sub.mkdir()
    (sub / FIXTURES).write_text(program(FIXTURES).read_text())
    pytester.makeini("[pytest]\ngpu_isolate_report = out/gpu.json\n")
    monkeypatch.chdir(sub)
    result = gpuiso_spawn.run("--gpu-isolate-summary=summary.md", FIXTURES)
    result.assert_outcomes(passed=2)
    records = json.loads((pytester.path / "out" / "gpu.json").read_text())["tests"]
    assert len(records) == 2
    assert not (sub / "out").exists()
    assert (sub / "summary.md").exists()
    assert not (pytester.path / "summary.md").exists()


def test_qq_prints_the_summary_only_when_there_is_something_to_report(
    gpuiso_spawn, shm_name
) -> None:
    gpuiso_spawn.copy(FIXTURES, LEAKS)
    clean = gpuiso_spawn.run("-qq", FIXTURES)
    assert clean.ret == 0
    assert "gpu-isolate" not in clean.stdout.str()
    quiet = gpuiso_spawn.run("-q", FIXTURES)
    quiet.stdout.fnmatch_lines(["gpu-isolate: 2 isolated, 0 timed out, 0 crashed"])
    leaky = gpuiso_spawn.run("-qq", "--gpu-isolate-cleanup", LEAKS)
    leaky.stdout.fnmatch_lines(["*- gpu-isolate leak summary -*"])


# --------------------------------------------------------------------------- --help, merge


def test_help_shows_the_ini_keys_types(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("--help")
    for key in ("gpu_isolate", "gpu_isolate_torch_check", "gpu_isolate_cleanup"):
        result.stdout.fnmatch_lines([f"  {key} (bool):*"])
    result.stdout.fnmatch_lines(["  gpu_isolate_precollect (bool):*"])
    result.stdout.fnmatch_lines(["  gpu_isolate_timeout (string):*"])
    result.stdout.fnmatch_lines(["  gpu_isolate_shm_ignore (args):*"])


def test_merge_warns_about_a_test_in_two_shards(gpuiso_spawn) -> None:
    """Shards from sessions without xdist merge; a test in both is named on stderr, in one
    line, and kept once: from the later shard (its last attempt there, as in one session)."""
    gpuiso_spawn.copy(FIXTURES)
    one = gpuiso_spawn.run("--gpu-isolate-report=one.json", "-k", "resource", FIXTURES)
    one.assert_outcomes(passed=1)
    two = gpuiso_spawn.run("--gpu-isolate-report=two.json", FIXTURES)
    two.assert_outcomes(passed=2)
    merged = subprocess.run(
        [sys.executable, "-m", "pytest_gpuiso", "merge", "one.json", "two.json"]
        + ["--json", "all.json"],
        cwd=gpuiso_spawn.path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert merged.returncode == 0, merged.stderr
    assert merged.stderr.splitlines() == [
        "warning: 1 test is in more than one shard (shards that overlap), each counted once, "
        f"from the shard with its last attempt: {FIXTURES}::test_uses_resource (one.json, "
        "two.json)"
    ]
    records = json.loads((gpuiso_spawn.path / "all.json").read_text())["tests"]
    assert sorted((r["nodeid"], r["shard"]) for r in records) == [
        (f"{FIXTURES}::test_uses_resource", "two.json"),
        (f"{FIXTURES}::test_where", "two.json"),
    ]
    alone = subprocess.run(
        [sys.executable, "-m", "pytest_gpuiso", "merge", "two.json", "--json", "b.json"],
        cwd=gpuiso_spawn.path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert alone.returncode == 0 and alone.stderr == ""
