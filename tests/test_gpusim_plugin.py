"""The plugin on the simulated GPU (fixtures/gpusim/, issue 32): the GPU scenarios of
tests/gpu/, run in CI without a GPU. The pytest process under test finds the simulated
GPUs through nvidia-ml-py and the stand-in libnvidia-ml.so.1; its tests use the stand-in
CUDA driver through ctypes. The simulator frees a process's memory as it ends, at once:
the driver's asynchronous teardown is not modelled."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.helpers import GPUSIM, REPORT, GpuIso, kill_quietly, wait_gone

# nvidia-ml-py's version decides which NVML functions it calls; the installed wheel finds
# NVML as users' do: CI's wheel and lowest-versions stages run these whole.
pytestmark = [pytest.mark.installation, pytest.mark.versions]

MOD = "sim_leaks.py"
GPU_CHECKS_ON = "gpu-isolate: leak checks *(gpu_memory tolerance 64 MiB)"
MARK = "gpuiso-sim-escaped-allocator"
MIB = 1 << 20


@pytest.fixture
def sim(gpusim_libs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Two simulated GPUs for the pytest sessions this test starts; the state file."""
    state = tmp_path / "gpus"
    path = os.environ.get("LD_LIBRARY_PATH", "")
    monkeypatch.setenv("LD_LIBRARY_PATH", f"{gpusim_libs}:{path}" if path else str(gpusim_libs))
    monkeypatch.setenv("GPUISO_SIM_STATE", str(state))
    monkeypatch.setenv("GPUISO_SIM_GPUS", "Sim H100,81559;Sim A10,23028")
    monkeypatch.setenv("GPUISO_SIM_CONTEXT_MIB", "300")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return state


def _copy(gpuiso: GpuIso, *names: str) -> None:
    for name in names:
        shutil.copy(GPUSIM / name, gpuiso.path / name)


def _record(gpuiso: GpuIso, test: str) -> dict:
    records = gpuiso.records()
    assert f"{MOD}::{test}" in records, records
    return records[f"{MOD}::{test}"]


def test_clean_cuda_test_leaks_nothing(gpuiso: GpuIso, sim: Path) -> None:
    _copy(gpuiso, MOD, "sim_process.py")
    result = gpuiso.run(REPORT, f"{MOD}::test_clean_cuda")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([GPU_CHECKS_ON])
    record = _record(gpuiso, "test_clean_cuda")
    assert len(record["gpus"]) == 1
    assert record["leaks"] == [] and record["escaped"] == []


def test_escaped_gpu_process_is_killed_and_its_memory_freed(
    gpuiso: GpuIso, sim: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pidfile = gpuiso.path / "escaped.pid"
    monkeypatch.setenv("GPUISO_LEAK_PIDFILE", str(pidfile))
    _copy(gpuiso, MOD, "sim_process.py")
    try:
        result = gpuiso.run(REPORT, f"{MOD}::test_escaped_allocator")
        result.assert_outcomes(passed=1)
        result.stdout.fnmatch_lines([GPU_CHECKS_ON])
        pid = int(pidfile.read_text())
        record = _record(gpuiso, "test_escaped_allocator")
        assert len(record["gpus"]) == 1
        [proc] = [leak for leak in record["leaks"] if leak["kind"] == "process"]
        assert proc["pid"] == pid and MARK in proc["cmdline"]
        assert record["escaped"] == [{"pid": pid, "cmdline": proc["cmdline"]}]
        # Killed by the sweep before the GPU check: its memory is free, no growth.
        assert [leak for leak in record["leaks"] if leak["kind"] == "gpu_memory"] == []
        assert wait_gone([pid], 10) == []
    finally:
        if pidfile.exists():
            pid = int(pidfile.read_text())
            if psutil.pid_exists(pid) and MARK in " ".join(psutil.Process(pid).cmdline()):
                kill_quietly([pid])


def test_escaped_gpu_holder_fails_teardown(
    gpuiso: GpuIso, sim: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process outside the test's tree takes 1 GiB on the test's GPU during the test: the
    residual-GPU-memory probe names it (NVML's pid and bytes), and fails the teardown under
    gpu_memory=fail; the sweep leaves it alone (not the test's descendant)."""
    holder = gpuiso.path / "holder"
    holder.mkdir()
    monkeypatch.setenv("GPUISO_HOLDER_DIR", str(holder))
    _copy(gpuiso, MOD, "sim_process.py")
    server = subprocess.Popen(
        [sys.executable, str(GPUSIM / "sim_holder.py"), str(holder), "120"],
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        args = (REPORT, "--gpu-isolate-leaks=gpu_memory=fail", f"{MOD}::test_escaped_gpu_holder")
        result = gpuiso.run(*args)
        assert server.poll() is None, "the holder ended early"
        assert int((holder / "ack").read_text()) == server.pid
    finally:
        server.kill()
        server.wait(timeout=30)
    result.assert_outcomes(passed=1, errors=1)
    record = _record(gpuiso, "test_escaped_gpu_holder")
    [device] = record["gpus"]
    leaks = record["leaks"]
    assert [leak for leak in leaks if leak["kind"] == "process"] == []
    gpu = [leak for leak in leaks if leak["kind"] == "gpu_memory"]
    assert [(leak["device"], leak["pid"], leak["bytes"]) for leak in gpu if leak.get("holder")] == [
        (device, server.pid, (300 + 1024) * MIB)
    ], leaks
    assert [leak for leak in gpu if not leak.get("holder")] == [], leaks  # all accounted for
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_escaped_gpu_holder*",
            f"*gpu_memory: GPU {device}: process {server.pid} (NVML pid, 1324 MiB) appeared on "
            "the GPU during the test and still holds it after the test's processes were reaped*",
        ]
    )
