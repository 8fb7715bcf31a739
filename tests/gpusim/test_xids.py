"""Xids on the simulated GPU, judged by NVIDIA's Xid catalog after every test that held a
GPU (fixtures/programs/gpusim/sim_health.py injects them): an application's fails the
test alone, a corrected error is noted, one that needs a reset quarantines the GPU with
the catalog's action said everywhere; a GPU that could not be probed is said to be so."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPORT, GpuIso, program
from tests.helpers import command as _cli

pytestmark = [pytest.mark.installation, pytest.mark.versions]

MOD = "sim_health.py"
RESET = "reset the GPU (nvidia-smi -r as root, with no process on it)"
H100 = "GPU-00000001-0000-4000-8000-000000000000"
DRIVER_FAILED = "the CUDA driver probe failed: cuCtxSynchronize: CUDA error 700"


def _run(gpuiso: GpuIso, *tests: str, options: tuple[str, ...] = ()) -> pytest.RunResult:
    (gpuiso.path / MOD).write_text(program(MOD).read_text())
    names = [f"{MOD}::{name}" for name in tests]
    summary = "--gpu-isolate-summary=summary.md"
    return gpuiso.run(REPORT, "-p", "no:randomly", summary, *options, *names)


def _quarantined() -> list[str]:
    """The QUARANTINED rows of ``python -m pytest_gpuiso status``."""
    status = _cli("status")
    assert status.returncode == 0, status.stderr
    return [line for line in status.stdout.splitlines() if "QUARANTINED" in line]


def _only(library: str, gpusim_libs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Of the simulator's NVML and CUDA driver, only ``library`` can be loaded."""
    only = tmp_path / "only"
    only.mkdir()
    (only / library).symlink_to(gpusim_libs / library)
    monkeypatch.setenv("LD_LIBRARY_PATH", str(only))


@pytest.fixture
def gpuiso(gpuiso_spawn: GpuIso, sim: Path, monkeypatch: pytest.MonkeyPatch) -> GpuIso:
    """Sessions over one simulated GPU (GPU 0)."""
    monkeypatch.setenv("GPUISO_HEALTH_LOG", str(gpuiso_spawn.path / "gpus.log"))
    monkeypatch.setenv("GPUISO_SIM_GPUS", "Sim H100,81559")
    return gpuiso_spawn


def test_an_application_xid_fails_its_test_and_leaves_the_gpu_in_service(gpuiso: GpuIso) -> None:
    tests = ("test_application_xid", "test_application_xid_and_failure", "test_ignored_xid")
    result = _run(gpuiso, *tests)
    result.assert_outcomes(passed=1, failed=2)
    said = "Xid {} ({}) on GPU 0 during the test: NVIDIA's Xid catalog says restart the application"
    result.stdout.fnmatch_lines(
        [
            "*gpu-isolate: " + said.format(13, "graphics engine exception") + "*",
            "*RuntimeError: CUDA error: an illegal memory access*",  # its own failure stays
            "*gpu-isolate Xids*",
            said.format(31, "GPU memory page fault") + "*",
        ]
    )
    records = gpuiso.records()
    passed = records[f"{MOD}::test_application_xid"]
    assert passed["outcome"] == "failed"
    assert passed["gpu_health"] == {
        "devices": ["0"],
        "quarantined": {},
        "xids": [
            {
                "device": "0",
                "xid": 13,
                "name": "graphics engine exception",
                "class": "application",
                "action": "restart the application: the test's code or kernel is at fault, "
                "not the GPU",
                "fails_test": True,
            }
        ],
    }
    own = records[f"{MOD}::test_application_xid_and_failure"]["gpu_health"]
    assert own["quarantined"] == {} and own["probed"].startswith("a sticky CUDA error")
    [ignored] = records[f"{MOD}::test_ignored_xid"]["gpu_health"]["xids"]
    assert (ignored["xid"], ignored["class"], ignored["fails_test"]) == (92, "ignore", False)
    assert "QUARANTINED" not in result.stdout.str()
    assert _quarantined() == []


def test_an_application_xid_on_a_shared_gpu_is_only_noted(gpuiso: GpuIso) -> None:
    """Two slots on the GPU: the Xid may be the other test's, so it fails neither."""
    result = _run(gpuiso, "test_application_xid", options=("--gpu-isolate-slots=2",))
    result.assert_outcomes(passed=1)
    [xid] = gpuiso.records()[f"{MOD}::test_application_xid"]["gpu_health"]["xids"]
    assert (xid["xid"], xid["class"], xid["fails_test"]) == (13, "application", False)
    assert _quarantined() == []


def test_an_xid_that_needs_a_reset_quarantines_the_gpu_saying_so(gpuiso: GpuIso) -> None:
    result = _run(gpuiso, "test_reset_xid")
    result.assert_outcomes(passed=1)  # the test did nothing wrong: its GPU did
    test = f"{MOD}::test_reset_xid"
    failed = f"Xid 48 (double-bit ECC error): {RESET}"
    checked = gpuiso.records()[test]["gpu_health"]
    assert checked["probed"] == "an Xid during it"
    assert checked["quarantined"] == {"0": failed}
    assert [(x["xid"], x["class"], x["action"]) for x in checked["xids"]] == [(48, "reset", RESET)]
    result.stdout.fnmatch_lines([f"*QUARANTINED GPU 0 after {test}: {failed}"])
    summary = (gpuiso.path / "summary.md").read_text()
    assert "### GPU health" in summary and failed in summary
    [row] = _quarantined()
    assert row.split()[0] == "0" and "Xid 48 (double-bit ECC error)" in row


@pytest.mark.parametrize(
    ("kept", "said"),
    [
        ("libnvidia-ml.so.1", "the CUDA driver cannot be loaded: libcuda.so.1"),
        ("libcuda.so.1", "NVML: "),
    ],
    ids=["no-cuda-driver", "no-nvml"],
)
def test_a_gpu_the_probe_cannot_run_on_could_not_be_assessed(
    gpuiso: GpuIso,
    gpusim_libs: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    kept: str,
    said: str,
) -> None:
    """Only one of NVML and the CUDA driver: the GPU a crashed test held is neither
    healthy nor quarantined, and every report says it could not be assessed and why."""
    _only(kept, gpusim_libs, tmp_path, monkeypatch)
    result = _run(gpuiso, "test_crash", options=("--gpu-isolate-devices=0:80GiB",))
    result.assert_outcomes(failed=1)
    test = f"{MOD}::test_crash"
    checked = gpuiso.records()[test]["gpu_health"]
    assert checked["probed"] == "it crashed with SIGABRT" and checked["quarantined"] == {}
    assert list(checked["unassessed"]) == ["0"]
    assert checked["unassessed"]["0"].startswith(said)
    result.stdout.fnmatch_lines([f"gpu-isolate: GPU 0 could not be assessed after {test} (*"])
    summary = (gpuiso.path / "summary.md").read_text()
    assert "Could not be assessed" in summary and said in summary
    assert _quarantined() == []


def test_reset_does_not_lift_a_quarantine_on_a_probe_that_could_not_run(
    sim: Path,
    lease_region: Path,
    gpusim_libs: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pytest_gpuiso.gpu.devices import Devices
    from pytest_gpuiso.gpu.leases import Leases

    leases = Leases(Devices(("0",), "test"), 1, path=str(lease_region))
    leases.release(leases.acquire(1, "t::a", 5.0))
    leases.quarantine("0", "after t::a (an Xid during it): Xid 48 (double-bit ECC error)")
    _only("libnvidia-ml.so.1", gpusim_libs, tmp_path, monkeypatch)
    refused = _cli("reset", "--device", "0")
    assert refused.returncode == 1
    assert "GPU 0 could not be assessed (the CUDA driver cannot be loaded" in refused.stderr
    assert "left quarantined (--force lifts it anyway)" in refused.stderr
    assert set(leases.quarantined()) == {"0"}
    assert _cli("reset", "--device", "0", "--force").returncode == 0
    assert leases.quarantined() == {}


@pytest.mark.parametrize(
    ("problem", "lifted"),
    [(DRIVER_FAILED, True), (f"Xid 48 (double-bit ECC error): {RESET}", False)],
    ids=["driver-decided", "nvml-decided"],
)
def test_reset_without_nvml_lifts_only_what_the_driver_probe_decided(
    sim: Path,
    lease_region: Path,
    gpusim_libs: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    problem: str,
    lifted: bool,
) -> None:
    """The CUDA driver only (a container without NVML), GPU 0 healthy again: a quarantine
    the driver probe decided is lifted by a passing driver probe; one NVML decided (an
    Xid) cannot be assessed without NVML and stays. Before, both stayed (only --force)."""
    from pytest_gpuiso.gpu.devices import Devices
    from pytest_gpuiso.gpu.health import quarantine_reason
    from pytest_gpuiso.gpu.leases import Leases

    leases = Leases(Devices(("0",), "test"), 1, path=str(lease_region))
    leases.release(leases.acquire(1, "t::a", 5.0))
    leases.quarantine("0", quarantine_reason(problem, "t::a", "it crashed with SIGSEGV"))
    _only("libcuda.so.1", gpusim_libs, tmp_path, monkeypatch)
    done = _cli("reset", "--device", "0")
    if lifted:
        assert done.returncode == 0, done.stderr
        assert "GPU 0: quarantine lifted (it passed its probe" in done.stdout
        assert leases.quarantined() == {}
    else:
        assert done.returncode == 1
        assert "GPU 0 could not be assessed (NVML: " in done.stderr
        assert set(leases.quarantined()) == {"0"}


def test_a_gpu_the_driver_probe_quarantined_without_nvml_is_lifted_when_it_passes(
    gpuiso: GpuIso, gpusim_libs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session with the CUDA driver only names GPU 0 "0": its row is the UUID CUDA
    says; a test leaves the GPU broken, the driver probe quarantines it; ``reset --device
    0`` there refuses while the driver probe still fails and lifts it once it passes."""
    _only("libcuda.so.1", gpusim_libs, tmp_path, monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    _run(gpuiso, "test_breaks_its_gpu").assert_outcomes(failed=1)
    checked = gpuiso.records()[f"{MOD}::test_breaks_its_gpu"]["gpu_health"]
    assert checked["quarantined"] == {"0": DRIVER_FAILED}
    [row] = _quarantined()
    assert row.split()[0] == H100
    still = _cli("reset", "--device", "0")
    assert still.returncode == 1
    assert f"GPU 0 still fails its probe: {DRIVER_FAILED}; left quarantined" in still.stderr
    repair = "import ctypes, sys; sys.exit(ctypes.CDLL('libcuda.so.1').gpusimBreakGpu(0, 0))"
    subprocess.run([sys.executable, "-c", repair], check=True, timeout=60)
    lifted = _cli("reset", "--device", "0")
    assert lifted.returncode == 0, lifted.stderr
    assert f"GPU 0 ({H100}): quarantine lifted (it passed its probe" in lifted.stdout
    assert _quarantined() == []


def test_an_application_xid_beside_a_process_not_the_tests_is_only_noted(
    gpuiso: GpuIso, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another job (started here, outside the session) computes on the test's GPU when an
    application Xid comes: NVML's events carry no pid, and NVML showed a process on the
    GPU that is not the test's, so the Xid is not put on the test: noted with that pid,
    the test passes. Before, the test failed of it (only the session's own settings, slots
    or memory leases, made a GPU shared)."""
    folder = gpuiso.path / "holder"
    folder.mkdir()
    monkeypatch.setenv("GPUISO_HOLDER_DIR", str(folder))
    monkeypatch.setenv("GPUISO_HOLDER_THEN_XID", "31")
    for name in ("sim_leaks.py", "sim_process.py"):
        (gpuiso.path / name).write_text(program(name).read_text())
    holder = subprocess.Popen(
        [sys.executable, str(program("sim_holder.py")), str(folder), "120"],
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        result = gpuiso.run(REPORT, "-rA", "sim_leaks.py::test_escaped_gpu_holder")
    finally:
        holder.kill()
        holder.wait(timeout=30)
    result.assert_outcomes(passed=1)
    record = gpuiso.records()["sim_leaks.py::test_escaped_gpu_holder"]
    [xid] = record["gpu_health"]["xids"]
    assert (xid["xid"], xid["class"], xid["fails_test"]) == (31, "application", False)
    assert xid["other_pids"] == [holder.pid]
    assert "during the test: NVIDIA's Xid catalog says" not in result.stdout.str()
    assert _quarantined() == []


BETWEEN = "sim_between.py"


@pytest.mark.parametrize("mode", ["after-failure", "always"])
def test_an_xid_between_tests_quarantines_its_gpu_between_tests(
    gpuiso_spawn: GpuIso, sim: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """Two GPUs; an Xid 48 (reset the GPU) on GPU 0 while no isolated test holds it (an
    in-process test between two isolated ones). The next lease reads it, quarantines GPU 0
    "between tests" (not after the test whose lease found it, nor failing that test) and
    takes GPU 1. Before, the lease drained the Xid unjudged and the test ran on GPU 0."""
    log = gpuiso_spawn.path / "gpus.log"
    monkeypatch.setenv("GPUISO_HEALTH_LOG", str(log))
    (gpuiso_spawn.path / BETWEEN).write_text(program(BETWEEN).read_text())
    tests = [f"{BETWEEN}::test_{name}" for name in ("1_isolated", "2_between_leases", "3_isolated")]
    health = f"--gpu-isolate-health={mode}"
    result = gpuiso_spawn.run(REPORT, "-p", "no:randomly", health, *tests)
    result.assert_outcomes(passed=3)
    assert log.read_text().split() == ["first", "0", "third", "1"]
    failed = f"Xid 48 (double-bit ECC error): {RESET}"
    third = gpuiso_spawn.records()[tests[2]]["gpu_health"]
    assert third == {"devices": ["1"], "quarantined": {}, "between_tests": {"0": failed}}
    [row] = _quarantined()
    assert row.split()[0] == "0"
    assert f"between tests (found at the lease of {tests[2]}): Xid 48 (double-bit ECC" in row


def test_a_run_isolated_call_has_its_gpus_judged_as_a_tests(
    gpuiso: GpuIso, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``run_isolated(gpus=1)`` from an in-process test leases its own GPU: an application
    Xid on it is the call's failure (IsolationError naming it), one that needs a reset
    quarantines the GPU after the call. Before, a call's lease was never judged."""
    (gpuiso.path / BETWEEN).write_text(program(BETWEEN).read_text())
    tests = [f"{BETWEEN}::test_call_{name}_xid" for name in ("application", "reset")]
    result = gpuiso.run("-p", "no:randomly", *tests)
    result.assert_outcomes(passed=2)
    [row] = _quarantined()
    assert row.split()[0] == "0"
    assert "after run_isolated(_own_xid) in pid " in row
    assert "(an Xid during it): Xid 48 (double-bit ECC error)" in row
