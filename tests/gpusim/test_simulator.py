"""The simulated GPU (fixtures/gpusim/): stand-ins for the CUDA driver and NVML
at their C interface, sharing one state file, so that the plugin's GPU paths can run
end to end without a GPU. These tests check the simulator itself, through the real
nvidia-ml-py (sim_query.py) and ctypes over the stand-in driver (sim_process.py), each
in a process of its own (the loader reads LD_LIBRARY_PATH only when a process starts)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import program
from tests.helpers.lease_table import wait_until

# nvidia-ml-py's version decides which NVML functions it calls; the installed wheel finds
# NVML as users' do: CI's wheel and lowest-versions stages run these whole.
pytestmark = [pytest.mark.installation, pytest.mark.versions]

MIB = 1024 * 1024
TWO_GPUS = "Sim H100,81559;Sim A10,23028"
CUDA_ERROR_NOT_INITIALIZED, CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_NO_DEVICE = 3, 2, 100


class Sim:
    """One simulated machine: its state file and the environment that uses it."""

    def __init__(self, libs: Path, state: Path, gpus: str, **extra: str) -> None:
        self.env = dict(os.environ)
        self.env.pop("CUDA_VISIBLE_DEVICES", None)
        self.env.update(
            LD_LIBRARY_PATH=f"{libs}:{os.environ.get('LD_LIBRARY_PATH', '')}",
            GPUISO_SIM_STATE=str(state),
            GPUISO_SIM_GPUS=gpus,
            GPUISO_SIM_CONTEXT_MIB="300",
            **extra,
        )

    def query(self) -> dict:
        done = subprocess.run(
            [sys.executable, str(program("sim_query.py"))],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def start(self, *args: str, cvd: str | None = None) -> tuple[subprocess.Popen, dict]:
        """sim_process.py with ``args``, holding; its JSON line."""
        env = dict(self.env)
        if cvd is not None:
            env["CUDA_VISIBLE_DEVICES"] = cvd
        proc = subprocess.Popen(
            [sys.executable, str(program("sim_process.py")), *args],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        line = proc.stdout.readline()
        assert line, "sim_process.py printed nothing"
        return proc, json.loads(line)

    def run(self, *args: str, cvd: str | None = None) -> dict:
        proc, seen = self.start(*args, cvd=cvd)
        proc.communicate(timeout=60)
        return seen


@pytest.fixture
def sim(gpusim_libs: Path, tmp_path: Path):
    return lambda gpus=TWO_GPUS, **extra: Sim(gpusim_libs, tmp_path / "gpus", gpus, **extra)


def test_nvml_sees_the_configured_gpus(sim) -> None:
    seen = sim().query()
    assert seen["count"] == 2
    assert [g["name"] for g in seen["gpus"]] == ["Sim H100", "Sim A10"]
    assert [g["total"] for g in seen["gpus"]] == [81559 * MIB, 23028 * MIB]
    assert [g["uuid"] for g in seen["gpus"]] == [
        "GPU-00000001-0000-4000-8000-000000000000",
        "GPU-00000002-0000-4000-8000-000000000000",
    ]
    assert all(g["used"] == 0 and g["processes"] == [] for g in seen["gpus"])


def test_an_allocation_shows_in_nvml_until_its_process_ends(sim) -> None:
    """A context (300 MiB here) and 1 GiB, on GPU 0, as the holder's process; freed when
    it exits, as the driver frees a process's memory."""
    machine = sim()
    proc, seen = machine.start("--alloc", "1024", "--hold")
    try:
        assert (seen["init"], seen["count"], seen["context"], seen["alloc"]) == (0, 2, 0, 0)
        held = machine.query()["gpus"]
        assert held[0]["used"] == (300 + 1024) * MIB
        assert held[0]["processes"] == [[seen["pid"], (300 + 1024) * MIB]]
        assert held[1]["used"] == 0
    finally:
        proc.communicate(timeout=60)
    assert machine.query()["gpus"][0] == {**held[0], "used": 0, "processes": []}


def test_a_killed_process_frees_and_a_daemon_keeps(sim) -> None:
    machine = sim()
    proc, seen = machine.start("--alloc", "512", "--hold")
    proc.kill()
    proc.wait(timeout=60)
    assert machine.query()["gpus"][0]["used"] == 0
    daemon_proc, daemon = machine.start("--alloc", "512", "--daemon")
    try:
        daemon_proc.wait(timeout=60)  # the launcher exits; the daemon holds on
        assert daemon["pid"] != daemon_proc.pid
        assert machine.query()["gpus"][0]["processes"] == [[daemon["pid"], (300 + 512) * MIB]]
    finally:
        os.kill(daemon["pid"], signal.SIGKILL)
    wait_until(lambda: machine.query()["gpus"][0]["used"] == 0, "the daemon's memory freed", 20)


@pytest.mark.parametrize(
    "cvd, count, gpu",
    [
        (None, 2, 0),
        ("1", 1, 1),
        ("GPU-00000002", 1, 1),  # a UUID's prefix, as CUDA takes it
        ("1,0", 2, 1),
        ("0,7,1", 1, 0),  # the list ends at the first entry that names no GPU
    ],
)
def test_cuda_visible_devices_decides_what_the_driver_sees(sim, cvd, count, gpu) -> None:
    machine = sim()
    proc, seen = machine.start("--alloc", "64", "--hold", cvd=cvd)
    try:
        assert (seen["init"], seen["count"]) == (0, count)
        used = [g["used"] for g in machine.query()["gpus"]]
        assert used[gpu] == (300 + 64) * MIB and used[1 - gpu] == 0, used
    finally:
        proc.communicate(timeout=60)


def test_no_visible_gpu_fails_cuinit_and_leaves_the_driver_uninitialised(sim) -> None:
    """As the real driver on an H100 (2026-11-26): CUDA_ERROR_NO_DEVICE, then
    cuDeviceGetCount still answers CUDA_ERROR_NOT_INITIALIZED."""
    machine = sim()
    seen = machine.run(cvd="")
    assert (seen["init"], seen["count"]) == (CUDA_ERROR_NO_DEVICE, None)
    assert machine.run("--alloc", "0", cvd="")["context"] is None


def test_allocating_past_the_gpu_fails_with_out_of_memory(sim) -> None:
    machine = sim("Sim small,1024")
    seen = machine.run("--alloc", "800")
    assert (seen["context"], seen["alloc"]) == (0, CUDA_ERROR_OUT_OF_MEMORY)


def test_mig_instances_are_devices_of_their_own(sim) -> None:
    machine = sim("Sim H100,81559;Sim A100,40960,mig=20480+10240")
    gpus = machine.query()["gpus"]
    mig = gpus[1]["mig"]
    assert [m["total"] for m in mig] == [20480 * MIB, 10240 * MIB]
    assert gpus[0]["mig"] == []
    uuid = mig[1]["uuid"]
    assert uuid.startswith("MIG-")
    proc, seen = machine.start("--alloc", "100", "--hold", cvd=uuid)
    try:
        assert (seen["init"], seen["count"], seen["alloc"]) == (0, 1, 0)
        gpus = machine.query()["gpus"]
        assert [m["used"] for m in gpus[1]["mig"]] == [0, 400 * MIB]
        assert gpus[1]["used"] == 400 * MIB  # the whole GPU counts its instances
    finally:
        proc.communicate(timeout=60)
    assert machine.run(cvd="1")["init"] == CUDA_ERROR_NO_DEVICE  # no whole GPU under MIG


def test_faults_a_lost_gpu_and_a_failing_synchronize(sim) -> None:
    machine = sim(GPUISO_SIM_LOST="1", GPUISO_SIM_SYNC_ERROR="999")
    gpus = machine.query()["gpus"]
    assert "used" in gpus[0]
    assert gpus[1] == {"index": 1, "error": "GPU is lost"}
    assert machine.run("--alloc", "1")["sync"] == 999


def test_an_injected_xid_reaches_the_event_sets_of_its_gpu(sim) -> None:
    """An Xid injected on GPU 0 is not seen by a set registered for GPU 1; one on GPU 1
    is, with its UUID and code, through nvidia-ml-py's event functions."""
    machine = sim()
    listener = subprocess.Popen(
        [sys.executable, str(program("sim_events.py")), "listen", "1", "20000"],
        env=machine.env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert listener.stdout.readline().strip() == "ready"
        for gpu, xid in (("0", "48"), ("1", "79")):
            injected = subprocess.run(
                [sys.executable, str(program("sim_events.py")), "xid", gpu, xid],
                env=machine.env,
                timeout=60,
            )
            assert injected.returncode == 0
        out, _ = listener.communicate(timeout=60)
    finally:
        listener.kill()
    assert json.loads(out) == {"uuid": "GPU-00000002-0000-4000-8000-000000000000", "xid": 79}


def test_a_gpu_lost_while_running_answers_gpu_is_lost(sim) -> None:
    machine = sim()
    assert "error" not in machine.query()["gpus"][0]
    lost = subprocess.run(
        [sys.executable, str(program("sim_events.py")), "lose", "0"], env=machine.env, timeout=60
    )
    assert lost.returncode == 0
    assert machine.query()["gpus"][0] == {"index": 0, "error": "GPU is lost"}
    quiet = subprocess.run(
        [sys.executable, str(program("sim_events.py")), "listen", "1", "100"],
        env=machine.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert quiet.stdout.splitlines() == ["ready", '{"timeout": true}'], quiet.stderr


THREADS_AND_FORK = """
import ctypes, os, sys, threading
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
device, context = ctypes.c_int(), ctypes.c_void_p()
assert cuda.cuDeviceGet(ctypes.byref(device), 0) == 0
assert cuda.cuCtxCreate_v2(ctypes.byref(context), 0, device) == 0
failed = []
def allocate():
    for _ in range(400):
        pointer = ctypes.c_ulonglong()
        if cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(1 << 20)) != 0:
            failed.append(1)
threads = [threading.Thread(target=allocate) for _ in range(2)]
for t in threads: t.start()
for t in threads: t.join()
pid = os.fork()
if pid == 0:
    pointer = ctypes.c_ulonglong()
    count = ctypes.c_int()
    os._exit(10 * cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(1 << 20))
             + cuda.cuDeviceGetCount(ctypes.byref(count)))
_, status = os.waitpid(pid, 0)
print(len(failed), os.waitstatus_to_exitcode(status), flush=True)
sys.stdin.readline()
"""


def test_threads_allocate_exactly_and_a_forked_child_cannot_use_the_driver(sim) -> None:
    """Two threads allocate 400 MiB each, 1 MiB at a time: NVML counts all 800 (the state's
    lock orders threads too). A forked child of the initialised process gets
    CUDA_ERROR_NOT_INITIALIZED from every call, as from the real driver."""
    machine = sim()
    proc = subprocess.Popen(
        [sys.executable, "-c", THREADS_AND_FORK],
        env=machine.env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        failed, child_status = map(int, proc.stdout.readline().split())
        assert failed == 0
        assert child_status == 10 * CUDA_ERROR_NOT_INITIALIZED + CUDA_ERROR_NOT_INITIALIZED
        assert machine.query()["gpus"][0]["used"] == (300 + 800) * MIB
    finally:
        proc.communicate(timeout=60)


def test_a_device_named_twice_ends_the_list(sim) -> None:
    assert machine_count(sim(), "1,1,0") == 1
    assert machine_count(sim(), ",".join(["0"] * 100)) == 1  # and never overruns


def machine_count(machine: Sim, cvd: str) -> int:
    return machine.run(cvd=cvd)["count"]
