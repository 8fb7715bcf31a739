"""What the tests of a pytest session that died (SIGKILL: the OOM killer, CI's time-out)
left in /dev/shm is judged by the next session that cleans its work directory, by the
shim's logs there: deleted with --gpu-isolate-cleanup, else named, said once either way
(``leaks.shm.DeadSessionShm``); and only what those logs say its tests created."""

from __future__ import annotations

import contextlib
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_gpuiso.leaks.shm_log import shim_path as _shim_path
from tests.helpers import SHM, GpuIso, kill_quietly

DEVICES = "--gpu-isolate-devices=0"  # one stand-in GPU, in the test's own lease table
PROGRAM = "dead_session_shm.py"

pytestmark = pytest.mark.skipif(_shim_path() is None, reason="the /dev/shm shim is not built")


@contextlib.contextmanager
def _killed_session(gpuiso: GpuIso, shm_name: str) -> Iterator[tuple[int, Path]]:
    """Run the program's first test, which creates a 1 MiB segment and SIGKILLs its pytest;
    yields the dead pytest's pid and the segment."""
    gpuiso.copy(PROGRAM)
    proc = gpuiso.popen(DEVICES, f"{PROGRAM}::test_leaves_a_segment_and_kills_pytest")
    try:
        proc.wait(timeout=120)
    finally:
        kill_quietly([proc.pid])
        out = proc.communicate(timeout=30)[0].decode(errors="replace")
    segment = SHM / f"{shm_name}-dead"
    assert proc.returncode == -signal.SIGKILL and segment.exists(), out
    yield proc.pid, segment


def _lines(result: pytest.RunResult) -> list[str]:
    return [line for line in result.outlines if "created by the tests of a pytest" in line]


def test_with_cleanup_the_next_session_deletes_it_and_says_so_once(
    gpuiso, lease_region, private_tmpdir, shm_name
):
    """The segment a test made before its pytest was SIGKILLed outlives it (the work
    directory and the shim's log too); the next session with --gpu-isolate-cleanup
    deletes it and says so in one line; the session after that has nothing to say."""
    with _killed_session(gpuiso, shm_name) as (dead, segment):
        assert [p.name.split("-")[0] for p in private_tmpdir.iterdir()] == [str(dead)]
        result = gpuiso.run(DEVICES, "--gpu-isolate-cleanup", f"{PROGRAM}::test_next")
        # and, from the lease table, the test it died in (a second warning)
        result.assert_outcomes(passed=1, warnings=2)
        assert f"the pytest session of pid {dead} died during " in result.stdout.str()
        [line] = _lines(result)
        where, _, said = line.strip().partition(": ")
        assert re.fullmatch(r".*/pytest_gpuiso/[\w/]+\.py:\d+", where), line  # our line
        assert said == (
            "GpuIsoStartWarning: gpu-isolate: deleted 1 /dev/shm entry "
            f"(1 MiB) created by the tests of a pytest session that died (pid {dead}): "
            f"{segment}"
        ), line
        assert not segment.exists()
        assert list(private_tmpdir.iterdir()) == []
        again = gpuiso.run(DEVICES, "--gpu-isolate-cleanup", f"{PROGRAM}::test_next")
        again.assert_outcomes(passed=1)
        assert _lines(again) == []


def test_without_cleanup_it_is_named_once_and_left(
    gpuiso_spawn, lease_region, private_tmpdir, shm_name
):
    with _killed_session(gpuiso_spawn, shm_name) as (dead, segment):
        result = gpuiso_spawn.run(DEVICES, f"{PROGRAM}::test_next")
        # and, from the lease table, the test it died in (a second warning)
        result.assert_outcomes(passed=1, warnings=2)
        assert f"the pytest session of pid {dead} died during " in result.stdout.str()
        [line] = _lines(result)
        assert (
            f"gpu-isolate: left 1 /dev/shm entry (1 MiB) created by the tests of a pytest "
            f"session that died (pid {dead}) in place: {segment} "
            "(--gpu-isolate-cleanup deletes them)"
        ) in line, line
        assert segment.exists()
        again = gpuiso_spawn.run(DEVICES, f"{PROGRAM}::test_next")
        again.assert_outcomes(passed=1)
        assert _lines(again) == []
