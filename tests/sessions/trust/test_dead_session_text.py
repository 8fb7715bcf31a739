"""What a killed session's tests left behind is text those tests chose: a daemon's command
line, a /dev/shm entry's name. The next session says what it ended and what it found in
two warnings; each shows that text escaped, so that no line of the log starts a workflow
command (``##[`` anywhere in a line) or holds a terminal escape sequence."""

from __future__ import annotations

import signal
from pathlib import Path

from tests.helpers import GpuIso, kill_quietly

PROGRAM = "test_dead_session_forged_names.py"
DEVICES = "--gpu-isolate-devices=0"  # one stand-in GPU, in the test's own lease table


def test_a_dead_sessions_names_are_inert_in_the_next_sessions_warnings(
    gpuiso_spawn: GpuIso, lease_region, private_tmpdir, shm_name, tmp_path: Path
):
    gpuiso_spawn.copy(PROGRAM)
    pidfile = tmp_path / "daemon"
    killed = gpuiso_spawn.popen(
        DEVICES,
        f"{PROGRAM}::test_leaves_forged_names_and_kills_pytest",
        env={"GPUISO_PIDFILE": str(pidfile)},
    )
    daemons: list[int] = []
    try:
        killed.wait(timeout=120)
        daemons = [int(pid) for pid in pidfile.read_text().split()] if pidfile.exists() else []
        assert killed.returncode == -signal.SIGKILL and len(daemons) == 1
        session = gpuiso_spawn.popen(DEVICES, "-W", "always", f"{PROGRAM}::test_next")
        output = session.communicate(timeout=180)[0].decode("utf-8", "replace")
    finally:
        kill_quietly(daemons)
        killed.communicate(timeout=30)
    assert session.returncode == 0, output
    lines = output.splitlines()
    ended = [line for line in lines if "left running by a pytest session that died" in line]
    left = [line for line in lines if f"/dev/shm/{shm_name}" in line]
    assert len(ended) == 1 and len(left) == 1, output
    assert r"#\x23[error]forged \x1b[2J 120" in ended[0]
    assert rf"/dev/shm/{shm_name}#\x23[warning]forged \x1b[2J" in left[0]
    assert [line for line in lines if "##[" in line or "\x1b" in line] == []
