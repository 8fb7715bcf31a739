"""pytest-cov with isolated tests: their lines count in pytest's report, nothing stray on disk.

fixtures/programs/plugins/plugin_cov: calc.py has six functions, five called by isolated tests and
one by an in-process test (100% only when every process's lines count); extra.py has lines
that a ``no_cover`` test and a crashing test run (never counted) and lines that a test with
the ``cov`` fixture runs. Each run is checked under both start methods; the fork server
must pre-collect (it used to refuse pytest-cov).
"""

from __future__ import annotations

import os
import re
import time

import pytest

# Another plugin's API: the runs load it beside ours
pytestmark = [pytest.mark.plugins("pytest_cov"), pytest.mark.versions]

pytest.importorskip("pytest_cov")

PROGRAM = "plugin_cov"
CALC = "--cov=calc"
EXTRA = "--cov=extra"


@pytest.fixture(autouse=True)
def _no_outer_coverage(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runs here measure only themselves, even when this suite runs under coverage
    (pytest-cov's old COV_CORE_* variables, coverage's auto-start and data file ones)."""
    for name in list(os.environ):
        if name.startswith(("COV_CORE_", "COVERAGE_")):
            monkeypatch.delenv(name)


def _row(result: pytest.RunResult, module: str) -> list[str]:
    """The term-missing row of ``module``: name, statements, missed, cover, missing..."""
    for line in result.stdout.lines:
        if line.startswith(f"{PROGRAM}/{module}.py "):
            return line.split()
    raise AssertionError(f"no coverage row for {module}.py:\n{result.stdout.str()}")


def _data_files(gpuiso) -> list[str]:
    """Coverage's data files in the run's directory (.coverage, .coverage.<suffix>)."""
    names = (p.name for p in gpuiso.path.iterdir())
    return sorted(n for n in names if n == ".coverage" or n.startswith(".coverage."))


def _check_all_counted(gpuiso, result: pytest.RunResult, isolated: int = 5) -> None:
    result.assert_outcomes(passed=6)
    assert _row(result, "calc")[1:4] == ["18", "0", "100%"], result.stdout.str()
    assert _data_files(gpuiso) == [".coverage"]
    if gpuiso.start == "forkserver":  # pytest-cov no longer keeps the template away
        summary = f"gpu-isolate: started {isolated} forkserver; *; {isolated} pre-collected"
        result.stdout.fnmatch_lines([summary])


def test_isolated_lines_count(gpuiso) -> None:
    gpuiso.copy(PROGRAM)
    result = gpuiso.run("-v", CALC, "--cov-report=term-missing", f"{PROGRAM}/test_calc.py")
    _check_all_counted(gpuiso, result)


def test_isolated_lines_count_under_xdist(gpuiso) -> None:
    gpuiso.copy(PROGRAM)
    result = gpuiso.run("-n", "2", CALC, "--cov-report=term-missing", f"{PROGRAM}/test_calc.py")
    result.assert_outcomes(passed=6)
    assert _row(result, "calc")[1:4] == ["18", "0", "100%"], result.stdout.str()
    assert _data_files(gpuiso) == [".coverage"]


def test_every_test_isolated(gpuiso) -> None:
    """--gpu-isolate: the in-process test's lines are measured in its own process too."""
    gpuiso.copy(PROGRAM)
    result = gpuiso.run(
        "-v", "--gpu-isolate", CALC, "--cov-report=term-missing", f"{PROGRAM}/test_calc.py"
    )
    _check_all_counted(gpuiso, result, isolated=6)


def test_branches_without_precollection(gpuiso) -> None:
    """--cov-branch: the tests' processes measure arcs too (lines and arcs do not mix);
    forked from the fork server's parsed configuration rather than its template."""
    gpuiso.copy(PROGRAM)
    result = gpuiso.run(
        "--gpu-isolate-no-precollect",
        CALC,
        "--cov-branch",
        "--cov-report=term-missing",
        f"{PROGRAM}/test_calc.py",
    )
    result.assert_outcomes(passed=6)
    assert _row(result, "calc")[1:6] == ["18", "0", "0", "0", "100%"], result.stdout.str()
    assert _data_files(gpuiso) == [".coverage"]


def test_no_report_no_files(gpuiso) -> None:
    """--cov-report= writes no report; the data file is pytest-cov's .coverage only."""
    gpuiso.copy(PROGRAM)
    result = gpuiso.run(CALC, "--cov-report=", f"{PROGRAM}/test_calc.py")
    result.assert_outcomes(passed=6)
    assert _data_files(gpuiso) == [".coverage"]
    from coverage import Coverage

    cov = Coverage(data_file=str(gpuiso.path / ".coverage"))
    cov.load()
    _, statements, _, missing, _ = cov.analysis2(str(gpuiso.path / PROGRAM / "calc.py"))
    assert (len(statements), missing) == (18, [])


def test_no_cover_fixture_and_crash(gpuiso) -> None:
    """no_cover's lines and a crashed test's lines are missed; the cov fixture is the test's
    Coverage; the report is made all the same."""
    gpuiso.copy(PROGRAM)
    result = gpuiso.run(EXTRA, "--cov-report=term-missing", f"{PROGRAM}/test_extra.py")
    result.assert_outcomes(passed=3, failed=1)
    row = _row(result, "extra")
    assert row[1:4] == ["10", "4", "60%"], result.stdout.str()
    assert " ".join(row[4:]) == "13-14, 18-19"  # not_covered, before_crash
    result.stdout.fnmatch_lines(["*CRASHED*test_extra.py::test_crash*"])
    assert _data_files(gpuiso) == [".coverage"]


def test_test_contexts(gpuiso) -> None:
    """--cov-context=test: an isolated test's lines carry its node id, as in-process."""
    gpuiso.copy(PROGRAM)
    result = gpuiso.run(CALC, "--cov-context=test", "--cov-report=", f"{PROGRAM}/test_calc.py")
    result.assert_outcomes(passed=6)
    from coverage import CoverageData

    data = CoverageData(str(gpuiso.path / ".coverage"))
    data.read()
    contexts = data.measured_contexts()
    for n in (1, 2, 3, 4, 5):
        assert f"{PROGRAM}/test_calc.py::test_isolated[{n}]|run" in contexts, contexts
    assert f"{PROGRAM}/test_calc.py::test_in_process|run" in contexts


def test_coverage_subprocess_patch(gpuiso) -> None:
    """coverage's ``patch = subprocess`` starts coverage in every spawned interpreter (the
    tests' processes, the fork server, multiprocessing's resource tracker): none of them
    leaves a data file of its own."""
    coverage = pytest.importorskip("coverage")
    if coverage.version_info < (7, 10):
        pytest.skip(f"coverage {coverage.__version__} has no [run] patch = subprocess")
    gpuiso.copy(PROGRAM)
    (gpuiso.path / ".coveragerc").write_text("[run]\npatch = subprocess\n")
    result = gpuiso.run("-v", CALC, "--cov-report=term-missing", f"{PROGRAM}/test_calc.py")
    time.sleep(1)  # the resource tracker exits after pytest: a file of its own comes then
    _check_all_counted(gpuiso, result)


def test_other_pytest_cov_warns_once(gpuiso) -> None:
    """Without the private names the adapter needs: one warning, isolated lines missed, the
    in-process test's counted, nothing stray, no crash."""
    gpuiso.copy(PROGRAM, "plugin_cov_old/conftest.py")
    result = gpuiso.run(CALC, "--cov-report=term-missing", f"{PROGRAM}/test_calc.py")
    result.assert_outcomes(passed=6)
    out = result.stdout.str()
    warning = re.findall(r"GpuIsoStartWarning: pytest-cov \S+ with coverage \S+: (.*)", out)
    assert warning == [
        "pytest_cov.plugin._prepare_cov_source not found; the lines isolated tests run are not "
        "measured"
    ], out
    assert _row(result, "calc")[1:3] == ["18", "10"]  # f1-f5's bodies
    assert _data_files(gpuiso) == [".coverage"]


def test_data_that_cannot_be_added_warns_once(gpuiso) -> None:
    """A test's data that coverage refuses to add (branches into lines): one warning,
    the run and the other lines' report stand."""
    gpuiso.copy(PROGRAM, "plugin_cov_mismatch/conftest.py")
    result = gpuiso.run(
        "-W", "always", CALC, "--cov-report=term-missing", f"{PROGRAM}/test_calc.py"
    )
    result.assert_outcomes(passed=6)
    out = result.stdout.str()
    warnings = re.findall(r"GpuIsoStartWarning: pytest-cov: (.*) are not counted", out)
    assert warnings == ["the lines isolated tests ran"], out
    assert _row(result, "calc")[1:3] == ["18", "10"]  # f1-f5's bodies
    assert _data_files(gpuiso) == [".coverage"]
