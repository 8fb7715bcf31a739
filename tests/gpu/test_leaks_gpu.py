"""Leak checks on a real GPU: escaped GPU processes, escaped GPU holders, torch's allocator.

Each test runs fixtures/programs/gpus/gpu_leaks.py (every test there is marked
gpu_isolated, so it leases the GPU) in a pytester session and asserts on the
outcomes, the JSON report's ``leaks`` and the terminal. Skipped without CUDA or
torch (tests/gpu/conftest.py); this process never imports torch. The tests use
the whole GPU's memory accounting: run them alone on the GPU, without xdist.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import psutil
import pytest

from tests.helpers import REPORT, kill_quietly, program, wait_gone

MOD = "gpu_leaks.py"
TIMEOUT = "--gpu-isolate-timeout=120"
RUN_TIMEOUT = 420  # seconds for a whole pytester session (each test is bounded by 120 s)
MIB = 1 << 20
GPU_CHECKS_ON = "gpu-isolate: leak checks *(gpu_memory tolerance 64 MiB)"


@pytest.fixture
def nvml() -> None:
    """The gpu_memory probe reads NVML through nvidia-ml-py in the pytest parent."""
    if importlib.util.find_spec("pynvml") is None:
        pytest.skip("nvidia-ml-py (pynvml) is not installed: no gpu_memory leak checks")


def record_of(gpuiso, test: str) -> dict:
    records = gpuiso.records()
    assert f"{MOD}::{test}" in records, records
    return records[f"{MOD}::{test}"]


def of_kind(leaks: list[dict], kind: str) -> list[dict]:
    return [leak for leak in leaks if leak["kind"] == kind]


def kill_if_ours(pid: int, mark: str) -> None:
    """SIGKILL ``pid`` if it is still the process we started (its command line has ``mark``)."""
    try:
        ours = mark in " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return
    if ours:
        kill_quietly([pid])
        wait_gone([pid], 10)


def test_escaped_gpu_process_is_killed_and_its_memory_freed(gpuiso, monkeypatch, nvml):
    pidfile = gpuiso.path / "escaped.pid"
    monkeypatch.setenv("GPUISO_LEAK_PIDFILE", str(pidfile))
    gpuiso.copy(MOD)
    try:
        result = gpuiso.run(REPORT, TIMEOUT, f"{MOD}::test_escaped_allocator", timeout=RUN_TIMEOUT)
        result.assert_outcomes(passed=1)
        result.stdout.fnmatch_lines([GPU_CHECKS_ON])
        pid = int(pidfile.read_text())
        record = record_of(gpuiso, "test_escaped_allocator")
        assert len(record["gpus"]) == 1
        leaks = record["leaks"]
        [proc] = of_kind(leaks, "process")
        assert proc["pid"] == pid
        assert "gpuiso-escaped-allocator" in proc["cmdline"]
        assert record["escaped"] == [{"pid": pid, "cmdline": proc["cmdline"]}]
        # The sweep killed it before the GPU check, which waits for the driver to free
        # the dead process's memory (backoff): no holder, no growth.
        assert of_kind(leaks, "gpu_memory") == [], leaks
        assert wait_gone([pid], 10) == [], f"pid {pid} survived the sweep"
    finally:
        if pidfile.exists():
            kill_if_ours(int(pidfile.read_text()), "gpuiso-escaped-allocator")


def test_clean_cuda_test_leaks_nothing(gpuiso, nvml):
    gpuiso.copy(MOD)
    result = gpuiso.run(REPORT, TIMEOUT, f"{MOD}::test_clean_cuda", timeout=RUN_TIMEOUT)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([GPU_CHECKS_ON])
    record = record_of(gpuiso, "test_clean_cuda")
    assert len(record["gpus"]) == 1
    assert record["leaks"] == []
    assert record["escaped"] == []


def test_a_gpu_holder_not_of_the_test_is_noted_never_blamed(gpuiso, monkeypatch, nvml):
    holder = gpuiso.path / "holder"
    holder.mkdir()
    monkeypatch.setenv("GPUISO_HOLDER_DIR", str(holder))
    gpuiso.copy(MOD)
    # Started here, outside the inner pytest session: its sweep cannot kill the server.
    with open(gpuiso.path / "holder.log", "wb") as log:
        server = subprocess.Popen(
            [sys.executable, str(program("gpu_holder_server.py")), str(holder), "300"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        result = gpuiso.run(
            REPORT,
            TIMEOUT,
            "--gpu-isolate-leaks=gpu_memory=fail",
            f"{MOD}::test_escaped_gpu_holder",
            timeout=RUN_TIMEOUT,
        )
        log_text = (gpuiso.path / "holder.log").read_text()
        assert server.poll() is None, f"the holder server ended early:\n{log_text}"
        server_pid = int((holder / "ack").read_text())
        assert server_pid == server.pid
    finally:
        server.kill()
        server.wait(timeout=30)
    # The server is not the test's process tree: noted, never the test's leak.
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([GPU_CHECKS_ON])
    record = record_of(gpuiso, "test_escaped_gpu_holder")
    assert record["outcome"] == "passed"
    [device] = record["gpus"]
    leaks = record["leaks"]
    assert of_kind(leaks, "process") == [], "the server is not the test's descendant"
    assert of_kind(leaks, "gpu_memory") == [], leaks
    notes = record["gpu_notes"]
    # NVML's pid (the host's inside a container), and its memory when NVML says it; when
    # it does not, the growth beside it is noted too, not blamed.
    assert notes[0].startswith(f"GPU {device}: pid "), notes
    assert notes[0].endswith(": noted, not blamed") and "(not this test's) holds" in notes[0]
    assert len(notes) in (1, 2), notes
    result.stdout.fnmatch_lines([f"gpu-isolate: {notes[0]} (after *::test_escaped_gpu_holder)"])
    assert "QUARANTINED" not in result.stdout.str()


def test_torch_check_reports_tensors_kept_alive(gpuiso):
    gpuiso.copy(MOD)
    result = gpuiso.run(
        REPORT,
        TIMEOUT,
        "--gpu-isolate-torch-check",
        f"{MOD}::test_torch_tensor_kept_in_global",
        f"{MOD}::test_clean_cuda",
        timeout=RUN_TIMEOUT,
    )
    result.assert_outcomes(passed=2)
    kept = record_of(gpuiso, "test_torch_tensor_kept_in_global")
    [leak] = kept["leaks"]  # torch's view only: NVML sees the memory freed with the process
    assert leak["kind"] == "gpu_memory"
    assert leak["source"] == "torch"
    assert leak["device"] == "cuda:0"
    assert leak["bytes"] >= 256 * MIB
    assert "torch.cuda.memory_allocated() grew by" in leak["detail"]
    assert record_of(gpuiso, "test_clean_cuda")["leaks"] == []
