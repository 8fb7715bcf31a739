"""Quarantined GPUs never make a session wait without end or without a word: every way
to a lease (an isolated test with health checks off, a pinned worker with and without
xdist, ``run_isolated(gpus=)``) that quarantines leave short fails in one line naming
them, and a plain ``reset`` names each quarantine it lifts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import GpuIso

REASON = "after t.py::test_k (it crashed with SIGSEGV): the CUDA driver probe failed"
TESTS = """
import pytest
from pytest_gpuiso import run_isolated

@pytest.mark.gpu_isolated(timeout=30)
def test_iso():
    pass

def test_plain():
    pass

def test_call():
    assert run_isolated(sum, [1, 2], gpus=1) == 3
"""
QUARANTINED = "*quarantined: GPU 0 (after t.py::test_k*); GPU 1 (after t.py::test_k*)*"
BOTH = "*GPU* wanted, 0 of 2 healthy" + QUARANTINED


def _quarantine(*devices: str) -> None:
    from pytest_gpuiso.gpu.devices import Devices
    from pytest_gpuiso.gpu.leases import Leases

    leases = Leases(Devices(("0", "1"), "test"), 1)
    leases.release(leases.acquire(2, "t::init", 5.0))  # the rows exist
    for device in devices:
        assert leases.quarantine(device, REASON) is None


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(("--gpu-isolate-health=off", "-k", "test_iso"), id="health-off"),
        pytest.param(("--gpu-isolate-pin-workers", "-k", "test_plain"), id="pinned"),
        pytest.param(("-n", "2", "--gpu-isolate-pin-workers", "-k", "test_plain"), id="xdist"),
    ],
)
def test_a_session_quarantines_leave_short_fails_in_one_line(
    gpuiso: GpuIso, lease_region: Path, args: tuple[str, ...]
) -> None:
    """Both GPUs quarantined: before, each of these waited for a lift without end and
    without a word (the one-line check lived in the health-checked path only)."""
    _quarantine("0", "1")
    gpuiso.pytester.makepyfile(t=TESTS)
    result = gpuiso.run("--gpu-isolate-devices=0,1", *args, "t.py", timeout=60)
    assert result.ret != 0
    out = result.stdout.str() + result.stderr.str()
    pytest.LineMatcher(out.splitlines()).fnmatch_lines([BOTH])
    assert "reset --device 0" in out and "Traceback" not in out


def test_pinned_workers_with_too_few_healthy_gpus_fail_in_one_line(
    gpuiso: GpuIso, lease_region: Path
) -> None:
    """GPU 1 quarantined, two pinned workers of one GPU each: the controller's wait (it
    retries its all-or-none leases) could never end."""
    _quarantine("1")
    gpuiso.pytester.makepyfile(t=TESTS)
    result = gpuiso.run(
        "-n", "2", "--gpu-isolate-devices=0,1", "--gpu-isolate-pin-workers", "t.py", timeout=60
    )
    assert result.ret != 0
    pytest.LineMatcher(result.stderr.lines).fnmatch_lines(
        ["*2 pinned workers of 1 GPU each wanted, 1 of 2 healthy; quarantined: GPU 1 (after*"]
    )


def test_run_isolated_with_every_gpu_quarantined_fails_in_one_line(
    gpuiso: GpuIso, lease_region: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _quarantine("0", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    gpuiso.pytester.makepyfile(t=TESTS)
    result = gpuiso.run("-k", "test_call", "t.py", timeout=60)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*run_isolated(sum)*1 GPU wanted, 0 of 2 healthy*"])


def test_a_plain_reset_names_each_quarantine_it_lifts(lease_region: Path) -> None:
    _quarantine("1")
    reset = subprocess.run(
        [sys.executable, "-m", "pytest_gpuiso", "reset"],
        capture_output=True,
        text=True,
        cwd="/",
        env=os.environ,
        timeout=60,
    )
    assert reset.returncode == 0, reset.stderr
    assert reset.stdout == (
        f"cleared {lease_region}; quarantine lifted without a probe: GPU 1 ({REASON})\n"
    )
