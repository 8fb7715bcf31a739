"""GPU memory leases through real pytest sessions, on declared devices (no GPU needed):
the lease reaches the test's process and torch's allocator (a stand-in torch records
it), tests pack onto a GPU while their leases fit and never beyond, and what cannot fit
anywhere is skipped naming both sizes. The table's own guarantees (FIFO, all or nothing,
dead holders) are in tests/native/test_lease_table.py."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.helpers import GpuIso
from tests.helpers.lease_table import max_overlap

GIB = 1 << 30
DEVICE = "--gpu-isolate-devices=0:8GiB"
# torch is looked for, never imported here (it cannot be imported twice in one process)
needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="torch is not installed (CI's stage 4)"
)


def test_the_lease_reaches_the_test_and_torchs_allocator(
    gpuiso: GpuIso, lease_region: Path
) -> None:
    gpuiso.copy("memory_lease")
    result = gpuiso.run(
        DEVICE,
        "--gpu-isolate-gpu-memory=50%",
        "--gpu-isolate-report=report.json",
        "-rs",
        "memory_lease",
    )
    result.assert_outcomes(passed=3, failed=1, skipped=1)
    out = result.stdout.str()
    # the header names the GPU's declared memory and how tests are packed
    assert "gpu-isolate: GPUs 0 (8 GiB) (from --gpu-isolate-devices), tests packed by memory" in out
    # going over: torch's error, and a section naming the lease
    result.stdout.fnmatch_lines(
        [
            "*OutOfMemoryError: CUDA out of memory. Tried to allocate 3.00 GiB",
            "*gpu-isolate: GPU memory lease*",
            "this test's GPU memory lease is 2 GiB on each GPU*",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "SKIPPED*gpu-isolate: test needs gpu_memory=16GiB (16 GiB) on 1 GPU, "
            "the largest is 8 GiB*"
        ]
    )
    records = gpuiso.records()
    first = records[
        "memory_lease/test_memory_lease_module.py::test_the_cap_is_set_when_cuda_starts"
    ]
    assert first["gpus"] == ["0"] and first["gpu_memory"] == 2 * GIB
    assert first["gpu_memory_peak"] is None  # no NVML here
    late = records["memory_lease/test_memory_lease_late.py::test_torch_imported_by_the_test_itself"]
    assert late["gpu_memory"] == 4 * GIB  # 50% of the declared 8 GiB


@pytest.mark.ml
@needs_torch
def test_the_real_torch_gets_the_cap_without_starting_cuda(
    gpuiso: GpuIso, lease_region: Path
) -> None:
    """With the real torch (its CPU build here), the cap is queued on torch's lazy-init
    queue whether torch came before the lease or with the test, and CPU work never
    initialises CUDA. Setting the cap on a real GPU is tests/gpu/test_gpu_memory_lease.py."""
    gpuiso.copy("memory_lease_torch")
    result = gpuiso.run("--gpu-isolate-devices=0:32GiB", "memory_lease_torch")
    result.assert_outcomes(passed=3)


def test_bytes_need_the_gpus_size(gpuiso_spawn: GpuIso, lease_region: Path) -> None:
    """Without NVML or a declared size, gpu_memory in bytes cannot be checked: the test is
    skipped saying how to declare the size."""
    gpuiso_spawn.copy("memory_lease")
    result = gpuiso_spawn.run(
        "--gpu-isolate-devices=0",
        "-rs",
        "memory_lease/test_memory_lease_module.py",
        "-k",
        "cuda_starts",
    )
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(
        [
            "*gpu_memory=2GiB on 1 GPU, but the memory of GPU 0 is unknown (no NVML): declare it "
            "with --gpu-isolate-devices=0:80GiB*"
        ]
    )


def test_two_sessions_pack_two_tests_onto_one_gpu(
    gpuiso_spawn: GpuIso, lease_region: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two 4 GiB tests in two sessions each wait for the other to hold the 8 GiB GPU too:
    with whole-GPU leases the first would time out; with memory leases both pass."""
    monkeypatch.setenv("GPUISO_LEASE_DIR", str(tmp_path))
    gpuiso_spawn.copy("memory_lease_pack")
    other = gpuiso_spawn.popen(DEVICE, "memory_lease_pack/test_pack.py::test_a")
    mine = gpuiso_spawn.run(DEVICE, "memory_lease_pack/test_pack.py::test_b")
    out, _ = other.communicate(timeout=120)
    mine.assert_outcomes(passed=1)
    assert other.returncode == 0, out.decode()
    assert (tmp_path / "a").read_text() == (tmp_path / "b").read_text() == "0"


def test_packing_never_overbooks_under_xdist(
    gpuiso_spawn: GpuIso, lease_region: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six 3 GiB tests on three workers and one 8 GiB GPU: never three at once."""
    monkeypatch.setenv("GPUISO_LEASE_DIR", str(tmp_path))
    gpuiso_spawn.copy("memory_lease_pack")
    result = gpuiso_spawn.run(DEVICE, "-n", "3", "memory_lease_pack/test_pack.py", "-k", "test_c")
    result.assert_outcomes(passed=6)
    held = [
        (*map(float, line.split()), 1)
        for line in (tmp_path / "held.log").read_text().split("\n")
        if line
    ]
    assert 1 <= max_overlap(held) <= 2, held


def test_bad_sizes_are_one_line_usage_errors(gpuiso_spawn: GpuIso, lease_region: Path) -> None:
    for args, line in (
        (("--gpu-isolate-gpu-memory=lots",), "*--gpu-isolate-gpu-memory: expected bytes*"),
        (("--gpu-isolate-gpu-memory=0%",), "*or a share of the GPU such as 25% (more than 0%*"),
        (("--gpu-isolate-devices=0:huge",), "*--gpu-isolate-devices (device 0): expected bytes*"),
        (("--gpu-isolate-devices=0:0",), "*more than 0 bytes*"),
    ):
        result = gpuiso_spawn.run(*args)
        assert result.ret == pytest.ExitCode.USAGE_ERROR, (args, result.stdout.str())
        result.stderr.fnmatch_lines([f"ERROR: gpu-isolate: invalid value{line}"])
        assert "Traceback" not in result.stderr.str()


def test_status_shows_each_holders_lease_and_the_free_memory(lease_region: Path) -> None:
    from pytest_gpuiso.gpu.devices import Devices
    from pytest_gpuiso.gpu.leases import Leases, status_table
    from pytest_gpuiso.values import parse_memory

    leases = Leases(Devices(("0",), "test", capacities=(8 * GIB,)), 1, str(lease_region))
    lease = leases.acquire(1, "tests/test_x.py::test_big", 0, parse_memory("6GiB", "t"))
    assert lease.memory == 6 * GIB
    text = status_table(leases.region.snapshot(), str(lease_region))
    lines = text.splitlines()
    assert lines[1].split()[:4] == ["DEVICE", "MEMORY", "LEASED", "FREE"]
    assert lines[2].split() == ["0", "8", "GiB", "6", "GiB", "2", "GiB"]
    assert lines[3].split()[:2] == ["6", "GiB"] and lines[3].endswith("tests/test_x.py::test_big")
    leases.release(lease)
    assert json.dumps(leases.region.snapshot()["holders"]) == "[]"


def _record(nodeid: str, lease: int | None, peak: int | None) -> dict:
    return {
        "nodeid": nodeid,
        "outcome": "passed",
        "exit": {"code": 0, "signal": None, "timed_out": False, "expired": None},
        "leaks": [],
        "escaped": [],
        "gpus": ["0"],
        "gpu_memory": lease,
        "gpu_memory_peak": peak,
    }


def test_the_markdown_summary_says_which_leases_to_right_size() -> None:
    """A peak under a quarter of the lease, or over the lease, is listed with a size that
    fits the peak (25% headroom, in quarter GiB); a fitting lease or an unknown peak is not."""
    from pytest_gpuiso.reports.report import markdown

    records = [
        _record("t.py::test_small", 12 * GIB, GIB),  # 8%: lease far too big
        _record("t.py::test_fits", 4 * GIB, 3 * GIB),
        _record("t.py::test_over", 2 * GIB, 5 * GIB),  # not enforced: CUDA outside torch
        _record("t.py::test_unknown", 4 * GIB, None),
    ]
    text = markdown(records)
    section = text.split("### Right-size your leases", 1)[1]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    assert rows == [
        '| `t.py::test_small` | 12.00 GiB | 1.00 GiB | `gpu_memory="1.25GiB"` |',
        '| `t.py::test_over` | 2.00 GiB | 5.00 GiB | `gpu_memory="6.25GiB"` |',
    ]
    assert "Right-size" not in markdown(records[1:2] + records[3:])
