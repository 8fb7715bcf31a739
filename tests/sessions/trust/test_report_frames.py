"""A test's process that sends pytest a report of the wrong shape (fields pytest's own
reporting relies on: terminal, junitxml, --durations, xdist), a report of another test,
or a number no JSON report can hold: that test's error in one line naming the field;
pytest never ends in INTERNALERROR, the other tests keep their outcomes, and the
session's report stays readable by merge."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import GpuIso

PROGRAM = "report_frames"
BAD = [
    ("longrepr_not_a_repr", "its longrepr is {'x': 1}"),
    ("duration_text", "its duration is 'x'"),
    ("location_not_a_triple", "its location is 5"),
    ("other_test_failed", "nodeid 'test_forged_reports.py::test_innocent', not this test's"),
    ("outcome_unknown", "its outcome is 'bogus'"),
    ("sections_not_pairs", "its sections is [1]"),
    ("user_properties_not_pairs", "its user_properties is [1]"),
    ("when_unknown", "its when is 'bogus'"),
]


@pytest.fixture
def forged(gpuiso_spawn: GpuIso) -> GpuIso:
    gpuiso_spawn.copy(f"{PROGRAM}/test_forged_reports.py")
    return gpuiso_spawn


def _no_internal_error(result: pytest.RunResult) -> None:
    text = result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in text and "Traceback (most recent" not in text, text


def test_a_bad_report_is_its_tests_error_only(forged: GpuIso, lease_region):
    result = forged.run(
        "-p",
        "no:randomly",
        "-rA",
        "--junitxml=junit.xml",
        "--durations=3",
        "-k",
        "bad_report or innocent or after",
    )
    _no_internal_error(result)
    # each sent its wrong report on top of its own: it passed, and errs in teardown
    result.assert_outcomes(passed=2 + len(BAD), errors=len(BAD))
    result.stdout.fnmatch_lines_random(
        [
            "PASSED test_forged_reports.py::test_innocent",
            "PASSED test_forged_reports.py::test_after",
        ]
    )
    text = result.stdout.str()
    for case, why in BAD:
        assert f"a report pytest cannot take ({why})" in text, (case, text)
    assert "FAILED test_forged_reports.py::test_innocent" not in text
    assert (forged.path / "junit.xml").exists()


def test_under_xdist_the_controller_and_workers_carry_on(forged: GpuIso, lease_region):
    result = forged.run(
        "-n",
        "2",
        "-rA",
        "-k",
        "user_properties_not_pairs or other_test_failed or innocent or after",
    )
    _no_internal_error(result)
    result.assert_outcomes(passed=4, errors=2)
    result.stdout.fnmatch_lines_random(["PASSED test_forged_reports.py::test_innocent"])


def test_a_number_beyond_64_bits_never_reaches_the_report(forged: GpuIso, lease_region):
    result = forged.run("--gpu-isolate-report=r.json", "-k", "torch_leak")
    _no_internal_error(result)
    result.assert_outcomes(failed=1)
    assert (
        "a 'torch_leak' frame of the wrong shape: {'device': 0, 'bytes': 1180"
        in result.stdout.str()
    )
    merged = subprocess.run(
        [sys.executable, "-m", "pytest_gpuiso", "merge", "r.json", "--json", "m.json"],
        cwd=forged.path,
        capture_output=True,
        text=True,
    )
    assert merged.returncode == 0, merged.stderr
    assert len(json.loads((forged.path / "m.json").read_text())["tests"]) == 1
