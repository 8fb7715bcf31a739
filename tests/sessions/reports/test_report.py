"""The JSON report (schema version 1) and the terminal summary, with and without xdist."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import signal
from collections import Counter

import pytest

import pytest_gpuiso
from pytest_gpuiso.reports.record import Exit, Record, Start
from pytest_gpuiso.reports.report import cost_line, wall_line
from tests.helpers import REPORT, command, kill_quietly, wait_for_file, wait_until

# pytest's report formats, hooks and internals: CI's lowest-versions stage runs them all
pytestmark = pytest.mark.versions

EXPECTED = {
    "test_crashes.py::test_segfault": ("failed", "SIGSEGV", -11),
    "test_crashes.py::test_abort": ("failed", "SIGABRT", -6),
    "test_crashes.py::test_self_sigkill": ("failed", "SIGKILL", -9),
    "test_crashes.py::test_os_exit_zero": ("failed", None, 0),
    "test_crashes.py::test_sys_exit_nonzero": ("failed", None, 0),
    "test_crashes.py::test_after_crashes": ("passed", None, 0),
    "test_outcomes.py::test_passes": ("passed", None, 0),
    "test_outcomes.py::test_skip_inside": ("skipped", None, 0),
    "test_outcomes.py::test_xfail_fails": ("xfailed", None, 0),
    "test_outcomes.py::test_xfail_passes": ("xpassed", None, 0),
    "test_outcomes.py::test_setup_error": ("error", None, 0),
}


def _check_schema(document: dict) -> dict[str, dict]:
    assert document["version"] == 1
    tests = document["tests"]
    for record in tests:
        assert set(record) >= {"nodeid", "outcome", "duration", "pid", "exit", "leaks"}
        assert set(record) <= set(Record.__annotations__), "a field the schema does not declare"
        assert set(record) >= Record.__required_keys__
        assert set(record["exit"]) == set(Exit.__annotations__)
        assert Start.__required_keys__ <= set(record["start"]) <= set(Start.__annotations__)
        assert isinstance(record["wall"], float) and record["wall"] >= record["startup"] >= 0
        assert isinstance(record["duration"], float) and record["duration"] > 0
        assert isinstance(record["pid"], int)
        assert record["leaks"] == []
    nodeids = [r["nodeid"] for r in tests]
    assert len(nodeids) == len(set(nodeids)), "a test was reported twice"
    return {r["nodeid"]: r for r in tests}


def _check_session(session: dict, args: list[str], ret: int, expected: dict) -> None:
    """The report says what run it is of (issue 50): when, how it ended, its tests'
    outcomes, pytest's arguments and what it ran with."""
    assert set(session) == {"started", "finished", "exitstatus", "outcomes", "args", "environment"}
    for when in ("started", "finished"):
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", session[when]), session
    assert session["started"] <= session["finished"]
    assert session["exitstatus"] == int(ret)
    assert session["outcomes"] == dict(Counter(outcome for outcome, _, _ in expected.values()))
    assert all(arg in session["args"] for arg in args)
    env = session["environment"]
    assert env["python"] == platform.python_version() and env["pytest"] == pytest.__version__
    assert env["pytest-gpuiso"] == pytest_gpuiso.__version__ and env["platform"]
    assert env.get("pytest-xdist") == importlib.metadata.version("pytest-xdist")
    assert "cuda_driver" not in env  # no NVML here: nothing said of GPUs


@pytest.mark.parametrize("xdist", [[], ["-n", "2"]], ids=["no-xdist", "xdist"])
def test_json_report_records_every_isolated_test(gpuiso_spawn, xdist):
    """Every isolated test appears once with its outcome and how its process ended."""
    gpuiso_spawn.copy("test_crashes.py", "test_outcomes.py")
    args = ["--gpu-isolate", "--gpu-isolate-report=report.json", *xdist]
    result = gpuiso_spawn.run(
        *args,
        "test_crashes.py",
        "test_outcomes.py::test_passes",
        "test_outcomes.py::test_skip_inside",
        "test_outcomes.py::test_xfail_fails",
        "test_outcomes.py::test_xfail_passes",
        "test_outcomes.py::test_setup_error",
    )
    records = _check_schema(gpuiso_spawn.report())
    assert set(records) == set(EXPECTED), result.stdout.str()
    for nodeid, (outcome, signal_name, code) in EXPECTED.items():
        record = records[nodeid]
        assert record["outcome"] == outcome, nodeid
        assert record["exit"]["signal"] == signal_name, nodeid
        assert record["exit"]["code"] == code, nodeid
        assert record["exit"]["timed_out"] is False
    result.stdout.fnmatch_lines(["gpu-isolate: JSON report written to *report.json"])
    _check_session(gpuiso_spawn.report()["session"], args, result.ret, EXPECTED)
    # what isolation cost, from the same records the report holds
    cost = cost_line(list(records.values()))
    assert cost.startswith("isolation cost ") and f" over {len(EXPECTED)} tests (~" in cost
    # and, where one process ran every test (no xdist), its wall clock against their time
    wall = ["gpu-isolate: wall clock * s after *"]
    result.stdout.fnmatch_lines([f"gpu-isolate: {cost}", *([] if xdist else wall)])
    assert ("gpu-isolate: wall clock" in result.stdout.str()) is not bool(xdist)


def test_the_cost_line_sums_what_each_process_took_beyond_its_test():
    """wall - duration of each test whose process ran; GPU waits apart; nothing without
    a process."""

    def record(wall, duration, startup=0.01, lease_wait=None):
        found = {"wall": wall, "duration": duration, "startup": startup}
        return found if lease_wait is None else {**found, "lease_wait": lease_wait}

    records = [
        record(0.5, 0.1, lease_wait=1.5),
        record(0.3, 0.2),
        record(0.0, 0.0, startup=None),  # no process ran (a bad marker, a lease timeout)
    ]
    assert cost_line(records) == (
        "isolation cost 0.5 s over 2 tests (~250 ms a test) beyond their own setup, call "
        "and teardown; 1.5 s waiting for GPUs"
    )
    many = [record(0.12, 0.1)] * 2000
    assert cost_line(many) == (
        "isolation cost 40.0 s over 2,000 tests (~20 ms a test) beyond their own setup, "
        "call and teardown"
    )
    assert cost_line([record(0.0, 0.0, startup=None)]) == ""


def test_the_wall_clock_line_says_what_in_process_would_save():
    """The session's wall clock after collection against the tests' own time: what users
    compare (a run in-process), beside the processes' cost."""
    assert wall_line(7.9, 3.5) == (
        "wall clock 7.9 s after collection for 3.5 s of the tests' own setup, call and "
        "teardown: 4.4 s more, about what running in-process saves"
    )
    assert wall_line(1.0, 1.2).endswith(": 0.0 s more, about what running in-process saves")


def test_report_path_from_ini_is_relative_to_invocation_dir(gpuiso_spawn):
    gpuiso_spawn.copy("test_where.py")
    gpuiso_spawn.pytester.makeini("[pytest]\ngpu_isolate_report = out/gpu.json\n")
    gpuiso_spawn.run().assert_outcomes(passed=2)
    records = _check_schema(gpuiso_spawn.report("out/gpu.json"))
    assert list(records) == ["test_where.py::test_marked_runs_isolated"]


def test_terminal_summary_lists_timeouts_and_crashes(gpuiso_spawn):
    gpuiso_spawn.copy("test_crashes.py", "test_hangs.py")
    result = gpuiso_spawn.run(
        "--gpu-isolate",
        "--gpu-isolate-timeout=1",
        "--gpu-isolate-grace=0",
        "test_crashes.py::test_segfault",
        "test_hangs.py::test_sleeps_forever",
    )
    result.stdout.fnmatch_lines(
        [
            "*- gpu-isolate -*",
            "gpu-isolate: 2 isolated, 1 timed out, 1 crashed",
            "  TIMEOUT test_hangs.py::test_sleeps_forever (after 1 s)",
            "  CRASHED test_crashes.py::test_segfault (SIGSEGV)",
        ]
    )


def test_summary_colours_follow_color_and_a_failing_leak_is_said_once(gpuiso_spawn, shm_name):
    """--color=yes: TIMEOUT and CRASHED in pytest's red, the leak line yellow; --color=no:
    no escape at all. Under --gpu-isolate-leaks=fail, the leak's detail is in its test's
    error only, not again in a section or in the leak summary."""
    name = shm_name
    gpuiso_spawn.copy("test_crashes.py", "test_hangs.py", "test_leak_shm.py")
    args = (
        "--gpu-isolate",
        "--gpu-isolate-timeout=1",
        "--gpu-isolate-grace=0",
        "--gpu-isolate-leaks=fail",
        "--gpu-isolate-cleanup",
        "test_crashes.py::test_segfault",
        "test_hangs.py::test_sleeps_forever",
        "test_leak_shm.py::test_leaks_raw_file",
    )
    result = gpuiso_spawn.run("--color=yes", *args)
    out = result.stdout.str()
    assert re.search(r"\x1b\[31m\x1b\[1mTIMEOUT\x1b\[0m test_hangs.py", out), out
    assert re.search(r"\x1b\[31m\x1b\[1mCRASHED\x1b\[0m test_crashes.py", out), out
    assert re.search(r"\x1b\[33mgpu-isolate: 1 leak in 1 test \(1 shm", out), out
    assert out.count(f"/dev/shm/{name}-raw") == 1, out
    assert "(the test's error above has the detail)" in out
    plain = gpuiso_spawn.run("--color=no", *args).stdout.str()
    assert "\x1b[" not in plain
    assert "  TIMEOUT test_hangs.py::test_sleeps_forever (after 1 s)" in plain


def _ended_record(timed_out: bool, signal: str | None, outcome: str, expired=None) -> dict:
    exit_ = {"code": None, "signal": signal, "timed_out": timed_out, "expired": expired}
    return {"nodeid": "t.py::t", "outcome": outcome, "exit": exit_, "timeout": 5.0}


@pytest.mark.parametrize(
    ("record", "kind", "compared", "finding", "text", "through"),
    [
        (_ended_record(False, None, "passed"), "normal", None, None, None, True),
        (_ended_record(False, None, "skipped"), "normal", None, None, None, False),
        (
            _ended_record(False, "SIGSEGV", "failed"),
            "crash",
            "crash",
            "crash",
            "crashed with SIGSEGV",
            False,
        ),
        (
            _ended_record(True, "SIGKILL", "failed", "test"),
            "timeout",
            "timeout",
            "timeout",
            "timed out after 5 s, ended by SIGKILL",
            False,
        ),
        (
            _ended_record(True, None, "failed", "startup"),
            "timeout",
            "timeout",
            "startup-timeout",
            "did not finish starting",
            False,
        ),
        (
            _ended_record(False, "SIGINT", "interrupted"),
            "interrupted",
            None,
            None,
            "interrupted",
            False,
        ),
    ],
    ids=["passed", "skipped", "crash", "timeout", "startup", "interrupted"],
)
def test_how_a_process_ended_is_read_once_for_every_report(
    record, kind, compared, finding, text, through
) -> None:
    """``ending`` decides how a test's process ended; the terminal text, ``compare``,
    the findings (annotations) and the leak baseline all say what it decided."""
    from pytest_gpuiso.reports import baseline, compare, findings, report
    from pytest_gpuiso.reports.record import ending

    assert ending(record).kind == kind
    assert compare._ended(record) == compared
    found = findings._ending(record)
    assert (found[0] if found else None) == finding
    assert report._ended(record) == text
    assert baseline._ran_through(record) is through


KILLED = "test_killed_session.py::test_killed_with_pytest"


def _running(gpuiso) -> list[str] | None:
    """The tests the (partial) report names as running; None while it is not there."""
    try:
        return gpuiso.report()["session"]["running"]
    except (OSError, ValueError, KeyError):
        return None


@pytest.mark.parametrize("kill", ["pytest", "group"])
def test_a_killed_session_leaves_its_partial_report(gpuiso, tmp_path, kill, lease_region):
    """pytest SIGKILLed (alone, or with its whole process group) during an isolated test
    on a (stand-in) GPU: the report holds the tests that finished, marked partial, naming
    the test that ran; merge and compare read it and say so; the next session says, from
    the lease table, that the session died during that test on that GPU."""
    gpuiso.copy("test_killed_session.py")
    running = tmp_path / "running"
    devices = "--gpu-isolate-devices=0"
    proc = gpuiso.popen(
        "--gpu-isolate",
        devices,
        REPORT,
        "test_killed_session.py",
        env={"GPUISO_RUNNING": str(running)},
    )
    child = None
    try:
        child = int(wait_for_file(running, timeout=120))
        # The partial report names a running test at its start, or (where writing it
        # took over 20 ms, as on a loaded machine) by a timer soon after: wait for it.
        wait_until(lambda: _running(gpuiso) == [KILLED], "the partial report", timeout=30)
        if kill == "group":
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
    finally:
        kill_quietly([proc.pid, *([child] if child else [])])
    document = gpuiso.report()
    session = document["session"]
    assert (session["partial"], session["exitstatus"]) == (True, None)
    assert session["running"] == [KILLED]
    assert sorted(r["nodeid"] for r in document["tests"]) == [
        f"test_killed_session.py::test_quick[{n}]" for n in range(3)
    ]
    merged = command("merge", str(gpuiso.path / "report.json"), "--json", str(tmp_path / "m"))
    assert merged.returncode == 0, merged.stderr
    assert "PARTIAL: its session never ended during test_killed_session.py::" in merged.stderr
    compared = command("compare", *[str(gpuiso.path / "report.json")] * 2)
    assert "(PARTIAL: its session never ended" in compared.stdout
    after = gpuiso.run("--gpu-isolate", devices, "test_killed_session.py::test_quick")
    after.assert_outcomes(passed=3, warnings=1)
    assert (
        f"the pytest session of pid {proc.pid} died during "
        "test_killed_session.py::test_killed_with_pytest (on GPU 0)"
    ) in after.stdout.str()
