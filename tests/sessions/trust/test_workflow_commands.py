"""What a test leaves behind is text the test chose: a leaked process's command line, a
/dev/shm name. Printed as it is, a line break in it starts a line of the step's log, and
GitHub Actions runs a line starting with ``::`` (after blanks) as a workflow command, and
``##[...]`` anywhere in a line: ``::stop-commands::`` would silence the plugin's own
annotations. The terminal summary, the warnings summary, the test's error and its
``gpu-isolate leaks`` section show such text on one line, escaped, and the annotations
of the leaks are still there (docs/security.md).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import REPORT, kill_quietly, pid_alive

PROGRAM = "test_workflow_command_leaks.py"
TEST = f"{PROGRAM}::test_leaves_commands_behind"
# The plugin's own workflow commands (findings.github): a level, the test's file and line,
# a title of ours; the message is escaped by GitHub's rules.
OURS = re.compile(
    rf"::(error|warning|notice) file={re.escape(PROGRAM)},line=\d+,title=pytest-gpuiso%3A [^:,]+::"
)


def _runner_lines(output: bytes) -> list[str]:
    """The step's output as GitHub's runner reads it, a line at a time: split at ``\\n``,
    ``\\r\\n`` and ``\\r`` only (.NET's ``ReadLine``), not at what Python's ``splitlines``
    also takes for a line break."""
    return re.split(r"\r\n|\r|\n", output.decode("utf-8", "replace"))


def _commands(lines: list[str]) -> list[str]:
    """The lines GitHub's runner would take as workflow commands: ``::`` first after
    leading blanks, or ``##[`` anywhere."""
    return [line for line in lines if line.lstrip().startswith("::") or "##[" in line]


@pytest.mark.parametrize(
    ("policy", "failed", "warned"),
    [("shm=fail,process=warn", "shm", "process"), ("shm=warn,process=fail", "process", "shm")],
)
def test_leak_details_start_no_workflow_command(
    gpuiso_spawn, shm_name, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy, failed, warned
):
    gpuiso_spawn.copy(PROGRAM)
    pidfile = tmp_path / "pids"
    monkeypatch.setenv("GPUISO_PIDFILE", str(pidfile))
    args = ("-rA", f"--gpu-isolate-leaks={policy}", "--gpu-isolate-annotations=github", REPORT)
    session = gpuiso_spawn.popen(*args)
    try:
        output, _ = session.communicate(timeout=180)
    finally:
        session.kill()
        pids = [int(p) for p in pidfile.read_text().split()] if pidfile.exists() else []
        kill_quietly([p for p in pids if pid_alive(p)])
    lines = _runner_lines(output)
    text = "\n".join(lines)
    assert session.returncode == pytest.ExitCode.TESTS_FAILED, text
    assert "1 passed, 1 warning, 1 error in" in text
    [record] = gpuiso_spawn.report()["tests"]
    assert {leak["kind"] for leak in record["leaks"]} == {"shm", "process"}
    assert all("\n::stop-commands::pwned\n" in leak["detail"] for leak in record["leaks"])

    commands = _commands(lines)
    assert [line for line in commands if not OURS.match(line)] == [], text
    # The annotation of each leak is printed, at the test's line, errors first.
    assert [line.split(" ", 1)[0] for line in commands] == ["::error", "::warning"], text
    assert f"title=pytest-gpuiso%3A {failed} leak::{TEST} left" in commands[0]
    assert f"title=pytest-gpuiso%3A {warned} leak::{TEST} left" in commands[1]
    assert "x%0A::stop-commands::pwned%0A" in commands[1]  # the detail, GitHub-escaped
    # Every other line is one line by any reading (no Unicode line separator either).
    assert [line for line in lines if line not in commands and len(line.splitlines()) > 1] == []
    # Each detail is still shown, on one line, its line breaks as visible escapes: in the
    # test's error, its "gpu-isolate leaks" section, the warnings and the leak summary.
    shown = r"x\n::stop-commands::pwned\n::error title=FORGED::forged error"
    for start in (f"  {failed}: ", f"{warned}: ", f"    {warned}: "):
        assert any(line.startswith(start) and shown in line for line in lines), (start, text)
    assert any(f"GpuIsoLeakWarning: {warned}: " in line and shown in line for line in lines)
    assert r"\u2028::notice::after a line separator\x85::debug::" in text
    assert r"text #\x23[error]v1 command" in text


def test_a_forged_fixture_name_starts_no_workflow_command(gpuiso_spawn):
    """A FIXTURE frame's name is the test's process's text: the "set up in N isolated
    processes" line shows it escaped, on one line."""
    gpuiso_spawn.copy("test_forged_fixture_frames.py")
    session = gpuiso_spawn.popen("-rA")
    output, _ = session.communicate(timeout=180)
    lines = _runner_lines(output)
    text = "\n".join(lines)
    assert session.returncode == 0, text
    assert _commands(lines) == [], text
    assert "\x1b" not in text
    shown = (
        r"gpu-isolate: session-scoped fixture model\n::error title=FORGED::a forged error"
        r"\r#\x23[warning]v1 \x1b[2J set up in 2 isolated processes: "
    )
    assert any(line.startswith(shown) for line in lines), text
