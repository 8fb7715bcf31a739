"""A process started ahead of its test's turn and killed before its go (by a test or a
tool that cleans up its user's processes) is the plugin's loss, not the test's: another
process runs the test. A test whose own process dies after its go crashes, once.

The sessions run fixtures/programs/start/prewarm_killed_*.py under both start methods:
the hostile test there kills (or stops) the process waiting for the next test.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import inspect
import os
import signal
import termios
import time
from pathlib import Path

import _pytest.terminal

from tests.helpers import GpuIso, kill_quietly, program, wait_for_file

SIBLINGS = "prewarm_killed_siblings.py"
NEXT = f"{SIBLINGS}::test_next_passes"
DEADLINE = 120.0  # seconds, for what a loaded machine may take


def test_a_waiting_process_killed_by_a_test_is_replaced(gpuiso: GpuIso, monkeypatch) -> None:
    """Killed and gone before the next test's turn: a fresh process runs it."""
    gpuiso.copy(SIBLINGS)
    monkeypatch.setenv("GPUISO_KILL_SIGNAL", "SIGKILL")
    result = gpuiso.run("-p", "no:randomly", "-rA", SIBLINGS)
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines([f"PASSED {NEXT}"])


def test_a_process_killed_after_its_check_and_before_reading_its_go_is_replaced(
    gpuiso: GpuIso, tmp_path: Path
) -> None:
    """The hostile test stops the next test's process; it is still alive when its turn
    comes, gets its go (which it never reads), and is killed then: that test passes in
    a fresh process instead of crashing."""
    gpuiso.copy(SIBLINGS)
    victims = tmp_path / "victims"
    env = {"GPUISO_KILL_SIGNAL": "SIGSTOP", "GPUISO_VICTIM_FILE": str(victims)}
    proc = gpuiso.popen("-p", "no:randomly", "-rA", SIBLINGS, env=env)
    pids: list[int] = []
    try:
        pids = [int(pid) for pid in wait_for_file(victims, DEADLINE).split()]
        for pid in pids:
            _kill_once_its_go_is_sent(pid)
        out, _ = proc.communicate(timeout=DEADLINE)
    finally:
        kill_quietly([proc.pid, *pids])
        if proc.returncode is None:
            proc.communicate(timeout=30)
    text = out.decode(errors="replace")
    assert f"PASSED {NEXT}" in text, text
    assert "Crashed" not in text and "Traceback" not in text, text


def test_a_test_whose_process_dies_after_its_go_crashes_once(
    gpuiso: GpuIso, tmp_path: Path, monkeypatch
) -> None:
    """Its process was started ahead of its turn and read its go: the crash is the
    test's, and its code ran once."""
    gpuiso.copy("prewarm_killed_self.py")
    runs = tmp_path / "runs"
    monkeypatch.setenv("GPUISO_RUNS_FILE", str(runs))
    result = gpuiso.run("-p", "no:randomly", "-rA", "prewarm_killed_self.py")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*Crashed: the isolated test process crashed with SIGKILL*"])
    assert runs.read_text() == "ran\n"


def test_a_test_whose_every_process_is_killed_errors_in_one_line(gpuiso: GpuIso) -> None:
    """Each process started for the test dies before its go: after two replacements, the
    test errors with one line naming the likely cause, and the session goes on."""
    gpuiso.copy(SIBLINGS)
    (gpuiso.path / "conftest.py").write_text(program("prewarm_killed_conftest.py").read_text())
    gpuiso.pytester.makepyfile(
        test_after="""
        import pytest

        @pytest.mark.gpu_isolated(gpus=0)
        def test_after():
            pass
        """
    )
    result = gpuiso.run("-p", "no:randomly", "-rA", SIBLINGS, "test_after.py")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        [
            "gpu-isolate: the test's process died before the test started (killed by "
            "SIGKILL), and so did the 2 started to replace it: another process kills this "
            "session's waiting processes (a test or a tool that kills its user's processes*",
            "PASSED test_after.py::test_after",
            f"ERROR {NEXT} - *" if _SUMMARY_SAYS_TEXT_REPORTS else f"ERROR {NEXT}",
        ]
    )
    assert "Crashed" not in result.stdout.str() and "Traceback" not in result.stdout.str()


# The short summary's line of an error whose report is text (a test whose process never
# started) says that text in the pytest of the development venv; pytest 8.0 (the lowest
# supported) names the test alone, as it does for any plugin's text report.
_SUMMARY_SAYS_TEXT_REPORTS = "isinstance(rep.longrepr, str)" in inspect.getsource(
    _pytest.terminal._get_line_with_reprcrash_message
)


def _kill_once_its_go_is_sent(pid: int) -> None:
    """SIGKILL the stopped process ``pid`` once a pipe it reads from holds bytes (its go:
    a stopped process reads nothing; what it read before it was stopped is gone from its
    pipes), or at the deadline."""
    with contextlib.ExitStack() as stack:
        ends = []
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                info = Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines()
                flags = int(next(line for line in info if line.startswith("flags:")).split()[1], 8)
                pipe = os.readlink(f"/proc/{pid}/fd/{fd}").startswith("pipe:")
                if pipe and flags & os.O_ACCMODE == os.O_RDONLY:
                    ends.append(os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_NONBLOCK))
                    stack.callback(os.close, ends[-1])
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline and not any(map(_unread, ends)):
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)


def _unread(fd: int) -> int:
    count = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, count)
    return count[0]
