"""The plugin on the simulated GPU (fixtures/gpusim/): the GPU scenarios of
tests/gpu/, run in CI without a GPU. The pytest process under test finds the simulated
GPUs through nvidia-ml-py and the stand-in libnvidia-ml.so.1; its tests use the stand-in
CUDA driver through ctypes. The simulator frees a process's memory as it ends, at once:
the driver's asynchronous teardown is not modelled."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.helpers import REPORT, GpuIso, kill_quietly, make_gpuiso, program, wait_gone
from tests.helpers.lease_table import max_overlap, wait_until

# nvidia-ml-py's version decides which NVML functions it calls; the installed wheel finds
# NVML as users' do: CI's wheel and lowest-versions stages run these whole.
pytestmark = [pytest.mark.installation, pytest.mark.versions]

MOD = "sim_leaks.py"
GPU_CHECKS_ON = "gpu-isolate: leak checks *(gpu_memory tolerance 64 MiB)"
MARK = "gpuiso-sim-escaped-allocator"
MIB = 1 << 20


def _copy(gpuiso: GpuIso, *names: str) -> None:
    for name in names:
        shutil.copy(program(name), gpuiso.path / name)


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
            with contextlib.suppress(psutil.Error):
                if MARK in " ".join(psutil.Process(pid).cmdline()):
                    kill_quietly([pid])


@pytest.mark.parametrize("crash", [False, True], ids=["passes", "crashes"])
def test_gpu_holders_not_of_the_test_are_noted_never_blamed(
    gpuiso_spawn: GpuIso, sim: Path, monkeypatch: pytest.MonkeyPatch, crash: bool
) -> None:
    """Two processes outside the test's tree (started here, as another user's job or a
    notebook would be) take 1 GiB each on the test's GPU during the test. They are not
    the test's: under gpu_memory=fail no gpu_memory leak, and when the test then crashes
    its GPU is probed and found healthy, not quarantined; each holder is noted in the
    record (NVML's pid and bytes, every entry of NVML's process list read right, whatever
    nvidia-ml-py's version) and in one terminal line. The sweep leaves them alone. A
    holder the test leaves behind is its leak (test_escaped_gpu_process_is_killed_and_its
    _memory_freed). The holders and the probe live outside the test's process: one start
    method is enough."""
    gpuiso = gpuiso_spawn
    folders = [gpuiso.path / "holder-a", gpuiso.path / "holder-b"]
    for folder in folders:
        folder.mkdir()
    monkeypatch.setenv("GPUISO_HOLDER_DIR", os.pathsep.join(map(str, folders)))
    if crash:
        monkeypatch.setenv("GPUISO_HOLDER_THEN_CRASH", "1")
    _copy(gpuiso, MOD, "sim_process.py")
    holders = [
        subprocess.Popen(
            [sys.executable, str(program("sim_holder.py")), str(folder), "120"],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        for folder in folders
    ]
    try:
        args = (REPORT, "--gpu-isolate-leaks=gpu_memory=fail", f"{MOD}::test_escaped_gpu_holder")
        result = gpuiso.run(*args)
        assert all(holder.poll() is None for holder in holders), "a holder ended early"
        assert [int((f / "ack").read_text()) for f in folders] == [h.pid for h in holders]
    finally:
        for holder in holders:
            holder.kill()
            holder.wait(timeout=30)
    result.assert_outcomes(**({"failed": 1} if crash else {"passed": 1}))
    record = _record(gpuiso, "test_escaped_gpu_holder")
    [device] = record["gpus"]
    assert record["leaks"] == [], record["leaks"]  # neither a process nor a gpu_memory leak
    notes = [
        f"GPU {device}: pid {h.pid} (not this test's) holds {300 + 1024} MiB: noted, not blamed"
        for h in sorted(holders, key=lambda h: h.pid)
    ]
    assert record["gpu_notes"] == notes
    after = f"(after {MOD}::test_escaped_gpu_holder)"
    lines = [f"gpu-isolate: {note} {after}" for note in notes]
    result.stdout.fnmatch_lines(lines, consecutive=True)
    assert "QUARANTINED" not in result.stdout.str()
    if crash:
        assert record["exit"]["signal"] == "SIGSEGV"
        assert record["gpu_health"] == {
            "probed": "it crashed with SIGSEGV",
            "devices": [device],
            "quarantined": {},
        }
    else:
        assert "gpu_health" not in record


PARENT_CHECK = """
import os
from pytest_gpuiso.child.relay import CHILD_PLUGIN

def pytest_sessionfinish(session):
    if session.config.pluginmanager.has_plugin(CHILD_PLUGIN):
        return  # a test's process, where CUDA is expected
    with open("/proc/self/maps") as f:
        maps = f.read()
    print("PARENT libcuda=%s libnvidia-ml=%s" % ("/libcuda.so" in maps, "/libnvidia-ml.so" in maps))
"""


def test_the_pytest_process_never_loads_the_driver(gpuiso: GpuIso, sim: Path) -> None:
    """The tests use CUDA on their leased GPUs; pytest's own process reads NVML (the
    simulated GPUs' sizes and memory) but never loads the CUDA driver."""
    _copy(gpuiso, MOD, "sim_process.py")
    (gpuiso.path / "conftest.py").write_text(PARENT_CHECK)
    result = gpuiso.run(REPORT, "-s", f"{MOD}::test_clean_cuda")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*PARENT libcuda=False libnvidia-ml=True*"])
    assert len(_record(gpuiso, "test_clean_cuda")["gpus"]) == 1


def test_a_conftest_that_initialises_cuda_makes_the_fork_server_refuse(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, sim: Path
) -> None:
    """A conftest calls cuInit at import (the GPUs visible to the fork server): the server
    refuses to fork, and every test still runs, started with spawn, on its own GPU."""
    iso = make_gpuiso(pytester, monkeypatch, "forkserver")
    _copy(iso, MOD, "sim_process.py")
    (iso.path / "conftest.py").write_text("import ctypes\nctypes.CDLL('libcuda.so.1').cuInit(0)\n")
    result = iso.run("-v", REPORT, "--gpu-isolate-prewarm=0", f"{MOD}::test_clean_cuda")
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(
        [
            "*the fork server refused to fork: the CUDA driver is initialised (*libcuda.so.1); "
            "isolated tests are started with spawn instead*",
            "gpu-isolate: started 1 spawn; *",
        ]
    )


def test_the_peak_is_recorded_and_the_lease_right_sized(gpuiso_spawn: GpuIso, sim: Path) -> None:
    """3 GiB and a 300 MiB context under a 16 GiB lease, and 2 GiB and a context under a
    1 GiB one: each record's peak is what NVML said the test's process held at most, and
    the Markdown summary suggests leases that fit them with 25% headroom."""
    iso = gpuiso_spawn
    _copy(iso, MOD, "sim_process.py")
    args = (REPORT, "--gpu-isolate-summary=summary.md", MOD, "-k", "peaks or exceeds")
    result = iso.run(*args)
    result.assert_outcomes(passed=2)
    below = _record(iso, "test_peaks_at_3_gib_under_16")
    assert (below["gpu_memory"], below["gpu_memory_peak"]) == (16 << 30, (3 << 30) + 300 * MIB)
    above = _record(iso, "test_exceeds_its_1_gib_lease")
    assert (above["gpu_memory"], above["gpu_memory_peak"]) == (1 << 30, (2 << 30) + 300 * MIB)
    summary = (iso.path / "summary.md").read_text()
    assert "### Right-size your leases" in summary
    assert '| 16.00 GiB | 3.29 GiB | `gpu_memory="4.25GiB"` |' in summary, summary
    assert '| 1.00 GiB | 2.29 GiB | `gpu_memory="3GiB"` |' in summary, summary


def test_memory_leases_are_sized_from_nvml(
    gpuiso_spawn: GpuIso, sim: Path, lease_region: Path, tmp_path: Path, monkeypatch
) -> None:
    """Two GPUs of different sizes, known only from NVML: 20 GiB leases pack onto the
    79.65 GiB GPU (two or more at once) and one at a time onto the 22.49 GiB one, never
    more than either holds; 30 GiB goes to the big GPU only; 90 GiB fits neither and is
    skipped saying so."""
    log = tmp_path / "held.log"
    monkeypatch.setenv("GPUISO_LEASE_LOG", str(log))
    _copy(gpuiso_spawn, "sim_leases.py")
    result = gpuiso_spawn.run(REPORT, "-n", "4", "-rs", "sim_leases.py", "-k", "not told")
    result.assert_outcomes(passed=9, skipped=1)
    result.stdout.fnmatch_lines(
        ["*needs gpu_memory=90GiB (90 GiB) on 1 GPU, the largest is 79.65 GiB*"]
    )
    held = [line.split() for line in log.read_text().splitlines()]
    assert len(held) == 9
    overlap = {}
    for gpu, size in (("0", 79.65), ("1", 22.49)):
        on = [(float(s), float(e), int(gib)) for s, e, cvd, gib in held if cvd == gpu]
        assert on, f"nothing ran on GPU {gpu}: {held}"
        overlap[gpu] = max_overlap(on)
        assert overlap[gpu] <= size, (gpu, on)
    assert overlap["0"] >= 40, held  # packed: two leases or more on GPU 0 at once


def test_mig_instances_are_leased_as_devices(gpuiso_spawn: GpuIso, sim: Path, monkeypatch) -> None:
    """A GPU in MIG mode with two instances (NVML lists them): each is a device of its own,
    leased by its UUID, and CUDA in the test sees that instance alone, at its size."""
    monkeypatch.setenv("GPUISO_SIM_GPUS", "Sim A100,40960,mig=20480+10240")
    _copy(gpuiso_spawn, MOD, "sim_process.py")
    result = gpuiso_spawn.run(REPORT, "-s", f"{MOD}::test_sees_one_device")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "gpu-isolate: GPUs MIG-00000001-0000-4000-8000-000000000001 (20 GiB), "
            "MIG-00000001-0000-4000-8000-000000000002 (10 GiB) (from NVML)*"
        ]
    )
    [seen] = [m.split() for m in re.findall(r"SEEN (\S+ \d+ \d+)", result.stdout.str())]
    assert seen[0].startswith("MIG-00000001-") and seen[1] == "1", seen
    assert int(seen[2]) in (20480 * MIB, 10240 * MIB), seen
    [record] = gpuiso_spawn.records().values()
    assert record["gpus"] == [seen[0]]


def test_status_shows_the_gpus_memory_from_nvml(
    gpuiso_spawn: GpuIso, sim: Path, lease_region: Path, tmp_path: Path, monkeypatch
) -> None:
    """While a test holds a 20 GiB lease, `python -m pytest_gpuiso status` shows both
    simulated GPUs at their NVML sizes, the leased and free memory, and the holder."""
    holding, release = tmp_path / "holding", tmp_path / "release"
    monkeypatch.setenv("GPUISO_HOLDING", str(holding))
    monkeypatch.setenv("GPUISO_RELEASE", str(release))
    _copy(gpuiso_spawn, "sim_leases.py")
    session = gpuiso_spawn.popen("sim_leases.py::test_holds_until_told")
    try:
        wait_until(holding.exists, "the test to hold its lease", timeout=60)
        done = subprocess.run(
            [sys.executable, "-m", "pytest_gpuiso", "status"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        release.touch()
        try:
            out, _ = session.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            session.kill()
            raise
    assert session.returncode == 0, out.decode()
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines()]
    assert rows[1][:4] == ["DEVICE", "MEMORY", "LEASED", "FREE"], done.stdout
    devices = {row[0]: row[1:] for row in rows[2:] if row and row[0] in ("0", "1")}
    leased_on = "0" if devices["0"][2:4] == ["20", "GiB"] else "1"
    other = "1" if leased_on == "0" else "0"
    sizes = {"0": ["79.65", "GiB"], "1": ["22.49", "GiB"]}
    free = {"0": ["59.65", "GiB"], "1": ["2.49", "GiB"]}
    assert devices[leased_on] == [*sizes[leased_on], "20", "GiB", *free[leased_on]], done.stdout
    assert devices[other] == [*sizes[other], "0", "bytes", *sizes[other]], done.stdout
    assert "sim_leases.py::test_holds_until_told" in done.stdout


def test_every_test_leases_a_gpu_nvml_found(gpuiso: GpuIso, sim: Path, lease_region) -> None:
    """`pytest --gpu-isolate` on tests nobody marked, GPUs found through NVML: each leases
    one and CUDA shows it that one; gpus=0 sees none, its driver use recorded, not warned."""
    _copy(gpuiso, "sim_every.py")
    args = ("--gpu-isolate", "-n", "2", "--gpu-isolate-slots=2", REPORT, "sim_every.py")
    result = gpuiso.run(*args)
    result.assert_outcomes(passed=3)
    assert "leased no GPU" not in result.stdout.str()
    records = {nodeid.split("::")[1]: r for nodeid, r in gpuiso.records().items()}
    assert len(records["test_unmarked_sees_one_gpu"]["gpus"]) == 1
    assert len(records["test_another_unmarked_sees_one_gpu"]["gpus"]) == 1
    assert "gpus" not in records["test_marked_none_sees_none"]
    assert records["test_marked_none_sees_none"]["cuda_without_gpu"] == ["libcuda.so.1"]


def test_no_gpus_names_the_tests_that_use_cuda(gpuiso: GpuIso, sim: Path, lease_region) -> None:
    """--gpu-isolate-gpus=0: the unmarked tests see no GPU, fail, and each is named in a
    warning as having loaded the driver without a lease."""
    _copy(gpuiso, "sim_every.py")
    args = ("--gpu-isolate", "--gpu-isolate-gpus=0", REPORT, "sim_every.py", "-k", "unmarked")
    result = gpuiso.run(*args)
    result.assert_outcomes(failed=2, warnings=2)
    result.stdout.fnmatch_lines(
        ["*this test loaded libcuda.so.1 but leased no GPU, so it saw none*gpus=1*"]
    )
    for record in gpuiso.records().values():
        assert record["cuda_without_gpu"] == ["libcuda.so.1"]


def test_each_test_finds_the_gpu_whole_after_a_hog(gpuiso: GpuIso, sim: Path, monkeypatch) -> None:
    """One GPU; a test takes all but 1 GiB of it and ends holding it: the next test, in a
    fresh process, finds all of it free but its own context (as tests/gpu's hog test)."""
    monkeypatch.setenv("GPUISO_SIM_GPUS", "Sim H100,81559")
    _copy(gpuiso, MOD, "sim_process.py")
    result = gpuiso.run(REPORT, "-p", "no:randomly", MOD, "-k", "hog or whole_again")
    result.assert_outcomes(passed=2)


def test_a_pinned_worker_s_in_process_test_sees_its_gpu(gpuiso_spawn: GpuIso, sim: Path) -> None:
    """Not isolated: under --gpu-isolate-pin-workers the test runs in the xdist worker,
    which pinned one NVML-found GPU, and CUDA shows the test that one."""
    _copy(gpuiso_spawn, "sim_every.py")
    args = ("--gpu-isolate-pin-workers", "-n", "1", "sim_every.py", "-k", "test_unmarked")
    result = gpuiso_spawn.run(*args)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*pinned workers (--gpu-isolate-pin-workers): each of the 1*"])


def _main_thread_calls(libs: Path) -> int:
    """The NVML device calls processes made on their main threads (the simulator's count)."""
    code = (
        "import ctypes; n = ctypes.CDLL('libnvidia-ml.so.1'); "
        "n.gpusimMainThreadCalls.restype = ctypes.c_longlong; print(n.gpusimMainThreadCalls())"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


# NVML device calls pytest's main thread makes for each isolated CUDA test (6 on
# 2026-11-28: the GPU memory leak check's reads around it); ~0.02 ms each on an H200. A
# sampler thread's reads (the test's memory peak) depend on time and are not counted.
NVML_CALLS_A_TEST = 6


def test_nvml_work_a_test_costs_is_bounded_and_the_driver_start_is_the_tests(
    gpuiso: GpuIso, sim: Path, gpusim_libs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The simulated driver takes what an H200's takes in a fresh process (cuInit 109 ms,
    a context 143 ms, NVML 0.02 ms a call): that time is each test's own duration, and
    pytest's main thread makes the same few NVML calls for every test, whatever they
    take (each further test adds exactly the same number, at most NVML_CALLS_A_TEST)."""
    _copy(gpuiso, "sim_cost.py")
    monkeypatch.setenv("GPUISO_SIM_CUINIT_MS", "109")
    monkeypatch.setenv("GPUISO_SIM_CONTEXT_MS", "143")
    monkeypatch.setenv("GPUISO_SIM_NVML_MS", "0.02")
    counts = []
    for tests in (1, 4):
        monkeypatch.setenv("GPUISO_SIM_TESTS", str(tests))
        before = _main_thread_calls(gpusim_libs)
        result = gpuiso.run("--gpu-isolate", REPORT, "sim_cost.py")
        result.assert_outcomes(passed=tests)
        counts.append(_main_thread_calls(gpusim_libs) - before)
        records = gpuiso.records().values()
        assert all(len(r["gpus"]) == 1 and r["leaks"] == [] for r in records), records
        # the modelled start (0.252 s) is in each test's own time
        assert all(r["duration"] >= 0.25 for r in records), records
        result.stdout.fnmatch_lines([f"gpu-isolate: isolation cost * over {tests} test*"])
    more = counts[1] - counts[0]
    assert more % 3 == 0 and 0 < more // 3 <= NVML_CALLS_A_TEST, counts  # the same each


def test_ranks_each_on_a_gpu_or_sharing_one_by_memory_slices(
    gpuiso_spawn: GpuIso, sim: Path
) -> None:
    """Two ranks of whole GPUs: one GPU each, distinct. Two ranks of 30 GiB, where only
    GPU 0 holds 30 GiB: both on GPU 0, each with its 30 GiB slice (the group leased 60).
    Three of 30 GiB fit neither way: skipped saying so."""
    _copy(gpuiso_spawn, "sim_ranks.py")
    result = gpuiso_spawn.run(REPORT, "-rs", "sim_ranks.py")
    result.assert_outcomes(passed=2, skipped=1)
    result.stdout.fnmatch_lines(
        ["*test needs 3 GPUs, 2 (0, 1) available; its 3 ranks' gpu_memory=30GiB together fit no*"]
    )
    records = gpuiso_spawn.records()
    shared = records["sim_ranks.py::test_two_ranks_share_the_big_gpu_by_slices"]
    assert (shared["gpus"], shared["gpu_memory"]) == (["0"], 60 << 30), shared
