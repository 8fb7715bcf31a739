"""Pinned workers' GPUs stay held while the workers live, whatever becomes of their xdist
controller: each worker makes the lease its controller took for it its own."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import psutil

from tests.helpers import GpuIso
from tests.helpers.lease_table import wait_until

HOLDING = """
import os, time
from pathlib import Path

def _hold(name):
    Path(os.environ["GPUISO_HOLD_DIR"], name).write_text(os.environ["CUDA_VISIBLE_DEVICES"])
    release = Path(os.environ["GPUISO_HOLD_DIR"], "release")
    deadline = time.monotonic() + 60
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.05)

def test_a():
    _hold("a")

def test_b():
    _hold("b")
"""


def test_a_sigkilled_controller_frees_no_gpu_its_workers_still_use(
    gpuiso_spawn: GpuIso, lease_region: Path, tmp_path: Path
) -> None:
    """Before: the controller held its workers' leases, so SIGKILL freed both GPUs at once
    while the workers still ran their tests on them, and a new lease got one."""
    from pytest_gpuiso.gpu.devices import Devices
    from pytest_gpuiso.gpu.leases import Leases, LeaseTimeout

    holds = tmp_path / "holds"
    holds.mkdir()
    gpuiso_spawn.pytester.makepyfile(test_hold=HOLDING)
    session = gpuiso_spawn.popen(
        "-p", "no:randomly", "-n", "2", "--gpu-isolate-pin-workers",
        "--gpu-isolate-devices=0,1", "test_hold.py", env={"GPUISO_HOLD_DIR": str(holds)},
    )  # fmt: skip
    workers = []
    try:
        wait_until(lambda: {"a", "b"} <= {p.name for p in holds.iterdir()}, "both tests", 60)
        workers = psutil.Process(session.pid).children()
        assert {(holds / n).read_text() for n in "ab"} == {"0", "1"}
        os.kill(session.pid, signal.SIGKILL)
        session.wait(timeout=30)
        time.sleep(0.2)
        assert all(w.is_running() for w in workers)  # still in their tests, on their GPUs
        leases = Leases(Devices(("0", "1"), "test"), 1)
        held = [h for h in leases.region.snapshot()["holders"] if h["alive"]]
        assert sorted(h["pid"] for h in held) == sorted(w.pid for w in workers), held
        try:
            got = leases.acquire(1, "t::other", 0.5)
        except LeaseTimeout:
            got = None
        assert got is None, f"GPU {got.devices} leased while a worker still runs on it"
    finally:
        (holds / "release").touch()
        for proc in [*workers, session]:
            with contextlib.suppress(ProcessLookupError, psutil.NoSuchProcess):
                proc.kill()
    psutil.wait_procs(workers, timeout=30)
    # the workers gone, their leases went with them
    assert Leases(Devices(("0", "1"), "test"), 1).acquire(2, "t::after", 10.0).devices
