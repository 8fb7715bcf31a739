"""The demo suite the README's first command runs shows every failure mode it promises."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers import ROOT

# What is installed and how: CI's wheel stage runs it against the installed wheel
pytestmark = pytest.mark.installation


# the demo's default preload is torch where it is installed: CI's ML stage runs it there
@pytest.mark.ml
def test_the_demo_reports_each_failure_mode(pytester: pytest.Pytester):
    shutil.copy(ROOT / "fixtures" / "demo" / "test_demo.py", pytester.path)
    before = set(Path("/dev/shm").glob("psm_*"))
    # --gpu-isolate-cleanup: the leaked segment is reported, then deleted (as tox.ini does
    # for the README's demo command), not left in /dev/shm by every run of this test
    result = pytester.runpytest_subprocess(  # in file order: pytest-randomly off
        "--gpu-isolate",
        "--gpu-isolate-cleanup",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:randomly",
        timeout=300,
    )
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert set(Path("/dev/shm").glob("psm_*")) <= before  # the leaked segment was deleted
    outcomes = result.parseoutcomes()
    # test_uses_the_gpu_when_there_is_one skips without torch or a CUDA device
    ran_gpu = outcomes.get("skipped", 0) == 0
    assert outcomes["failed"] == 4
    assert outcomes["passed"] == 5 + ran_gpu
    assert outcomes["xfailed"] == 1
    result.stdout.fnmatch_lines(
        [
            "*test_hangs_and_times_out*",
            "Timeout: the isolated test timed out after 3 s (timeout from marker) during call*",
            "*Crashed: the isolated test process crashed with SIGSEGV*",
            "*exited with code 0 during call before reporting a complete result*",
            "gpu-isolate: 11 isolated, 1 timed out, 2 crashed, 1 escaped process killed",
            "  TIMEOUT test_demo.py::test_hangs_and_times_out (after 3 s)",
            "  CRASHED test_demo.py::test_segfaults (SIGSEGV)",
            "gpu-isolate: 2 leaks in 2 tests (1 shm, 1 process, 0 gpu_memory)",
        ],
        consecutive=False,
    )


def test_the_readmes_demo_command_takes_the_demos_own_config(pytester: pytest.Pytester):
    """`pytest --gpu-isolate fixtures/demo` from the repository's root: the demo's
    pytest.ini, not the project's tox.ini (whose addopts and gpu_isolate_cleanup a user's
    project lacks), and no .pytest_cache left in fixtures/, which the sdist carries."""
    demo = ROOT / "fixtures" / "demo"
    result = pytester.runpytest_subprocess("--gpu-isolate", "--collect-only", demo, timeout=120)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(
        [f"rootdir: {demo}", "configfile: pytest.ini", "*11 tests collected*"],
        consecutive=False,
    )
    assert not (demo / ".pytest_cache").exists()
