"""GPU health on the simulated GPU: a GPU a test broke is probed, quarantined for every
session of the user, the tests move to the healthy GPUs, and ``reset --device`` lifts it
once it passes its probe again (fixtures/programs/gpusim/sim_health.py). What is probed and when
is pytest's process's work: one start method is enough."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPORT, GpuIso, program
from tests.helpers import command as _cli
from tests.helpers.lease_table import wait_until

pytestmark = [pytest.mark.installation, pytest.mark.versions]

MOD = "sim_health.py"
XID_79 = "Xid 79 (GPU has fallen off the bus): reboot the machine"
XID_79_ENTRY = {
    "device": "0",
    "xid": 79,
    "name": "GPU has fallen off the bus",
    "class": "reboot",
    "action": "reboot the machine",
    "fails_test": False,
}


def _run(gpuiso: GpuIso, *args: str) -> pytest.RunResult:
    (gpuiso.path / MOD).write_text((program(MOD)).read_text())
    return gpuiso.run(REPORT, "-p", "no:randomly", *args)


def _gpus(log: Path) -> dict[str, set[str]]:
    """Which GPUs each test of sim_health.py ran on, from its log."""
    found: dict[str, set[str]] = {}
    for line in log.read_text().splitlines():
        name, gpu = line.split()
        found.setdefault(name, set()).add(gpu)
    return found


def _repair(gpu: str) -> None:
    code = "import ctypes, sys; sys.exit(ctypes.CDLL('libcuda.so.1').gpusimBreakGpu(%s, 0))"
    subprocess.run([sys.executable, "-c", code % gpu], check=True, timeout=60)


def test_a_broken_gpu_is_quarantined_for_every_session_until_it_passes_again(
    gpuiso_spawn: GpuIso,
    sim: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpuiso = gpuiso_spawn
    log = gpuiso.path / "gpus.log"
    monkeypatch.setenv("GPUISO_HEALTH_LOG", str(log))
    tests = [f"{MOD}::{name}" for name in ("test_ordinary_failure", "test_breaks_its_gpu")]
    result = _run(gpuiso, *tests, f"{MOD}::test_after", "--gpu-isolate-summary=summary.md")
    result.assert_outcomes(passed=3, failed=2)
    [broken] = _gpus(log)["breaks"]
    records = gpuiso.records()
    assert "gpu_health" not in records[tests[0]]  # an assertion puts no GPU in doubt
    checked = records[tests[1]]["gpu_health"]
    assert checked["probed"].startswith("a sticky CUDA error (illegal memory access")
    assert checked["devices"] == [broken]
    failed = "the CUDA driver probe failed: cuCtxSynchronize: CUDA error 700"
    assert checked["quarantined"] == {broken: failed}
    result.stdout.fnmatch_lines([f"*QUARANTINED GPU {broken} after {tests[1]}: {failed}"])
    assert "### GPU health" in (gpuiso.path / "summary.md").read_text()
    healthy = {"0", "1"} - {broken}
    assert all(_gpus(log)[f"after-{n}"] == healthy for n in range(3))

    log.unlink()  # another session of the user avoids it too
    _run(gpuiso, f"{MOD}::test_after").assert_outcomes(passed=3)
    assert all(_gpus(log)[f"after-{n}"] == healthy for n in range(3))

    status = _cli("status")
    assert status.returncode == 0, status.stderr
    [row] = [line for line in status.stdout.splitlines() if "QUARANTINED" in line]
    assert row.split()[0] == broken and tests[1] in row
    still = _cli("reset", "--device", broken)
    assert still.returncode == 1
    assert f"GPU {broken} still fails its probe: {failed}; left quarantined" in still.stderr
    _repair(broken)
    lifted = _cli("reset", "--device", broken)
    assert lifted.returncode == 0, lifted.stderr
    # the table keys the GPU by its UUID (one row whatever a session calls it)
    uuid = f"GPU-{int(broken) + 1:08x}-0000-4000-8000-000000000000"
    assert f"GPU {broken} ({uuid}): quarantine lifted (it passed its probe" in lifted.stdout
    assert "QUARANTINED" not in _cli("status").stdout


def test_an_xid_quarantines_and_a_test_left_without_a_healthy_gpu_says_how_to_lift_it(
    gpuiso_spawn: GpuIso,
    sim: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpuiso = gpuiso_spawn
    monkeypatch.setenv("GPUISO_HEALTH_LOG", str(gpuiso.path / "gpus.log"))
    monkeypatch.setenv("GPUISO_SIM_GPUS", "Sim H100,81559")
    crash, after = f"{MOD}::test_xid_then_crash", f"{MOD}::test_after[0]"
    result = _run(gpuiso, crash, after, "--gpu-isolate-lease-timeout=1")
    result.assert_outcomes(failed=1, errors=1)
    checked = gpuiso.records()[crash]["gpu_health"]
    assert checked == {
        "probed": "it crashed with SIGABRT",
        "devices": ["0"],
        "quarantined": {"0": XID_79},
        "xids": [XID_79_ENTRY],
    }
    result.stdout.fnmatch_lines(
        [
            "*ERROR at setup of test_after[[]0[]]*",
            "*quarantined: GPU 0 (after *test_xid_then_crash (it crashed with SIGABRT): "
            f"{XID_79}); `python -m pytest_gpuiso reset --device 0` re-probes and lifts it*",
        ]
    )
    # The Xid is past: the next session's re-probe finds the GPU healthy and lifts it.
    result = _run(gpuiso, after, "--gpu-isolate-lease-timeout=5", "--gpu-isolate-reprobe=0.01")
    result.assert_outcomes(passed=1)
    assert "QUARANTINED" not in _cli("status").stdout


@pytest.mark.parametrize("workers", [[], ["-n", "1"]], ids=["pinned-pytest", "pinned-worker"])
def test_an_xid_during_a_pinned_workers_test_is_seen(
    gpuiso_spawn: GpuIso, sim: Path, monkeypatch: pytest.MonkeyPatch, workers: list[str]
) -> None:
    """A pinned process's tests take their GPUs from its pin, not from the lease table, and
    are watched as every lease is: an Xid during one is seen by the probe after it, and
    the GPU is quarantined (as without pinning)."""
    gpuiso = gpuiso_spawn
    monkeypatch.setenv("GPUISO_HEALTH_LOG", str(gpuiso.path / "gpus.log"))
    monkeypatch.setenv("GPUISO_SIM_GPUS", "Sim H100,81559")
    crash = f"{MOD}::test_xid_then_crash"
    result = _run(gpuiso, crash, "--gpu-isolate-pin-workers", *workers)
    result.assert_outcomes(failed=1)
    checked = gpuiso.records()[crash]["gpu_health"]
    assert checked == {
        "probed": "it crashed with SIGABRT",
        "devices": ["0"],
        "quarantined": {"0": XID_79},
        "xids": [XID_79_ENTRY],
    }


def test_always_keeps_every_test_off_a_gpu_nvml_has_lost(
    gpuiso_spawn: GpuIso, sim: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--gpu-isolate-health=always``: GPU 0 has fallen off the bus before the session; the
    lease that gets it (both declared the same size: the first is taken first) finds so
    through NVML, quarantines it and takes GPU 1 instead."""
    log = gpuiso_spawn.path / "gpus.log"
    monkeypatch.setenv("GPUISO_HEALTH_LOG", str(log))
    monkeypatch.setenv("GPUISO_SIM_LOST", "0")
    options = ("--gpu-isolate-health=always", "--gpu-isolate-devices=0:80GiB,1:80GiB")
    _run(gpuiso_spawn, f"{MOD}::test_after", *options).assert_outcomes(passed=3)
    assert all(_gpus(log)[f"after-{n}"] == {"1"} for n in range(3))
    [row] = [line for line in _cli("status").stdout.splitlines() if "QUARANTINED" in line]
    assert row.split()[0] == "0" and "it does not answer NVML" in row
    # found by whichever lease first took GPU 0 (the table's order of equal GPUs)
    assert f"between tests (found at the lease of {MOD}::test_after[" in row


@pytest.mark.plugins("rerunfailures")
def test_a_rerun_after_the_test_broke_its_gpu_leases_a_healthy_one(
    gpuiso_spawn: GpuIso, sim: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The recipe of docs/gpu-leases.md: ``--reruns 1 --only-rerun "CUDA error"``."""
    pytest.importorskip("pytest_rerunfailures")
    log = gpuiso_spawn.path / "gpus.log"
    monkeypatch.setenv("GPUISO_HEALTH_LOG", str(log))
    test = f"{MOD}::test_breaks_its_gpu_once"
    result = _run(gpuiso_spawn, test, "--reruns", "1", "--only-rerun", "CUDA error")
    outcomes = result.parseoutcomes()
    assert (outcomes.get("passed"), outcomes.get("rerun"), outcomes.get("failed")) == (1, 1, None)
    first, second = (line.split()[1] for line in log.read_text().splitlines())
    assert first != second
    assert set(_cli("status").stdout.split()) >= {"QUARANTINED", first}


# ----------------------------------------------------------------------------- units


def _outcome(signal=None, timed_out=False, reports=(), errors=()):
    """How a run ended, as ``why_probe`` reads it."""
    from pytest_gpuiso.gpu.health import RunEnd

    return RunEnd(timed_out, signal, list(errors), list(reports), {})


def _failed(message: str, source: str = "") -> dict:
    """A failed report's data as pytest serializes it: the crash's message, and a traceback
    whose source lines say ``source``."""
    entry = {"data": {"lines": [source, f"E   {message}"]}}
    return {
        "outcome": "failed",
        "longrepr": {"reprcrash": {"message": message}, "reprtraceback": {"entries": [entry]}},
    }


@pytest.mark.parametrize(
    ("outcome", "why"),
    [
        (_outcome(signal="SIGSEGV"), "it crashed with SIGSEGV"),
        (_outcome(signal="SIGKILL", timed_out=True), "it timed out"),
        (
            _outcome(reports=[_failed("RuntimeError: CUDA error: unspecified launch failure")]),
            "a sticky CUDA error (unspecified launch failure)",
        ),
        (
            _outcome(errors=["cuCtxSynchronize: CUDA_ERROR_ILLEGAL_ADDRESS"]),
            "a sticky CUDA error (CUDA_ERROR_ILLEGAL_ADDRESS)",
        ),
        (_outcome(reports=[_failed("assert 2 == 3", "check(xid=79)  # after an Xid")]), None),
        (_outcome(reports=[{"outcome": "passed", "sections": [["out", "ECC errors: 0"]]}]), None),
        (_outcome(reports=[_failed("RuntimeError: CUDA error: out of memory")]), None),
        (_outcome(reports=[{"outcome": "failed", "longrepr": "  \n "}]), None),
    ],
)
def test_only_a_timeout_a_crash_or_a_sticky_cuda_error_puts_a_gpu_in_doubt(outcome, why) -> None:
    from pytest_gpuiso.gpu.health import why_probe

    assert why_probe(outcome) == why


def test_a_quarantines_reason_names_the_test_first_and_fits_the_table() -> None:
    from pytest_gpuiso.gpu.health import quarantine_reason
    from pytest_gpuiso.gpu.leases import LABEL_LEN

    short = quarantine_reason("Xid 79", "t.py::test_a", "it crashed with SIGABRT")
    assert short == "after t.py::test_a (it crashed with SIGABRT): Xid 79"
    nodeid = "tests/test_kernels.py::test_matmul[" + "é" * 150 + "]"
    long = quarantine_reason("the CUDA driver probe failed: " + "x" * 300, nodeid, "it timed out")
    assert len(long.encode()) <= LABEL_LEN and long.startswith("after ...")
    assert "é]" in long and " (it timed out): the CUDA driver probe failed: x" in long


def test_only_a_problem_the_driver_probe_found_is_judged_by_it() -> None:
    """A quarantine's reason says which part decided it, whatever the test's name holds."""
    from pytest_gpuiso.gpu.health import between_reason, judged_by_driver, quarantine_reason

    driver = "the CUDA driver probe failed: cuCtxSynchronize: CUDA error 700"
    sticky = "a sticky CUDA error (illegal memory access)"
    assert judged_by_driver(quarantine_reason(driver, "t.py::test_k", sticky))
    hung = "the CUDA driver probe did not finish within 20 s"
    assert judged_by_driver(quarantine_reason(hung, "t.py::test_k", "it timed out"))
    assert not judged_by_driver(quarantine_reason("Xid 48 (double-bit ECC error)", "t", "x"))
    assert not judged_by_driver(between_reason("Xid 79 (GPU has fallen off the bus)", "t"))
    forged = "t.py::test[it timed out): the CUDA driver probe failed: ]"
    reason = quarantine_reason("Xid 79 (GPU has fallen off the bus)", forged, "it timed out")
    assert not judged_by_driver(reason) and "[it timed out) : the CUDA driver" in reason


class _Nvml:
    """NVML's health answers, scripted per device; ``lost_first``: the first device asked
    about has fallen off the bus; ``loaded``: whether NVML could be loaded at all."""

    def __init__(
        self, problems: dict[str, list[str]] | None = None, lost_first=False, loaded=True
    ) -> None:
        self.problems_of, self.lost_first, self.watched = dict(problems or {}), lost_first, []
        self.loaded = loaded
        self.error = None if loaded else "NVML: libnvidia-ml.so.1 not found"
        self.pending: dict[str, list[int]] = {}  # device -> Xids its event set holds

    def available(self) -> bool:
        return self.loaded

    def track_errors(self, device: str) -> list[int]:
        self.watched.append(device)
        return self.xids(device)

    def xids(self, device: str) -> list[int]:
        return self.pending.pop(device, [])

    def problems(self, device: str) -> list[str]:
        if self.lost_first:
            self.lost_first = False
            self.problems_of[device] = ["it does not answer NVML (NVML: GPU is lost)"]
        return list(self.problems_of.get(device, []))


def _leases(lease_region: Path):
    from pytest_gpuiso.gpu.devices import Devices
    from pytest_gpuiso.gpu.leases import Leases

    return Leases(Devices(("0", "1"), "test"), 1, path=str(lease_region))


def test_always_quarantines_a_gpu_that_fails_nvml_and_leases_another(lease_region: Path) -> None:
    from pytest_gpuiso.gpu.health import Health

    leases = _leases(lease_region)
    nvml = _Nvml(lost_first=True)
    lease = Health(leases, nvml, "always").lease(1, "t::a", 5.0, None)
    [lost] = nvml.problems_of
    assert lease.devices != (lost,) and nvml.watched == [lost, *lease.devices]
    quarantined = leases.quarantined()
    assert set(quarantined) == {lost}
    assert quarantined[lost]["why"] == (
        "between tests (found at the lease of t::a): it does not answer NVML (NVML: GPU is lost)"
    )
    leases.release(lease)


def test_a_quarantined_gpu_is_leased_by_no_one_until_lifted(lease_region: Path) -> None:
    from pytest_gpuiso.gpu.leases import LeaseTimeout

    leases = _leases(lease_region)
    lease = leases.acquire(1, "t::a", 5.0)
    leases.release(lease)
    leases.quarantine("0", "after t::a (it crashed with SIGABRT): Xid 79")
    leases.quarantine("1", "after t::b (it timed out): Xid 48")
    with pytest.raises(LeaseTimeout, match=r"quarantined: GPU 0 \(after t::a .*GPU 1 \(after t::b"):
        leases.acquire(1, "t::c", 0.2)
    assert leases.lift("1") is True and leases.lift("1") is False
    assert leases.acquire(1, "t::c", 5.0).devices == ("1",)
    with pytest.raises(KeyError, match="no device 7"):
        leases.lift("7")


def test_reprobe_lifts_a_quarantined_gpu_that_passes_again(
    lease_region: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pytest_gpuiso.gpu import health

    leases = _leases(lease_region)
    leases.release(leases.acquire(2, "t::a", 5.0))
    leases.quarantine("0", "Xid 79")
    leases.quarantine("1", "the CUDA driver probe failed: cuCtxSynchronize: CUDA error 700")
    probed = []

    def driver_check(env: dict[str, str]) -> tuple[str | None, str | None]:
        probed.append(env["CUDA_VISIBLE_DEVICES"])
        return ("still broken" if env["CUDA_VISIBLE_DEVICES"] == "1" else None), None

    monkeypatch.setattr(health, "driver_check", driver_check)
    checks = health.Health(leases, _Nvml(), "after-failure", 0.001)
    time.sleep(0.01)  # both quarantines are older than the re-probe interval
    lease = checks.lease(1, "t::b", 5.0, None)
    assert sorted(probed) == ["0", "1"] and lease.devices == ("0",)
    assert set(leases.quarantined()) == {"1"}


def test_reprobe_without_nvml_lifts_only_what_the_driver_probe_decided(
    lease_region: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No NVML (the CUDA driver only), both GPUs pass the driver probe: GPU 1, quarantined
    by the driver probe, is lifted; GPU 0, quarantined for an Xid (NVML's to judge), stays."""
    from pytest_gpuiso.gpu import health

    leases = _leases(lease_region)
    leases.release(leases.acquire(2, "t::a", 5.0))
    leases.quarantine("0", health.quarantine_reason("Xid 79 (fallen off)", "t::a", "x"))
    driver = "the CUDA driver probe failed: cuCtxSynchronize: CUDA error 700"
    leases.quarantine("1", health.quarantine_reason(driver, "t::a", "it timed out"))
    monkeypatch.setattr(health, "driver_check", lambda env: (None, None))
    checks = health.Health(leases, _Nvml(loaded=False), "after-failure", 0.001)
    time.sleep(0.01)  # both quarantines are older than the re-probe interval
    lease = checks.lease(1, "t::b", 5.0, None)
    assert lease.devices == ("1",) and set(leases.quarantined()) == {"0"}


def test_an_xid_from_before_a_gpus_quarantine_is_the_quarantines(lease_region: Path) -> None:
    """Another session's test raised an Xid 48 on GPU 0 and quarantined it; this session's
    event set holds the Xid too. Once GPU 0 is lifted (reset, repaired), the session's
    next lease of it is not quarantined again by that Xid: it was the quarantine's."""
    from pytest_gpuiso.gpu.health import Health

    leases = _leases(lease_region)
    leases.release(leases.acquire(2, "t::a", 5.0))
    nvml = _Nvml()
    checks = Health(leases, nvml, "after-failure")
    nvml.pending["0"] = [48]
    leases.quarantine("0", "after t::x (an Xid during it): Xid 48 (double-bit ECC error)")
    lease = checks.lease(1, "t::b", 5.0, None)
    assert lease.devices == ("1",)
    leases.release(lease)
    assert leases.lift("0") is True
    lease = checks.lease(2, "t::c", 5.0, None)
    assert sorted(lease.devices) == ["0", "1"] and leases.quarantined() == {}


def test_an_xid_between_tests_quarantines_at_the_lease_unless_a_pinned_worker_holds_it(
    lease_region: Path,
) -> None:
    """Xids the session reads at a lease (none of its tests held the GPU): a 79 quarantines
    GPU 0 "between tests" and the lease is taken on GPU 1; the application Xid beside it
    is no test's and is let be. A pinned worker's test cannot move: it fails, its worker's
    lease kept."""
    from pytest_gpuiso.gpu.health import Health
    from pytest_gpuiso.gpu.leases import LeaseError

    leases = _leases(lease_region)
    nvml = _Nvml()
    checks = Health(leases, nvml, "after-failure")
    nvml.pending = {"0": [13, 79]}
    lease = checks.lease(1, "t::a", 5.0, None)  # GPU 0 first (the table's order), then 1
    assert lease.devices == ("1",)
    assert leases.quarantined()["0"]["why"] == (
        "between tests (found at the lease of t::a): Xid 79 (GPU has fallen off the bus): "
        "reboot the machine"
    )
    nvml.pending = {"1": [48]}
    with pytest.raises(LeaseError, match=r"^its pinned worker's GPUs are in doubt \(GPU 1: Xid 48"):
        checks.lease(1, "t::b", None, None, pinned=lease)
    assert [h["lease"] for h in leases.region.snapshot()["holders"]] == [lease.lease_id]


def test_a_request_quarantine_left_unservable_holds_no_one_back(lease_region: Path) -> None:
    """GPU 0 quarantined, a 2-GPU request waiting (it can only be served after a lift): a
    1-GPU request behind it gets the healthy GPU 1 at once."""
    leases = _leases(lease_region)
    leases.release(leases.acquire(2, "t::init", 5.0))
    leases.quarantine("0", "after t::init (it timed out): Xid 79")
    code = (
        "import sys; from pytest_gpuiso.gpu.leases import Leases; "
        "from pytest_gpuiso.gpu.devices import Devices; "
        f"leases = Leases(Devices(('0', '1'), 'test'), 1, path={str(lease_region)!r}); "
        "print('waiting', flush=True); leases.acquire(2, 't::two', 30.0)"
    )
    waiter = subprocess.Popen(  # not from the checkout's folder: the installed plugin
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd="/"
    )
    try:
        assert waiter.stdout.readline().strip() == "waiting"
        wait_until(lambda: leases.region.snapshot()["waiters"], "the 2-GPU request", timeout=30)
        assert leases.acquire(1, "t::one", 10.0).devices == ("1",)
    finally:
        waiter.kill()
        waiter.wait()


def test_without_a_lease_timeout_a_test_quarantines_leave_short_fails_at_once(
    lease_region: Path,
) -> None:
    from pytest_gpuiso.gpu.health import Health
    from pytest_gpuiso.gpu.leases import LeaseError

    leases = _leases(lease_region)
    leases.release(leases.acquire(2, "t::init", 5.0))
    leases.quarantine("1", "after t::init (it timed out): Xid 79")
    with pytest.raises(LeaseError, match=r"^2 GPUs wanted, 1 of 2 healthy; quarantined: GPU 1"):
        Health(leases, _Nvml(), "after-failure").lease(2, "t::two", None, None)


class _FakePynvml:
    """The nvidia-ml-py calls of the NVML part, over one scripted GPU."""

    class Timeout(Exception):
        pass

    def __init__(self) -> None:
        self.events: list[int] = []  # Xids waiting in the event set
        self.ecc, self.remapped, self.lost = 0, (0, 0, 0, 0), False

    def nvmlDeviceGetHandleByIndex(self, index):
        return f"gpu{index}"

    def nvmlDeviceGetMemoryInfo(self, handle):
        if self.lost:
            raise RuntimeError("GPU is lost")

    def nvmlEventSetCreate(self):
        return "set"

    def nvmlDeviceRegisterEvents(self, handle, types, events):
        assert types == 0x8  # Xid critical errors

    def nvmlEventSetWait_v2(self, events, timeout_ms):
        if not self.events:
            raise self.Timeout
        return type("Event", (), {"eventData": self.events.pop(0)})()

    def nvmlDeviceGetTotalEccErrors(self, handle, kind, counter):
        return self.ecc

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle):
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")  # Ampere and later: remapped rows

    def nvmlDeviceGetRemappedRows(self, handle):
        return self.remapped


def test_the_nvml_part_counts_what_came_since_the_lease() -> None:
    from pytest_gpuiso.gpu.nvml import NvmlReader

    fake = _FakePynvml()
    reader = NvmlReader()
    reader._nvml = fake  # as if nvmlInit had found a driver
    fake.events, fake.ecc = [48], 3  # before the lease: not this run's, judged apart
    assert reader.track_errors("0") == [48]
    assert reader.problems("0") == []
    fake.events = [45, 79, 13]  # read apart, and judged by the catalog (gpu/xids.py)
    assert reader.xids("0") == [45, 79, 13] and reader.xids("0") == []
    fake.ecc, fake.remapped = 5, (0, 1, 1, 0)
    assert reader.problems("0") == [
        "memory rows are waiting to be remapped (a reset remaps them)",
        "2 uncorrectable ECC errors",
    ]
    fake.lost = True
    assert reader.problems("0") == ["it does not answer NVML (NVML: GPU is lost)"]


def test_a_gpu_full_of_someone_elses_memory_is_full_not_broken(
    sim: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver part of the probe on a GPU with no room for its context (the simulator's
    CUDA_ERROR_OUT_OF_MEMORY): healthy, not quarantined; a failing synchronise still fails."""
    from pytest_gpuiso.gpu.health import driver_probe

    monkeypatch.setenv("GPUISO_SIM_GPUS", "Sim Full,200")  # under the 300 MiB of a context
    assert driver_probe({"CUDA_VISIBLE_DEVICES": "0"}) is None
    monkeypatch.setenv("GPUISO_SIM_GPUS", "Sim Roomy,1000")
    monkeypatch.setenv("GPUISO_SIM_STATE", str(sim.parent / "roomy"))
    monkeypatch.setenv("GPUISO_SIM_SYNC_ERROR", "700")
    broken = driver_probe({"CUDA_VISIBLE_DEVICES": "0"})
    assert broken == "the CUDA driver probe failed: cuCtxSynchronize: CUDA error 700"
