"""How isolated tests die, and what the report says about it.

Every test here drives a real pytest session (``gpuiso`` fixture) over the
misbehaving programs in fixtures/programs/ and checks the terminal report, the
JSON record and the processes left (or not left) behind.
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import psutil
import pytest

from pytest_gpuiso.wire.environment import TEMPLATE_WAIT_ENV
from tests.helpers import REPORT, kill_quietly, pid_alive, program, wait_for_file, wait_gone

TIMEOUT = "--gpu-isolate-timeout=2"
GRACE = "--gpu-isolate-grace=1"

# --------------------------------------------------------------------------- helpers


def line_of(name: str, func: str, needle: str) -> int:
    """1-based line number of the first ``needle`` inside ``def func`` of a program."""
    lines = program(name).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"def {func}("))
    return next(i for i in range(start, len(lines)) if needle in lines[i]) + 1


_HEADER = re.compile(r"^_+ (.+?) _+$")


def section(result: pytest.RunResult, title: str) -> pytest.LineMatcher:
    """The lines of the failure or error section whose header is exactly ``title``."""
    lines = result.outlines
    for i, line in enumerate(lines):
        m = _HEADER.match(line)
        if m and m.group(1) == title:
            end = i + 1
            while end < len(lines) and not (
                _HEADER.match(lines[end]) or lines[end].startswith(("=====", "----- gpu-isolate"))
            ):
                end += 1
            return pytest.LineMatcher(lines[i + 1 : end])
    raise AssertionError(f"no section {title!r} in:\n{result.stdout.str()}")


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    members = []
    for pid in psutil.pids():
        try:
            if os.getpgid(pid) == pgid and pid_alive(pid):
                members.append(pid)
        except OSError:
            pass
    return members


# --------------------------------------------------------------------------- timeouts


def test_timeout_reports_source_phase_and_stack(gpuiso) -> None:
    """A timeout names its value and source, fails the running phase and shows the test's
    own frame in the stack dump, for Python sleep, C code and a hanging fixture."""
    gpuiso.copy("test_hangs.py", "fail_stuck_in_c_read.py")
    result = gpuiso.run(
        "--gpu-isolate",
        TIMEOUT,
        GRACE,
        REPORT,
        "test_hangs.py::test_sleeps_forever",
        "test_hangs.py::test_hangs_in_setup",
        "fail_stuck_in_c_read.py",
    )
    result.assert_outcomes(failed=2, errors=1)
    head = "Timeout: the isolated test timed out after 2 s (timeout from --gpu-isolate-timeout)"
    sleep_line = line_of("test_hangs.py", "test_sleeps_forever", "time.sleep")
    section(result, "test_sleeps_forever").fnmatch_lines(
        [
            f"{head} during call; it was ended by SIGTERM "
            "(escalation: stack dump, SIGTERM, 1 s grace, SIGKILL); to fix: its stack below "
            "shows where it waited; to allow more: timeout= in the test's gpu_isolated "
            "marker, or --gpu-isolate-timeout",
            "Stack of the test process (pid *) at the timeout:",
            "Current thread * (most recent call first):",
            f'  File "*test_hangs.py", line {sleep_line} in test_sleeps_forever',
            "  ... * frames of pytest and pytest-gpuiso internals",
        ]
    )
    # Blocked in libc, where Python never gets control back: the dump still has the frame.
    read_line = line_of("fail_stuck_in_c_read.py", "test_stuck_in_c_read", ".read(")
    section(result, "test_stuck_in_c_read").fnmatch_lines(
        [
            f"{head} during call; it was ended by SIGTERM *",
            "Stack of the test process (pid *) at the timeout:",
            f'  File "*fail_stuck_in_c_read.py", line {read_line} in test_stuck_in_c_read',
        ]
    )
    setup_line = line_of("test_hangs.py", "slow_setup", "time.sleep")
    section(result, "ERROR at setup of test_hangs_in_setup").fnmatch_lines(
        [
            f"{head} during setup; it was ended by SIGTERM *",
            "Stack of the test process (pid *) at the timeout:",
            f'  File "*test_hangs.py", line {setup_line} in slow_setup',
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "gpu-isolate: 3 isolated, 3 timed out, 0 crashed",
            "  TIMEOUT test_hangs.py::test_sleeps_forever (after 2 s)",
            "  TIMEOUT test_hangs.py::test_hangs_in_setup (after 2 s)",
            "  TIMEOUT fail_stuck_in_c_read.py::test_stuck_in_c_read (after 2 s)",
        ]
    )
    records = gpuiso.records()
    assert {nodeid: r["outcome"] for nodeid, r in records.items()} == {
        "test_hangs.py::test_sleeps_forever": "failed",
        "test_hangs.py::test_hangs_in_setup": "error",
        "fail_stuck_in_c_read.py::test_stuck_in_c_read": "failed",
    }
    for record in records.values():
        assert record["exit"] == {
            "code": -15,
            "signal": "SIGTERM",
            "timed_out": True,
            "expired": "test",
        }, record
        assert record["timeout"] == 2.0


def test_sigterm_ignoring_test_is_killed_after_grace(gpuiso, tmp_path: Path, monkeypatch) -> None:
    """A test that ignores SIGTERM is SIGKILLed once the grace is over: gone within
    timeout + grace (+ slack), its pid no longer exists, and the report says SIGKILL."""
    gpuiso.copy("test_hangs.py")
    pidfile = tmp_path / "pid"
    monkeypatch.setenv("GPUISO_PIDFILE", str(pidfile))
    pid = None
    try:
        result = gpuiso.run(
            "--gpu-isolate", TIMEOUT, GRACE, REPORT, "test_hangs.py::test_ignores_sigterm"
        )
        pid = int(pidfile.read_text())
        result.assert_outcomes(failed=1)
        section(result, "test_ignores_sigterm").fnmatch_lines(
            [
                "Timeout: the isolated test timed out after 2 s "
                "(timeout from --gpu-isolate-timeout) during call; it was ended by SIGKILL "
                "(escalation: stack dump, SIGTERM, 1 s grace, SIGKILL); to fix: *",
                "Stack of the test process (pid *) at the timeout:",
                "*in test_ignores_sigterm",
            ]
        )
        record = gpuiso.records()["test_hangs.py::test_ignores_sigterm"]
        assert record["pid"] == pid
        assert record["exit"] == {
            "code": -9,
            "signal": "SIGKILL",
            "timed_out": True,
            "expired": "test",
        }
        # SIGKILL comes no sooner than timeout + grace, nor later than that plus the stack
        # dump's own bound (2 s, proctree.dump_stack) and some slack for a loaded machine.
        assert 2 + 1 <= record["duration"] <= 2 + 1 + 2 + 1.5, record
        assert not pid_alive(pid)
        assert not psutil.pid_exists(pid)
    finally:
        if pid is not None:
            kill_quietly([pid])


def test_timed_out_test_never_passes(gpuiso) -> None:
    """A test that exceeded its timeout fails the phase it was in, whatever it managed to
    report after the deadline; test_stuck_in_c_code (libc sleep) shows its frame."""
    gpuiso.copy("test_hangs.py", "fail_timeout_then_pass.py")
    result = gpuiso.run(
        "--gpu-isolate",
        TIMEOUT,
        "--gpu-isolate-grace=3",
        REPORT,
        "test_hangs.py::test_stuck_in_c_code",
        "fail_timeout_then_pass.py",
    )
    records = gpuiso.records()
    assert all(r["exit"]["timed_out"] for r in records.values()), records
    # fail_timeout_then_pass.py ignores SIGTERM, so it always gets to report "passed" in
    # time; test_stuck_in_c_code reports "passed" for its call, and sometimes completes.
    assert {nodeid: r["outcome"] for nodeid, r in records.items()} == {
        "test_hangs.py::test_stuck_in_c_code": "failed",
        "fail_timeout_then_pass.py::test_blocked_in_c_ignoring_sigterm": "failed",
    }
    result.assert_outcomes(failed=2)
    sleep_line = line_of("test_hangs.py", "test_stuck_in_c_code", "libc.sleep")
    section(result, "test_stuck_in_c_code").fnmatch_lines(
        [
            "Timeout: the isolated test timed out after 2 s * during call*",
            "Stack of the test process (pid *) at the timeout:",
            f'  File "*test_hangs.py", line {sleep_line} in test_stuck_in_c_code',
        ]
    )


def test_start_up_bound_ended_before_bootstrap_by_the_escalation(gpuiso_spawn) -> None:
    """A start-up bound that runs out while the spawned child is still starting is ended
    by SIGTERM (or SIGKILL), not by the stack-dump request; the test did not run: an
    error in setup that says so. Spawn only: a forked process has finished its bootstrap
    at its fork."""
    gpuiso_spawn.copy("test_crashes.py")
    result = gpuiso_spawn.run(
        "--gpu-isolate",
        "--gpu-isolate-startup-timeout=0.001",
        GRACE,
        REPORT,
        "test_crashes.py::test_after_crashes",
    )
    result.assert_outcomes(errors=1)
    record = gpuiso_spawn.records()["test_crashes.py::test_after_crashes"]
    assert record["exit"]["timed_out"] and record["exit"]["expired"] == "startup", record
    assert record["startup"] is None
    assert "ended by signal" not in result.stdout.str()
    assert record["exit"]["signal"] in ("SIGTERM", "SIGKILL"), record["exit"]
    result.stdout.fnmatch_lines(
        ["*Start-up timeout: the test process did not finish starting (*) within 0.001 s*"]
    )


def test_module_import_is_not_test_time(gpuiso) -> None:
    """A 0.2 s test marked timeout=1 in a module whose import takes 1.5 s passes (the
    import is start-up, as under pytest-timeout); a 2 s test's duration is >= 2 s in the
    JSON record and in junit; the start-up is recorded apart."""
    gpuiso.copy("test_slow_import.py")
    result = gpuiso.run(REPORT, "--junitxml=junit.xml")
    result.assert_outcomes(passed=2)
    records = gpuiso.records()
    quick = records["test_slow_import.py::test_quick_after_slow_import"]
    two = records["test_slow_import.py::test_sleeps_two_seconds"]
    assert quick["duration"] < 1, quick
    if gpuiso.start == "spawn":  # the first test's process starts cold, importing at its turn
        assert quick["startup"] >= 1.5, quick
    assert 0 <= quick["startup"] <= quick["wall"] - quick["duration"] + 0.01, quick
    assert two["duration"] >= 2, two
    cases = {
        case.get("name"): float(case.get("time"))
        for case in ET.parse(gpuiso.path / "junit.xml").iter("testcase")
    }
    assert cases["test_sleeps_two_seconds"] >= 2, cases


def test_hang_at_import_is_bounded_by_the_start_up_bound(gpuiso, monkeypatch) -> None:
    """A module that hangs at import in the isolated process: stopped after the marker's
    startup_timeout=15, an error in setup naming what it was doing, with its stack."""
    if gpuiso.start == "forkserver":
        # the template is stuck in the same import: fork from the server after 1 s
        monkeypatch.setenv(TEMPLATE_WAIT_ENV, "1")
    gpuiso.copy("test_import_hangs.py")
    result = gpuiso.run(GRACE, REPORT)
    result.assert_outcomes(errors=1)
    record = gpuiso.records()["test_import_hangs.py::test_never_gets_to_run"]
    assert record["exit"]["expired"] == "startup" and record["startup_timeout"] == 15, record
    assert record["outcome"] == "error"
    source = (program("test_import_hangs.py")).read_text().splitlines()
    hang = next(n for n, line in enumerate(source, 1) if "time.sleep(0.1)" in line)
    section(result, "ERROR at setup of test_never_gets_to_run").fnmatch_lines(
        [
            "Start-up timeout: the test process did not finish starting "
            "(importing test_import_hangs.py) within 15 s*",
            "Stack of the test process (pid *) at the timeout:",
            f'  File "*test_import_hangs.py", line {hang} in <module>',
        ]
    )
    result.stdout.fnmatch_lines(
        ["  TIMEOUT test_import_hangs.py::test_never_gets_to_run (did not finish starting*"]
    )


def test_hang_in_the_test_is_a_failed_call_however_slow_the_start(gpuiso, monkeypatch) -> None:
    """Without bytecode caches (every import compiles), a timeout=1 hang is still a
    failed test, in call: the clock starts when the test begins; junit gives its time."""
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    gpuiso.copy("test_hangs_in_call.py")
    result = gpuiso.run(GRACE, REPORT, "--junitxml=junit.xml", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*Timeout: the isolated test timed out after 1 s *during call*"])
    record = gpuiso.records()["test_hangs_in_call.py::test_hangs"]
    assert record["exit"]["expired"] == "test", record
    assert record["duration"] >= 1, record
    [case] = ET.parse(gpuiso.path / "junit.xml").iter("testcase")
    assert float(case.get("time")) >= 1, case.attrib


# --------------------------------------------------------------------------- crashes


def test_crashes_are_failures_naming_the_signal(gpuiso) -> None:
    """Segfault, abort and SIGKILL fail naming signal and exit code with the child's output
    tail; os._exit(0) and sys.exit(7) fail too; the session goes on after them."""
    gpuiso.copy("test_crashes.py")
    result = gpuiso.run("--gpu-isolate", "--gpu-isolate-timeout=60", GRACE, REPORT)
    result.assert_outcomes(failed=5, passed=1)
    crashed = "Crashed: the isolated test process crashed with {} (exit code {}) during call"
    segv_line = line_of("test_crashes.py", "test_segfault", "string_at")
    section(result, "test_segfault").fnmatch_lines(
        [
            crashed.format("SIGSEGV", -11),
            "Last output of the test process (pid *):",
            "Fatal Python error: Segmentation fault",
            f'  File "*test_crashes.py", line {segv_line} in test_segfault',
        ]
    )
    section(result, "test_abort").fnmatch_lines(
        [
            crashed.format("SIGABRT", -6),
            "Last output of the test process (pid *):",
            "Fatal Python error: Aborted",
            "*in test_abort",
        ]
    )
    section(result, "test_self_sigkill").fnmatch_lines([crashed.format("SIGKILL", -9)])
    section(result, "test_os_exit_zero").fnmatch_lines(
        [
            "The isolated test process exited with code 0 during call "
            "before reporting a complete result"
        ]
    )
    section(result, "test_sys_exit_nonzero").fnmatch_lines(["E       SystemExit: 7"])
    result.stdout.fnmatch_lines(
        [
            "gpu-isolate: 6 isolated, 0 timed out, 3 crashed",
            "  CRASHED test_crashes.py::test_segfault (SIGSEGV)",
            "  CRASHED test_crashes.py::test_abort (SIGABRT)",
            "  CRASHED test_crashes.py::test_self_sigkill (SIGKILL)",
        ]
    )
    records = gpuiso.records()
    exits = {nodeid.split("::")[1]: r["exit"] for nodeid, r in records.items()}
    crashed_exit = {"timed_out": False, "expired": None}
    crashers = ("test_segfault", "test_abort", "test_self_sigkill", "test_os_exit_zero")
    assert {name: exits[name] for name in crashers} == {
        "test_segfault": {"code": -11, "signal": "SIGSEGV", **crashed_exit},
        "test_abort": {"code": -6, "signal": "SIGABRT", **crashed_exit},
        "test_self_sigkill": {"code": -9, "signal": "SIGKILL", **crashed_exit},
        "test_os_exit_zero": {"code": 0, "signal": None, **crashed_exit},
    }
    outcomes = {nodeid.split("::")[1]: r["outcome"] for nodeid, r in records.items()}
    assert outcomes == {
        "test_segfault": "failed",
        "test_abort": "failed",
        "test_self_sigkill": "failed",
        "test_os_exit_zero": "failed",
        "test_sys_exit_nonzero": "failed",
        "test_after_crashes": "passed",
    }


def test_crash_tail_holds_what_the_test_printed(gpuiso) -> None:
    """The output tail of a crashed test includes the test's own last prints."""
    gpuiso.copy("test_crashes.py")
    result = gpuiso.run("--gpu-isolate", "--gpu-isolate-timeout=60", "test_crashes.py::test_abort")
    result.assert_outcomes(failed=1)
    section(result, "test_abort").fnmatch_lines(
        [
            "Output the test wrote before it ended (captured stream 1):",
            "about to abort",
            "Last output of the test process (pid *):",
            "Fatal Python error: Aborted",
            '  File "*test_crashes.py", line * in test_abort',
            "  ... * frames of pytest and pytest-gpuiso internals",
        ]
    )


def test_crash_of_a_test_that_forked_names_the_signal(gpuiso, tmp_path: Path, monkeypatch) -> None:
    """A test that forked a still-running grandchild and then segfaults is reported as
    SIGSEGV, promptly."""
    gpuiso.copy("fail_fork_then_crash.py")
    pidfile = tmp_path / "pid"
    monkeypatch.setenv("GPUISO_PIDFILE", str(pidfile))
    try:
        result = gpuiso.run(
            "--gpu-isolate", "--gpu-isolate-timeout=60", GRACE, REPORT, "fail_fork_then_crash.py"
        )
        result.assert_outcomes(failed=1)
        record = gpuiso.records()["fail_fork_then_crash.py::test_forks_then_segfaults"]
        # The forked grandchild is swept either way.
        grandchild = int(pidfile.read_text())
        assert [e["pid"] for e in record["escaped"]] == [grandchild]
        assert not pid_alive(grandchild)
        assert record["exit"] == {
            "code": -11,
            "signal": "SIGSEGV",
            "timed_out": False,
            "expired": None,
        }, record
        section(result, "test_forks_then_segfaults").fnmatch_lines(
            ["Crashed: the isolated test process crashed with SIGSEGV (exit code -11) during call"]
        )
    finally:
        if pidfile.exists():
            kill_quietly([int(pidfile.read_text())])


# --------------------------------------------------------------------------- payloads


def test_big_payloads_arrive_whole_and_leave_no_spill_files(gpuiso, private_tmpdir: Path) -> None:
    """5 MB of captured stdout and a 10 MB exception message come back complete (no
    deadlock), an unpicklable exception keeps its text, and the spill files are deleted
    as they are read: none mid-session, and no private directory after the session."""
    gpuiso.copy("test_payloads.py", "fail_no_spill_left.py")
    result = gpuiso.run(
        "--gpu-isolate",
        "--gpu-isolate-timeout=60",
        GRACE,
        "--tb=line",
        "--junitxml=junit.xml",
        "-o",
        "junit_logging=system-out",
        "-k",
        "not non_daemon",
        "test_payloads.py",
        "fail_no_spill_left.py",
    )
    result.assert_outcomes(failed=3, passed=1)
    lines = result.outlines

    # 5 MB of stdout: every one of the 50 000 lines, in the test's captured stdout (the
    # JUnit XML; whether --tb=line also prints it in the terminal depends on pytest).
    cases = {tc.get("name"): tc for tc in ET.parse(gpuiso.path / "junit.xml").iter("testcase")}
    out = cases["test_five_megabytes_of_stdout"].find("system-out")
    assert out is not None and out.text is not None
    assert sum(1 for line in out.text.splitlines() if line == "x" * 99) == 50_000

    # 10 MB message, whole: in the terminal and in the JUnit XML.
    message = "M" * 10_000_000 + "END-OF-MESSAGE"
    shown = [
        line.split("ValueError: ", 1)[1]
        for line in lines
        if "ValueError: MMM" in line and not line.startswith("FAILED ")  # summary: cut
    ]
    # (pytest 8.0 prints it once, on the --tb=line line; later versions twice.)
    assert shown, "the 10 MB message is missing from the terminal"
    assert all(text == message for text in shown), [len(text) for text in shown]
    failure = cases["test_ten_megabyte_message"].find("failure")
    assert failure is not None and failure.text is not None
    assert failure.text.rstrip().endswith("ValueError: " + message)

    # The exception that cannot be pickled is reported with its text.
    result.stdout.fnmatch_lines(
        ["*test_payloads.py:*: test_payloads.Unpicklable: cannot be pickled"]
    )

    # fail_no_spill_left.py passed (no spill files mid-session); afterwards nothing is left.
    assert private_tmpdir.is_dir()
    assert list(private_tmpdir.rglob("*")) == []


def test_non_daemon_thread_does_not_hang_the_child(gpuiso) -> None:
    """A non-daemon thread left running does not keep the child alive: it passes well
    before its timeout and the process is gone."""
    gpuiso.copy("test_payloads.py")
    result = gpuiso.run(
        "--gpu-isolate",
        "--gpu-isolate-timeout=20",
        GRACE,
        REPORT,
        "test_payloads.py::test_leaves_non_daemon_thread",
    )
    result.assert_outcomes(passed=1)
    record = gpuiso.records()["test_payloads.py::test_leaves_non_daemon_thread"]
    assert record["exit"] == {"code": 0, "signal": None, "timed_out": False, "expired": None}
    assert record["duration"] < 20
    assert not pid_alive(record["pid"])


# --------------------------------------------------------------------------- signals to pytest


def test_child_dies_with_its_parent(gpuiso, tmp_path: Path) -> None:
    """SIGKILL of the pytest process takes the isolated child down within 1 s
    (PR_SET_PDEATHSIG)."""
    gpuiso.copy("test_pid_hang.py")
    pidfile = tmp_path / "pid"
    proc = gpuiso.popen("test_pid_hang.py", env={"GPUISO_PIDFILE": str(pidfile)})
    child = None
    try:
        child = int(wait_for_file(pidfile))
        assert pid_alive(child)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        started = time.monotonic()
        still = wait_gone([child], timeout=30)
        assert still == [], f"child {child} alive {time.monotonic() - started:.2f} s after"
    finally:
        kill_quietly([proc.pid] + ([child] if child else []))
        proc.communicate(timeout=30)


def test_ctrl_c_takes_the_child_group_down(gpuiso, tmp_path: Path, private_tmpdir: Path) -> None:
    """SIGINT to pytest interrupts the session (exit code 2, KeyboardInterrupt), kills the
    child and every process of its group, and removes the session's private directory."""
    gpuiso.copy("fail_group_hang.py")
    pidfile = tmp_path / "pid"
    proc = gpuiso.popen("fail_group_hang.py", env={"GPUISO_PIDFILE": str(pidfile)})
    pids: list[int] = []
    try:
        child, grandchild = (int(p) for p in wait_for_file(pidfile).split())
        pids = [child, grandchild]
        assert os.getpgid(child) == child
        assert sorted(group_members(child)) == sorted(pids)
        os.kill(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        text = out.decode(errors="replace")
        assert proc.returncode == 2, text
        assert "KeyboardInterrupt" in text
        # interrupted by Ctrl-C, not crashed (its record says "interrupted" too)
        assert "CRASHED" not in text and "0 crashed" in text, text
        assert not pid_alive(child)
        assert group_members(child) == []
        assert not pid_alive(grandchild)
        assert list(private_tmpdir.iterdir()) == []
    finally:
        kill_quietly([proc.pid, *pids])
        if proc.returncode is None:
            proc.communicate(timeout=30)


def test_ctrl_c_on_a_loaded_machine_ends_the_session_within_30_s(
    gpuiso, tmp_path: Path, private_tmpdir: Path
) -> None:
    """Every wait on the interrupt path has a bound: with two processes busy on every
    core beside it, SIGINT during an isolated test with a child of its own ends pytest
    within 30 s (the test's tree killed, the session's directory removed)."""
    gpuiso.copy("fail_group_hang.py")
    pidfile = tmp_path / "pid"
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(2 * len(os.sched_getaffinity(0)))
    ]
    proc = gpuiso.popen("fail_group_hang.py", env={"GPUISO_PIDFILE": str(pidfile)})
    pids: list[int] = []
    try:
        pids = [int(p) for p in wait_for_file(pidfile, timeout=120).split()]
        os.kill(proc.pid, signal.SIGINT)
        start = time.monotonic()
        out, _ = proc.communicate(timeout=30)
        took = time.monotonic() - start
        assert proc.returncode == 2, out.decode(errors="replace")
        assert took < 30 and [p for p in pids if pid_alive(p)] == [], took
        assert list(private_tmpdir.iterdir()) == []
    finally:
        kill_quietly([proc.pid, *pids, *(hog.pid for hog in hogs)])
        for hog in hogs:
            hog.wait(timeout=30)
        if proc.returncode is None:
            proc.communicate(timeout=30)


# --------------------------------------------------------------------------- leftovers


def test_escaped_processes_are_killed_and_listed(gpuiso, tmp_path: Path, monkeypatch) -> None:
    """A double-forked daemon and a setsid Popen are killed after their test and listed
    (pid + command line) in the JSON record; a clean subprocess lists nothing."""
    gpuiso.copy("test_escape.py")
    pidfile = tmp_path / "pids"
    monkeypatch.setenv("GPUISO_PIDFILE", str(pidfile))
    pids: list[int] = []
    try:
        result = gpuiso.run("--gpu-isolate", "--gpu-isolate-timeout=60", GRACE, REPORT)
        pids = [int(p) for p in pidfile.read_text().split()]
        result.assert_outcomes(passed=3)
        assert len(pids) == 2
        assert [p for p in pids if pid_alive(p)] == []
        records = gpuiso.records()
        daemon = records["test_escape.py::test_double_fork_daemon"]["escaped"]
        popen = records["test_escape.py::test_setsid_popen"]["escaped"]
        assert [e["pid"] for e in daemon] == [pids[0]]
        assert [e["pid"] for e in popen] == [pids[1]]
        assert "python" in daemon[0]["cmdline"]
        assert "time.sleep(1000)" in popen[0]["cmdline"]
        assert records["test_escape.py::test_clean_subprocess"]["escaped"] == []
        result.stdout.fnmatch_lines(["gpu-isolate: 3 isolated, *, 2 escaped processes killed"])
    finally:
        kill_quietly(pids)


def test_stale_private_directories_are_removed(gpuiso_spawn, private_tmpdir: Path) -> None:
    """A session removes the private directories whose lock nobody holds (their process
    is gone) and keeps those whose lock is held (a live process, in whatever pid
    namespace) and those without a lock file; its own is gone at the end."""
    gpuiso_spawn.copy("test_crashes.py")
    private_tmpdir.mkdir(mode=0o700)
    stale, live, unknown = (private_tmpdir / n for n in ("999999-dead", "1-live", "42-nolock"))
    for path in (stale, live, unknown):
        path.mkdir(mode=0o700)
        (path / "spill-x.pickle").write_bytes(b"x")
    (stale / "lock").write_text("")
    (live / "lock").write_text("")
    with open(live / "lock") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        result = gpuiso_spawn.run(
            "--gpu-isolate", "--gpu-isolate-timeout=60", "test_crashes.py::test_after_crashes"
        )
    result.assert_outcomes(passed=1)
    assert not stale.exists()
    assert (live / "spill-x.pickle").exists()
    assert sorted(private_tmpdir.iterdir()) == sorted([live, unknown])


# --------------------------------------------------------------------------- pytest-timeout


def test_pytest_timeout_values_drive_the_isolated_timeout(gpuiso) -> None:
    """pytest-timeout's marker and --timeout become the isolated timeout; a gpu_isolated
    timeout wins over them, and pytest-timeout fires neither in the child nor the parent."""
    pytest.importorskip("pytest_timeout")
    gpuiso.copy("test_timeouts_plugin.py")
    result = gpuiso.run("--gpu-isolate", GRACE, REPORT, "--timeout=3")
    # The 1 s timeout includes the child's start-up: on a slow machine it may fire before
    # the call phase, which makes it an error in setup rather than a failure.
    counts = result.parseoutcomes()
    assert (counts.get("passed"), counts.get("failed", 0) + counts.get("errors", 0)) == (1, 2)
    head = "Timeout: the isolated test timed out after {} s (timeout from pytest-timeout) during *"
    section(result, "test_pytest_timeout_marker_is_honoured").fnmatch_lines([head.format(1)])
    section(result, "test_uses_command_line_timeout").fnmatch_lines([head.format(3)])
    records = {nodeid.split("::")[1]: r for nodeid, r in gpuiso.records().items()}
    marked = records["test_pytest_timeout_marker_is_honoured"]
    assert (marked["timeout"], marked["exit"]["timed_out"]) == (1.0, True)
    assert marked["duration"] < 3  # not the --timeout=3 of the command line
    unmarked = records["test_uses_command_line_timeout"]
    assert (unmarked["timeout"], unmarked["exit"]["timed_out"]) == (3.0, True)
    assert unmarked["outcome"] == "failed"
    both = records["test_pytest_timeout_does_not_fire_in_child"]
    assert both["outcome"] == "passed"
    assert both["timeout"] == 10.0
    assert both["exit"]["timed_out"] is False
    assert both["duration"] >= 2


# ------------------------------------------------- faults of pytest's own side of one test


@pytest.mark.parametrize(
    ("fault", "failed", "error"),
    [
        ("mkdtemp", "test_one", "No space left on device"),
        ("snapshot", "test_two", "Too many open files"),
    ],
)
def test_a_fault_of_pytests_side_costs_one_test(
    gpuiso_spawn, monkeypatch, fault: str, failed: str, error: str
) -> None:
    """A test's temporary directory that cannot be made, a snapshot that fails after its
    prewarmed process was started: that test errors at setup, the others run, and no
    process is left waiting for a go (the in-process test looks)."""
    gpuiso_spawn.copy("parent_faults")
    monkeypatch.setenv("GPUISO_PARENT_FAULT", fault)
    result = gpuiso_spawn.run("parent_faults/test_parent_faults.py", "-p", "no:randomly")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines([f"*ERROR at setup of {failed}*", f"gpu-isolate: *{error}*"])
    assert "INTERNALERROR" not in result.stdout.str()


def test_ctrl_c_past_a_tests_timeout_reports_the_timeout(gpuiso_spawn) -> None:
    """Ctrl-C while a timed-out test's process ignores SIGTERM (its grace): the test is
    reported as timed out and the session goes on, as the test's own timeout decided."""
    gpuiso_spawn.copy("parent_faults")
    result = gpuiso_spawn.run("parent_faults/test_interrupted_in_grace.py", "-p", "no:randomly")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*Timeout: the isolated test timed out after 1 s*"])
