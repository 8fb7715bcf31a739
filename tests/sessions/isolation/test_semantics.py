"""An isolated test's outcome and report are the ones it gets in-process.

Every test here drives real pytest sessions over the programs in
fixtures/programs/ and compares an isolated run (``--gpu-isolate`` or the
marker) with the same program run in-process, and with explicit expectations.
A failed check on the isolated side raises ``IsolationDivergence``, so a
failure says whether the plugin diverged or an in-process expectation is wrong.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuiso.settings import MARKER_KWARGS
from tests.helpers import GpuIso
from tests.helpers.output import normalized

# pytest's report formats, hooks and internals: CI's lowest-versions stage runs them all
pytestmark = pytest.mark.versions

OUTCOMES_EXPECTED = {
    "failed": 3,
    "passed": 2,
    "skipped": 2,
    "xfailed": 2,
    "xpassed": 1,
    "errors": 2,
}

# The short summary (-rA) of test_outcomes.py, per test, in-process and isolated alike.
OUTCOMES_SUMMARY = [
    "PASSED test_outcomes.py::test_passes",
    "PASSED test_outcomes.py::test_teardown_error",
    "SKIPPED [[]1] test_outcomes.py:17: skipped from inside the test",
    "SKIPPED [[]1] test_outcomes.py:20: skipif condition is true",
    "XFAIL test_outcomes.py::test_xfail_fails - known bug",
    "XFAIL test_outcomes.py::test_xfail_strict_fails - strict and broken",
    "XPASS test_outcomes.py::test_xfail_passes - fixed already",
    "ERROR test_outcomes.py::test_setup_error - RuntimeError: fixture setup exploded",
    "ERROR test_outcomes.py::test_teardown_error - RuntimeError: fixture teardown *",
    "FAILED test_outcomes.py::test_assertion_detail - assert [[]1, 2, 3] == [[]1, 2, 4]",
    # pytest 8.0 gives no reason on this line; summary_lines() compares it with in-process.
    "FAILED test_outcomes.py::test_xfail_strict_passes*",
    "FAILED test_outcomes.py::test_sys_exit - SystemExit: 3",
]

# What each test of test_outcomes.py is, as the JSON report names it.
OUTCOMES_RECORDS = {
    "test_outcomes.py::test_passes": "passed",
    "test_outcomes.py::test_assertion_detail": "failed",
    "test_outcomes.py::test_skip_inside": "skipped",
    "test_outcomes.py::test_skipif": "skipped",
    "test_outcomes.py::test_xfail_fails": "xfailed",
    "test_outcomes.py::test_xfail_passes": "xpassed",
    "test_outcomes.py::test_xfail_strict_passes": "failed",
    "test_outcomes.py::test_xfail_strict_fails": "xfailed",
    "test_outcomes.py::test_setup_error": "error",
    "test_outcomes.py::test_teardown_error": "error",
    "test_outcomes.py::test_sys_exit": "failed",
}

ODD_IDS = ["a/b", "c::d", "e[f]", "with space", "ünïcødé", "日本"]


class IsolationDivergence(AssertionError):
    """The isolated run differs from the in-process run (a plugin bug)."""


@contextmanager
def isolated_side() -> Iterator[None]:
    """Turn a failed check of the isolated run (an assertion, or ``fnmatch_lines``'s
    ``pytest.fail``) into ``IsolationDivergence``."""
    try:
        yield
    except (AssertionError, pytest.fail.Exception) as exc:
        raise IsolationDivergence(str(exc)) from exc


def summary_lines(result: pytest.RunResult) -> list[str]:
    """The lines of the "short test summary info" section."""
    lines = result.outlines
    start = next(i for i, line in enumerate(lines) if "short test summary info" in line)
    words = ("PASSED ", "FAILED ", "ERROR ", "SKIPPED ", "XFAIL ", "XPASS ")
    return [line for line in lines[start + 1 :] if line.startswith(words)]


def junit_cases(path: Path) -> dict[str, dict[str, Any]]:
    """junitxml testcases by name: attributes (but time), child elements and properties."""
    root = ET.parse(path).getroot()
    cases: dict[str, dict[str, Any]] = {}
    for case in root.iter("testcase"):
        attrs = {k: v for k, v in case.attrib.items() if k != "time"}
        children = [
            (child.tag, child.get("type"), child.get("message"))
            for child in case
            if child.tag != "properties"
        ]
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        cases[case.get("name", "")] = {"attrs": attrs, "children": children, "props": props}
    return cases


def suite_counts(path: Path) -> dict[str, str]:
    suite = ET.parse(path).getroot().find("testsuite")
    assert suite is not None
    return {k: suite.get(k, "") for k in ("tests", "failures", "errors", "skipped")}


def suite_properties(path: Path) -> dict[str, str | None]:
    suite = ET.parse(path).getroot().find("testsuite")
    assert suite is not None
    props = suite.find("properties")
    if props is None:
        return {}
    return {p.get("name", ""): p.get("value") for p in props.iter("property")}


def ascii_id(value: str) -> str:
    """A parameter id as pytest writes it in node ids (non-ASCII escaped)."""
    return value.encode("unicode_escape").decode("ascii")


# --------------------------------------------------------------------------- 1. outcomes


def test_outcomes_parity_with_in_process(gpuiso: GpuIso) -> None:
    """Every ordinary outcome (pass, fail, skip, skipif, xfail, xpass, strict xpass,
    setup/teardown error, sys.exit) is reported identically isolated and in-process:
    counts, -rA lines, failure texts with rewritten asserts, junitxml, JSON record."""
    gpuiso.copy("test_outcomes.py")
    common = ("-rA", "test_outcomes.py")
    inproc = gpuiso.run("--junitxml=in.xml", *common)
    iso = gpuiso.run(
        "--gpu-isolate", "--junitxml=iso.xml", "--gpu-isolate-report=report.json", *common
    )

    assert inproc.parseoutcomes() == iso.parseoutcomes() == OUTCOMES_EXPECTED
    iso.assert_outcomes(**OUTCOMES_EXPECTED)
    assert inproc.ret == iso.ret == pytest.ExitCode.TESTS_FAILED
    iso.stdout.fnmatch_lines(["gpu-isolate: 11 isolated, 0 timed out, 0 crashed"])
    assert "isolated, " not in inproc.stdout.str()

    # Per test: the same short summary lines, in the same order.
    assert summary_lines(iso) == summary_lines(inproc)
    iso.stdout.fnmatch_lines(OUTCOMES_SUMMARY, consecutive=True)
    # The failure texts are pytest's own: assertion rewriting ran in the child.
    iso.stdout.fnmatch_lines(
        [
            "*_ test_assertion_detail _*",
            ">       assert [[]1, 2, 3] == [[]1, 2, 4]",
            "E         At index 2 diff: 3 != 4",
        ]
    )
    iso.stdout.fnmatch_lines(
        ["*_ test_xfail_strict_passes _*", "[[]XPASS(strict)] strict and fixed"]
    )
    iso.stdout.fnmatch_lines(["*_ ERROR at teardown of test_teardown_error _*"])
    iso.stdout.fnmatch_lines(["E       SystemExit: 3"])
    # Everything else in the output is the same too.
    assert normalized(iso) == normalized(inproc)

    # The parent wrote the junitxml, with the same testcases and elements.
    xml_in, xml_iso = gpuiso.path / "in.xml", gpuiso.path / "iso.xml"
    assert junit_cases(xml_iso) == junit_cases(xml_in)
    assert suite_counts(xml_iso) == suite_counts(xml_in)
    # "tests" is 12 on pytest 8.0 (it counted the teardown error twice), 11 since; the
    # in-process count above is the reference either way.
    counts = suite_counts(xml_iso)
    assert counts["tests"] in ("11", "12")
    assert counts | {"tests": "11"} == {
        "tests": "11",
        "failures": "3",
        "errors": "2",
        "skipped": "4",
    }
    cases = junit_cases(xml_iso)
    kinds = {name: [tag for tag, _, _ in case["children"]] for name, case in cases.items()}
    assert kinds == {
        "test_passes": [],
        "test_assertion_detail": ["failure"],
        "test_skip_inside": ["skipped"],
        "test_skipif": ["skipped"],
        "test_xfail_fails": ["skipped"],
        "test_xfail_passes": [],
        "test_xfail_strict_passes": ["failure"],
        "test_xfail_strict_fails": ["skipped"],
        "test_setup_error": ["error"],
        "test_teardown_error": ["error"],
        "test_sys_exit": ["failure"],
    }
    assert cases["test_assertion_detail"]["children"] == [
        (
            "failure",
            None,
            "assert [1, 2, 3] == [1, 2, 4]\n  \n"
            "  At index 2 diff: 3 != 4\n  Use -v to get more diff",
        )
    ]
    assert cases["test_xfail_fails"]["children"] == [("skipped", "pytest.xfail", "known bug")]
    assert cases["test_teardown_error"]["children"] == [
        ("error", None, 'failed on teardown with "RuntimeError: fixture teardown exploded"')
    ]

    records = gpuiso.records()
    assert {nodeid: r["outcome"] for nodeid, r in records.items()} == OUTCOMES_RECORDS


# --------------------------------------------------------------------------- 2. semantics/


def test_semantics_parity_with_in_process(gpuiso: GpuIso, monkeypatch: pytest.MonkeyPatch) -> None:
    """capsys, capfd, caplog, tmp_path, monkeypatch, captured output and log of a failure,
    warnings summary, record_property in the parent's junitxml, odd parameter ids in -v
    output and conftest fixtures behave as in-process; session and module fixtures are
    re-created in every isolated test; tmp_path lies in ``isolated-*`` under the parent's
    basetemp. (junit_family=xunit1: the xunit2 warning is a known divergence, see below.)"""
    gpuiso.copy("semantics", "sem_paths.py")
    common = ("-v", "-rA", "-o", "junit_family=xunit1", "semantics", "sem_paths.py")
    counts_in, counts_iso = gpuiso.path / "counts-in.txt", gpuiso.path / "counts-iso.txt"

    monkeypatch.setenv("GPUISO_INPROCESS", "1")  # test_tmp_path's escape hatch in-process
    monkeypatch.setenv("GPUISO_COUNTS", str(counts_in))
    inproc = gpuiso.run("--junitxml=in.xml", *common)
    monkeypatch.delenv("GPUISO_INPROCESS")
    monkeypatch.setenv("GPUISO_COUNTS", str(counts_iso))
    iso = gpuiso.run("--gpu-isolate", "--junitxml=iso.xml", *common)

    expected = {"failed": 1, "passed": 20, "warnings": 2}
    assert inproc.parseoutcomes() == iso.parseoutcomes() == expected
    iso.stdout.fnmatch_lines(["gpu-isolate: 21 isolated, 0 timed out, 0 crashed"])
    assert summary_lines(iso) == summary_lines(inproc)
    assert normalized(iso) == normalized(inproc)

    # The failing test shows its captured stdout and log, in pytest's sections.
    iso.stdout.fnmatch_lines(
        [
            "*_ test_captured_output_shown_on_failure _*",
            "*Captured stdout call*",
            "MARKER-STDOUT-ON-FAILURE",
            "*Captured log call*",
            "WARNING  gpuiso.demo:test_semantics.py:34 MARKER-LOG-ON-FAILURE",
        ]
    )
    # caplog's records of a passing test show up under -rA as in-process.
    iso.stdout.fnmatch_lines(["*_ test_caplog _*", "*Captured log call*", "INFO *logged 7"])
    # Warnings raised in the child reach the parent's summary.
    iso.stdout.fnmatch_lines(
        [
            "*= warnings summary =*",
            "semantics/test_semantics.py::test_warning_reaches_summary",
            "*test_semantics.py:53: UserWarning: MARKER-WARNING from an isolated test",
            "semantics/test_semantics.py::test_deprecation_warning",
            "*test_semantics.py:57: DeprecationWarning: MARKER-DEPRECATION",
        ]
    )
    # Odd parameter ids: collected, isolated, passed, and shown with their ids.
    for value in ODD_IDS:
        nodeid = f"semantics/test_semantics.py::test_odd_ids[{ascii_id(value)}]"
        iso.stdout.re_match_lines([re.escape(nodeid) + r" PASSED +\[ *\d+%\]$"])
        iso.stdout.re_match_lines([r"^PASSED " + re.escape(nodeid) + "$"])
    iso.stdout.re_match_lines([r".*::TestInClass::test_method_param\[2\] PASSED"])

    # Session and module fixtures: once in-process, once per isolated test using them.
    lines_in = counts_in.read_text().splitlines()
    lines_iso = counts_iso.read_text().splitlines()
    assert sorted(line.split()[0] for line in lines_in) == ["module", "session"]
    assert len({line.split()[1] for line in lines_in}) == 1
    assert sorted(line.split()[0] for line in lines_iso) == ["module"] * 2 + ["session"] * 2
    pids = [line.split()[1] for line in lines_iso]
    assert pids[0] == pids[1] and pids[2] == pids[3] and pids[0] != pids[2]

    # junitxml: same testcases; record_property reached the parent's file.
    cases_in, cases_iso = junit_cases(gpuiso.path / "in.xml"), junit_cases(gpuiso.path / "iso.xml")
    tmp_in = Path(cases_in["test_tmp_path_location"]["props"].pop("tmp_path"))
    tmp_iso = Path(cases_iso["test_tmp_path_location"]["props"].pop("tmp_path"))
    assert cases_iso == cases_in
    assert len(cases_iso) == 21
    assert cases_iso["test_record_property"]["props"] == {"gpu_model": "none"}
    assert cases_iso["test_captured_output_shown_on_failure"]["children"] == [
        ("failure", None, "assert False")
    ]

    # tmp_path: <parent basetemp>/isolated-XXXX/<test>0, not the in-process basetemp.
    basetemp_in = tmp_in.parent
    assert basetemp_in.parent == gpuiso.path and basetemp_in.name.startswith("runpytest-")
    assert tmp_iso.name == "test_tmp_path_location0"
    assert tmp_iso.parent.name.startswith("isolated-")
    basetemp_iso = tmp_iso.parent.parent
    assert basetemp_iso.parent == gpuiso.path and basetemp_iso.name.startswith("runpytest-")
    assert basetemp_iso != basetemp_in
    assert (tmp_iso / "probe.txt").read_text() == "written"


# --------------------------------------------------------------------------- 3. session options


def test_keyword_selection_and_last_failed(gpuiso: GpuIso) -> None:
    """-k selects exactly the matching tests for isolation, and --lf then reruns exactly
    the isolated tests that failed (the parent keeps the last-failed cache)."""
    gpuiso.copy("test_outcomes.py")
    first = gpuiso.run_with_cache(
        "--gpu-isolate",
        "-v",
        "-k",
        "test_passes or test_assertion_detail or test_sys_exit",
        "test_outcomes.py",
    )
    first.assert_outcomes(passed=1, failed=2, deselected=8)
    first.stdout.fnmatch_lines(["gpu-isolate: 3 isolated, 0 timed out, 0 crashed"])
    first.stdout.fnmatch_lines(
        [
            "test_outcomes.py::test_passes PASSED*",
            "test_outcomes.py::test_assertion_detail FAILED*",
            "test_outcomes.py::test_sys_exit FAILED*",
        ],
        consecutive=True,
    )

    again = gpuiso.run_with_cache("--gpu-isolate", "-v", "--lf", "test_outcomes.py")
    again.assert_outcomes(failed=2, deselected=9)
    again.stdout.fnmatch_lines(["run-last-failure: rerun previous 2 failures"])
    again.stdout.fnmatch_lines(["gpu-isolate: 2 isolated, 0 timed out, 0 crashed"])
    again.stdout.fnmatch_lines(
        [
            "test_outcomes.py::test_assertion_detail FAILED*",
            "test_outcomes.py::test_sys_exit FAILED*",
        ],
        consecutive=True,
    )
    assert "test_passes" not in again.stdout.str()


def test_exitfirst_stops_after_isolated_failure(gpuiso_spawn: GpuIso) -> None:
    """-x stops the session after the first isolated failure: 2 of 11 tests ran."""
    gpuiso_spawn.copy("test_outcomes.py")
    result = gpuiso_spawn.run("--gpu-isolate", "-rA", "-x", "test_outcomes.py")
    assert result.parseoutcomes() == {"failed": 1, "passed": 1}
    result.stdout.fnmatch_lines(["*stopping after 1 failures*"])
    result.stdout.fnmatch_lines(["gpu-isolate: 2 isolated, 0 timed out, 0 crashed"])
    assert summary_lines(result) == [
        "PASSED test_outcomes.py::test_passes",
        "FAILED test_outcomes.py::test_assertion_detail - assert [1, 2, 3] == [1, 2, 4]",
    ]


def test_maxfail_counts_isolated_failures_and_errors(gpuiso_spawn: GpuIso) -> None:
    """--maxfail=2 stops after the second isolated failure (a setup error counts):
    3 of the 5 selected tests ran, as in-process."""
    gpuiso_spawn.copy("test_outcomes.py")
    args = ("--maxfail=2", "-rA", "-k", "not xfail and not skip", "test_outcomes.py")
    inproc = gpuiso_spawn.run(*args)
    iso = gpuiso_spawn.run("--gpu-isolate", *args)
    expected = {"failed": 1, "passed": 1, "errors": 1, "deselected": 6}
    assert iso.parseoutcomes() == inproc.parseoutcomes() == expected
    iso.stdout.fnmatch_lines(["*stopping after 2 failures*"])
    iso.stdout.fnmatch_lines(["gpu-isolate: 3 isolated, 0 timed out, 0 crashed"])
    assert summary_lines(iso) == summary_lines(inproc)
    assert "test_teardown_error" not in iso.stdout.str()
    assert "test_sys_exit" not in iso.stdout.str()


# --------------------------------------------------------------------------- 4. hypothesis


def test_hypothesis_in_isolated_tests(gpuiso: GpuIso) -> None:
    """A hypothesis test runs all its examples in the child and shrinks its
    counterexample there: 1 passed, 1 failed with ``n=500`` in the report, as in-process."""
    gpuiso.copy("test_hypothesis_prog.py")
    inproc = gpuiso.run("-rA", "test_hypothesis_prog.py")
    result = gpuiso.run("--gpu-isolate", "-rA", "test_hypothesis_prog.py")
    result.assert_outcomes(passed=1, failed=1)
    assert result.parseoutcomes() == inproc.parseoutcomes()
    assert normalized(result) == normalized(inproc)
    result.stdout.fnmatch_lines(["gpu-isolate: 2 isolated, 0 timed out, 0 crashed"])
    # Hypothesis's own report of the shrunk example ("Falsifying example" with its
    # pytest plugin, "Failing test case" without), written by the child.
    result.stdout.fnmatch_lines(
        [
            "*_ test_finds_counterexample _*",
            "E       assert 500 < 500",
            "E       *: test_finds_counterexample(",
            "E           n=500,",
            "E       )",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "PASSED test_hypothesis_prog.py::test_addition_commutes",
            "FAILED test_hypothesis_prog.py::test_finds_counterexample - assert 500 < 500",
        ]
    )


# --------------------------------------------------------------------------- 5. + 6. mixed, markers


def test_marker_only_isolates_marked_tests_and_strict_markers(gpuiso: GpuIso) -> None:
    """Without --gpu-isolate only the 2 marked tests are isolated; they interleave with
    in-process tests of the same module that share a module fixture; --strict-markers
    accepts the marker (it is registered)."""
    gpuiso.copy("test_mixed.py")
    result = gpuiso.run(
        "--strict-markers", "-v", "--gpu-isolate-report=report.json", "test_mixed.py"
    )
    assert result.parseoutcomes() == {"passed": 5}
    result.stdout.fnmatch_lines(
        [
            "test_mixed.py::test_in_process_first PASSED*",
            "test_mixed.py::test_isolated_middle PASSED*",
            "test_mixed.py::test_in_process_after_isolated PASSED*",
            "test_mixed.py::TestClass::test_isolated_in_class PASSED*",
            "test_mixed.py::test_in_process_last PASSED*",
        ],
        consecutive=True,
    )
    result.stdout.fnmatch_lines(["gpu-isolate: 2 isolated, 0 timed out, 0 crashed"])
    assert sorted(gpuiso.records()) == [
        "test_mixed.py::TestClass::test_isolated_in_class",
        "test_mixed.py::test_isolated_middle",
    ]


def test_teardown_errors_in_either_process_are_reported_as_in_process(gpuiso: GpuIso) -> None:
    """A teardown error after a pass or an xfail, in the test's own process or in pytest's
    (a class fixture an in-process test set up, torn down after the isolated test): the
    same outcomes and summary lines as in-process (an xfail test's teardown error is an
    expected failure there too), and JSON records by the one rule every record follows."""
    gpuiso.copy("test_teardown_errors.py")
    inproc = gpuiso.run("-rA", "--no-gpu-isolate", "test_teardown_errors.py")
    iso = gpuiso.run("-rA", "--gpu-isolate-report=report.json", "test_teardown_errors.py")
    expected = {"passed": 3, "xfailed": 4, "errors": 1}
    assert inproc.parseoutcomes() == iso.parseoutcomes() == expected
    assert summary_lines(iso) == summary_lines(inproc)
    module = "test_teardown_errors.py"
    # The error is the isolated test's, as in-process (the lines' wording varies by pytest).
    errors = [line for line in summary_lines(iso) if line.startswith("ERROR ")]
    assert errors == [f"ERROR {module}::TestPassThenClassTeardown::test_passes_last_in_class"]
    assert {nodeid: r["outcome"] for nodeid, r in gpuiso.records().items()} == {
        f"{module}::test_xfail_own_teardown": "xfailed",
        f"{module}::TestPassThenClassTeardown::test_passes_last_in_class": "error",
        f"{module}::TestXfailThenClassTeardown::test_xfail_last_in_class": "xfailed",
    }


def test_no_gpu_isolate_runs_marked_tests_in_process(gpuiso_spawn: GpuIso) -> None:
    """--no-gpu-isolate runs the marked tests in-process: exactly the 2 tests of
    test_mixed.py that assert they are isolated fail, and nothing is isolated."""
    gpuiso_spawn.copy("test_mixed.py")
    result = gpuiso_spawn.run("--no-gpu-isolate", "--strict-markers", "-rA", "test_mixed.py")
    assert result.parseoutcomes() == {"failed": 2, "passed": 3}
    result.stdout.fnmatch_lines(["gpu-isolate: off (--no-gpu-isolate): every test runs in-process"])
    failed = sorted(line for line in summary_lines(result) if line.startswith("FAILED"))
    assert failed == [
        "FAILED test_mixed.py::TestClass::test_isolated_in_class - assert False",
        "FAILED test_mixed.py::test_isolated_middle - assert False",
    ]
    assert "isolated, " not in result.stdout.str()


def test_markers_lists_gpu_isolated(gpuiso_spawn: GpuIso) -> None:
    """``pytest --markers`` lists the registered gpu_isolated marker with every argument
    the marker accepts (the description once lacked gpu_memory)."""
    result = gpuiso_spawn.run("--markers")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(
        [
            "@pytest.mark.gpu_isolated(timeout=None, startup_timeout=None, grace=None, gpus=None, "
            "gpu_memory=None, allow_leaks=(), ranks=1, rank_wait=None): run this test in a "
            "fresh process with a clean "
            "CUDA context*"
        ]
    )
    [line] = [x for x in result.stdout.lines if x.startswith("@pytest.mark.gpu_isolated(")]
    shown = re.findall(r"(\w+)=", line.split("): ", 1)[0])
    assert tuple(shown) == MARKER_KWARGS


# --------------------------------------------------------------------------- known divergences


def test_pytest_exit_in_isolated_test_ends_session(gpuiso: GpuIso) -> None:
    """pytest.exit() ends the session with its return code and message, and the next
    test never runs; isolated, the child's Exit is turned into a failure instead."""
    gpuiso.copy("sem_exit.py")
    inproc = gpuiso.run("sem_exit.py")
    assert inproc.ret == 5
    inproc.stdout.fnmatch_lines(
        ["*no tests ran*", "*_pytest.outcomes.Exit: MARKER-EXIT stop the session*"]
    )
    iso = gpuiso.run("--gpu-isolate", "sem_exit.py")
    with isolated_side():
        assert iso.ret == 5, iso.stdout.str()
        iso.stdout.fnmatch_lines(["*_pytest.outcomes.Exit: MARKER-EXIT stop the session*"])
        assert "test_never_reached" not in iso.stdout.str()


def test_junitxml_writer_fixtures_reach_parent_xml(gpuiso: GpuIso) -> None:
    """record_xml_attribute sets a testcase attribute and record_testsuite_property a
    testsuite property in the junitxml; isolated, both are silently lost."""
    gpuiso.copy("sem_junit.py")
    common = ("-o", "junit_family=xunit1", "sem_junit.py")
    inproc = gpuiso.run("--junitxml=in.xml", *common)
    inproc.assert_outcomes(passed=3, warnings=1)  # record_xml_attribute is experimental
    xml_in = gpuiso.path / "in.xml"
    assert junit_cases(xml_in)["test_xml_attribute"]["attrs"]["gpu_kind"] == "h100"
    assert suite_properties(xml_in) == {"suite_gpu": "h100"}
    iso = gpuiso.run("--gpu-isolate", "--junitxml=iso.xml", *common)
    iso.assert_outcomes(passed=3, warnings=1)
    xml_iso = gpuiso.path / "iso.xml"
    assert junit_cases(xml_iso)["test_record_property"]["props"] == {"gpu_model": "none"}
    with isolated_side():
        assert junit_cases(xml_iso)["test_xml_attribute"]["attrs"].get("gpu_kind") == "h100"
        assert suite_properties(xml_iso) == {"suite_gpu": "h100"}


def test_junit_family_warning_of_isolated_test(gpuiso: GpuIso) -> None:
    """With the default junit_family (xunit2), record_property warns that it is
    incompatible; isolated, the warning is missing and the warning count differs."""
    gpuiso.copy("sem_junit.py")
    common = ("-k", "test_record_property", "sem_junit.py")
    inproc = gpuiso.run("--junitxml=in.xml", *common)
    inproc.assert_outcomes(passed=1, deselected=2, warnings=1)
    inproc.stdout.fnmatch_lines(
        ["*PytestWarning: record_property is incompatible with junit_family*"]
    )
    iso = gpuiso.run("--gpu-isolate", "--junitxml=iso.xml", *common)
    iso.stdout.fnmatch_lines(["gpu-isolate: 1 isolated, 0 timed out, 0 crashed"])
    with isolated_side():
        assert iso.parseoutcomes() == inproc.parseoutcomes()
        assert normalized(iso) == normalized(inproc)


def test_capsys_disabled_output_reaches_terminal(gpuiso: GpuIso) -> None:
    """Output under capsys.disabled() is written to the terminal in-process;
    isolated, it is swallowed."""
    gpuiso.copy("sem_capsys_disabled.py")
    inproc = gpuiso.run("sem_capsys_disabled.py")
    inproc.assert_outcomes(passed=1)
    assert "MARKER-CAPSYS-DISABLED" in inproc.stdout.str()
    iso = gpuiso.run("--gpu-isolate", "sem_capsys_disabled.py")
    iso.assert_outcomes(passed=1)
    with isolated_side():
        assert "MARKER-CAPSYS-DISABLED" in iso.stdout.str()


def test_nested_warning_category_keeps_its_name(gpuiso_spawn: GpuIso) -> None:
    """The warnings summary names the warning's category; isolated, a category that
    is a nested class (dotted __qualname__) is not found and becomes UserWarning."""
    gpuiso_spawn.copy("sem_warning_class.py")
    inproc = gpuiso_spawn.run("sem_warning_class.py")
    inproc.assert_outcomes(passed=1, warnings=1)
    inproc.stdout.fnmatch_lines(["*sem_warning_class.py:12: NestedWarning: MARKER-NESTED"])
    iso = gpuiso_spawn.run("--gpu-isolate", "sem_warning_class.py")
    iso.assert_outcomes(passed=1, warnings=1)
    with isolated_side():
        iso.stdout.fnmatch_lines(["*sem_warning_class.py:12: NestedWarning: MARKER-NESTED"])


@pytest.mark.parametrize(
    "extra",
    [(), ("--gpu-isolate-prewarm=0",), ("--gpu-isolate-no-precollect",)],
    ids=["default", "cold", "no-precollect"],
)
def test_garbage_collection_in_the_test_process(gpuiso: GpuIso, extra: tuple[str, ...]) -> None:
    """What exists before the test runs is frozen out of the collector (pytest's
    end-of-session gc.collect() then skips it: ~130 ms a test with torch), on every start
    path (a cold process imports the module after its go); the test's objects are
    collected."""
    gpuiso.copy("test_gc_state.py")
    result = gpuiso.run("--gpu-isolate", *extra)
    result.assert_outcomes(passed=3)


def test_exit_handlers_of_the_test_run_at_its_process_exit(
    gpuiso: GpuIso, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a test's own code registered for exit runs when its process exits, as
    in-process at pytest's exit: an atexit handler, and an open TemporaryDirectory's
    cleanup (weakref.finalize); what the conftest registered at import runs once, in
    pytest's process, never in the tests' processes."""
    gpuiso.copy("exit_handlers")
    log = gpuiso.path / "exit.log"
    monkeypatch.setenv("GPUISO_EXIT_LOG", str(log))
    for isolated in (False, True):
        log.unlink(missing_ok=True)
        args = ["--gpu-isolate", "--gpu-isolate-report=report.json"] if isolated else []
        gpuiso.run(*args, "-W", "ignore::ResourceWarning", "exit_handlers").assert_outcomes(
            passed=3
        )
        lines = [line.split() for line in log.read_text().splitlines()]
        kinds = sorted(line[0] for line in lines)
        assert kinds == ["atexit", "conftest", "nothing", "tempdir"], (isolated, lines)
        [directory] = [line[2] for line in lines if line[0] == "tempdir"]
        assert not Path(directory).exists(), (isolated, lines)  # cleaned up at exit
        if isolated:
            pids = {r["nodeid"].split("::")[1]: str(r["pid"]) for r in gpuiso.report()["tests"]}
            by_kind = {line[0]: line[1] for line in lines}
            assert by_kind["atexit"] == pids["test_registers_an_atexit_handler"], lines
            assert by_kind["tempdir"] == pids["test_leaves_a_temporary_directory_open"]
            assert by_kind["conftest"] not in pids.values(), lines  # pytest's own


def _warned_tests(result: pytest.RunResult) -> dict[str, int]:
    """Each warning of the warnings summary (its message) -> how many tests it lists."""
    found: dict[str, int] = {}
    tests = 0
    for line in result.stdout.lines:
        if "test_warn_once.py::" in line and not line.startswith(" "):
            tests += 1
        elif ": " in line and line.startswith("  /") and tests:
            found[line.split(": ", 1)[1]] = tests
            tests = 0
    return found


@pytest.mark.parametrize("mode", ["", "each"])
def test_a_warning_each_fresh_process_repeats_is_shown_once(gpuiso: GpuIso, mode: str) -> None:
    """A library's warn-once warning (torch's) is given again by every test's fresh
    process: it is shown once, under the first test, as in-process, and the repeats are
    counted; a warning the library gives at every call is shown once too (in-process:
    each test), and a test's own distinct warnings each. ``each`` shows every repeat."""
    gpuiso.copy("warn_once")
    inproc = gpuiso.run("-p", "no:randomly", "warn_once")
    inproc.assert_outcomes(passed=3, warnings=7)
    args = ["--gpu-isolate", "--gpu-isolate-report=report.json", "-p", "no:randomly"]
    if mode:
        args.append(f"--gpu-isolate-warnings={mode}")
    isolated = gpuiso.run(*args, "warn_once")
    listed = _warned_tests(isolated)
    folded = [r.get("warnings_folded", 0) for r in gpuiso.records().values()]
    each = {f"UserWarning: the test's own warning {n}": 1 for n in (1, 2, 3)}
    if mode == "each":
        isolated.assert_outcomes(passed=3, warnings=9)
        assert listed == {
            "UserWarning: oncelib: said once per process": 3,
            "DeprecationWarning: oncelib: said at every call": 3,
            **each,
        }
        assert folded == [0, 0, 0]
        assert "repeated by later tests' processes" not in isolated.stdout.str()
        return
    assert _warned_tests(inproc)["UserWarning: oncelib: said once per process"] == 1
    isolated.assert_outcomes(passed=3, warnings=5)
    assert listed == {
        "UserWarning: oncelib: said once per process": 1,
        "DeprecationWarning: oncelib: said at every call": 1,
        **each,
    }
    assert sorted(folded) == [0, 2, 2]
    isolated.stdout.fnmatch_lines(
        ["gpu-isolate: 4 warnings repeated by later tests' processes shown once (*=each*)"]
    )


@pytest.mark.parametrize("capture", ["fd", "sys", "tee-sys", "no"])
def test_streams_a_module_took_at_collection_are_the_tests(gpuiso: GpuIso, capture: str) -> None:
    """A logger made at collection around ``sys.stdout`` writes to the stream its tests
    see (pytest's global capture is one for the session); a failing test shows only its
    own output, never what the template's collection printed."""
    gpuiso.copy("sem_stream_at_collection.py")
    args = ("-rA", f"--capture={capture}", "sem_stream_at_collection.py")
    inproc = gpuiso.run(*args)
    inproc.assert_outcomes(passed=1, failed=1)
    iso = gpuiso.run("--gpu-isolate", *args)
    with isolated_side():
        iso.assert_outcomes(passed=1, failed=1)
        out = iso.stdout.str()
        if gpuiso.start == "forkserver" or capture in ("fd", "sys"):  # a spawned process
            # imports the module again, and under -s or tee-sys says so (docs/semantics.md)
            assert out.count("MARKER-AT-COLLECTION") == inproc.stdout.str().count(
                "MARKER-AT-COLLECTION"
            )
        for marker in ("MARKER-HELD-STREAM", "MARKER-OWN-OUT", "MARKER-OWN-ERR"):
            assert marker in out
        if capture != "no":  # pytest's own sections, each with the test's own output only
            iso.stdout.fnmatch_lines(
                ["*- Captured stdout call -*", "MARKER-OWN-OUT", "*- Captured stderr call -*"]
            )
