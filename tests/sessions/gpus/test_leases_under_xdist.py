"""GPU leases seen through real pytest sessions under xdist, on fake device lists."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import GpuIso


def _log(path: Path) -> list[tuple[float, float, list[str]]]:
    rows = []
    for line in path.read_text().splitlines():
        start, end, devices, _pid = line.split(" ")
        rows.append((float(start), float(end), devices.split(",")))
    return rows


def _max_overlap(rows: list[tuple[float, float, list[str]]], device: str) -> int:
    events = []
    for start, end, devices in rows:
        if device in devices:
            events += [(start, 1), (end, -1)]
    level = peak = 0
    for _, step in sorted(events, key=lambda e: (e[0], e[1])):
        level += step
        peak = max(peak, level)
    return peak


@pytest.mark.parametrize("devices", ["0", "0,1"])
def test_no_two_tests_share_a_gpu_under_xdist(
    gpuiso: GpuIso, lease_region, tmp_path, monkeypatch, devices
):
    """-n 4 over one or two fake GPUs: never two holders on a GPU; both GPUs get used;
    gpus=2 tests get both at once, or are skipped when only one GPU exists."""
    log = tmp_path / "log"
    monkeypatch.setenv("GPUISO_LEASE_LOG", str(log))
    gpuiso.copy("lease_log.py")
    result = gpuiso.run("-n", "4", f"--gpu-isolate-devices={devices}", "-rs", "lease_log.py")
    rows = _log(log)
    names = devices.split(",")
    if len(names) == 1:
        result.assert_outcomes(passed=6, skipped=2)
        result.stdout.fnmatch_lines(["*gpu-isolate: test needs 2 GPUs, 1 (0) available*"])
    else:
        result.assert_outcomes(passed=8)
        assert sorted(r[2] for r in rows if len(r[2]) == 2) == [["0", "1"], ["0", "1"]]
        assert {r[2][0] for r in rows if len(r[2]) == 1} == {"0", "1"}, "a GPU was never used"
    for name in names:
        assert _max_overlap(rows, name) == 1, rows


def test_waiting_for_a_gpu_is_not_charged_to_the_timeout(gpuiso_spawn: GpuIso, lease_region):
    gpuiso_spawn.copy("lease_wait.py")
    result = gpuiso_spawn.run(
        "-n", "2", "--gpu-isolate-devices=0", "--gpu-isolate-report=report.json", "lease_wait.py"
    )
    result.assert_outcomes(passed=2)
    # xdist hands each worker its test at once: one leases at once, the other waits out
    # the first one's 4 s hold
    waits = sorted(r["lease_wait"] for r in gpuiso_spawn.report()["tests"])
    assert waits[0] < 2 and waits[1] > 3.5, waits


def test_lease_timeout_fails_naming_the_holder(gpuiso_spawn: GpuIso, lease_region):
    gpuiso_spawn.copy("lease_wait.py")
    result = gpuiso_spawn.run(
        "-n",
        "2",
        "--gpu-isolate-devices=0",
        "--gpu-isolate-lease-timeout=0.5",
        "-rA",
        "lease_wait.py",
    )
    result.assert_outcomes(passed=1, errors=1)
    # the time waited is measured: at least the bound, a little more on a busy machine
    [waited] = re.findall(
        r"waited ([0-9.]+) s for 1 GPU of 0 \(--gpu-isolate-lease-timeout\); held by: GPU 0: "
        r"pid \d+ \(lease_wait.py::test_hold\[\d\]\)",
        result.stdout.str(),
    )
    assert float(waited) >= 0.5, waited


def test_worker_killed_while_holding_a_gpu_does_not_block_the_rest(gpuiso: GpuIso, lease_region):
    gpuiso.copy("lease_killer.py")
    result = gpuiso.run(
        "-n",
        "2",
        "--gpu-isolate-devices=0",
        "--gpu-isolate-lease-timeout=60",
        "--gpu-isolate-report=report.json",
        "lease_killer.py",
    )
    outcomes = result.parseoutcomes()
    assert (gpuiso.path / "worker-killed.flag").exists()
    assert outcomes.get("passed") == 3, result.stdout.str()
    assert outcomes.get("failed") == 1, result.stdout.str()
    result.stdout.fnmatch_lines(["*worker 'gw*' crashed while running*test_kills_its_worker*"])
    # A lease the dead worker kept would fail its waiters after the 60 s lease timeout;
    # none waits near it. A wait here also covers live holders' start-ups (seconds each on
    # a loaded machine), so "at once" itself is the lease table's test (PROMPT there).
    waits = [r.get("lease_wait", 0) for r in gpuiso.report()["tests"]]
    assert max(waits) < 30, waits


def test_too_many_gpus_on_a_machine_without_gpus_is_a_skip(gpuiso_spawn: GpuIso, lease_region):
    gpuiso_spawn.pytester.makepyfile(
        test_two="""
        import os, pytest

        @pytest.mark.gpu_isolated(gpus=2)
        def test_needs_two():
            pass

        @pytest.mark.gpu_isolated
        def test_marked_runs_without_gpus():
            assert "PYTEST_GPUISO_LEASED" not in os.environ  # it ran, holding no lease
        """
    )
    result = gpuiso_spawn.run("--gpu-isolate-devices=none", "-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*gpu-isolate: test needs 2 GPUs, none available*"])


@pytest.mark.parametrize(
    ("args", "culprit"),
    [
        (["--gpu-isolate-devices=0,x"], "invalid value '0,x' for --gpu-isolate-devices"),
        (["--gpu-isolate-devices=0,0"], "invalid value '0,0' for --gpu-isolate-devices"),
        (["--gpu-isolate-slots=0"], "invalid value '0' for --gpu-isolate-slots"),
        (["--gpu-isolate-slots=two"], "invalid value 'two' for --gpu-isolate-slots"),
        (["--gpu-isolate-lease-timeout=-3"], "invalid value '-3' for --gpu-isolate-lease-timeout"),
        (["--gpu-isolate-gpus=-1"], "invalid value '-1' for --gpu-isolate-gpus: expected an int"),
        (["--gpu-isolate-gpus=abc"], "invalid value 'abc' for --gpu-isolate-gpus"),
        (["--gpu-isolate-gpus=1.5"], "invalid value '1.5' for --gpu-isolate-gpus"),
        (["-o", "gpu_isolate_gpus=65"], "invalid value '65' for ini gpu_isolate_gpus"),
        (
            ["--gpu-isolate-pin-workers", "--gpu-isolate-devices=none"],
            "--gpu-isolate-pin-workers needs GPUs to pin, but --gpu-isolate-devices is none",
        ),
        (
            ["--gpu-isolate-pin-workers", "--gpu-isolate-devices=0", "--gpu-isolate-gpus=0"],
            "--gpu-isolate-pin-workers pins --gpu-isolate-gpus GPUs to each worker, and "
            "--gpu-isolate-gpus is 0: choose 1 or more",
        ),
        (
            ["--gpu-isolate-pin-workers", "--gpu-isolate-devices=0,1", "-n", "3"],
            "--gpu-isolate-pin-workers: 3 xdist workers, but only 2 GPU slots (2 GPUs from "
            "--gpu-isolate-devices, 1 per worker): the rest could never get one; use -n 2",
        ),
    ],
)
def test_bad_lease_options_are_usage_errors(gpuiso_spawn: GpuIso, lease_region, args, culprit):
    gpuiso_spawn.copy("test_where.py")
    result = gpuiso_spawn.run(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: gpu-isolate: {culprit}*"])


def _cli(*args: str, region: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest_gpuiso", "--region", str(region), *args],
        cwd=region.parent,  # "-m" puts the cwd first on sys.path: never the checkout
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_status_and_reset_commands(lease_region: Path):
    """status prints the table; reset refuses while a live holder exists, --force clears."""
    from pytest_gpuiso.gpu.leases import open_region

    table = open_region(str(lease_region))
    lease_id, _ = table.acquire(["0", "1"], 1, 1, "tests/test_x.py::test_held", None)
    status = _cli("status", region=lease_region)
    assert status.returncode == 0
    # per device its memory, leased and free (shares of a device of unknown size), then
    # each holder with its lease
    assert re.search(r"^1\s+unknown\s+0%\s+100%$", status.stdout, re.M), status.stdout
    assert re.search(
        r"^\s+100%\s+\d+\s+\S+\s+held\s+tests/test_x.py::test_held$", status.stdout, re.M
    )
    refused = _cli("reset", region=lease_region)
    assert refused.returncode == 1
    assert "refusing to reset" in refused.stderr and "test_held" in refused.stderr
    assert _cli("reset", "--force", region=lease_region).returncode == 0
    assert table.snapshot()["holders"] == []
    table.release(lease_id)


def test_reset_of_a_corrupted_table(lease_region: Path):
    from pytest_gpuiso._lease import MAGIC

    lease_region.write_bytes(MAGIC.to_bytes(8, sys.byteorder) + b"\0" * 92)  # a table's start
    lease_region.chmod(0o600)
    status = _cli("status", region=lease_region)
    assert status.returncode == 2 and "has 100 bytes" in status.stderr  # unusable input
    assert _cli("reset", region=lease_region).returncode == 2
    forced = _cli("reset", "--force", region=lease_region)
    assert forced.returncode == 0 and not lease_region.exists()
    assert json.dumps(forced.stdout)  # printed something


def test_two_sessions_at_once_share_the_gpu_safely(
    gpuiso_spawn: GpuIso, lease_region, tmp_path, monkeypatch
):
    """Two independent pytest sessions (each with -n 2) on the same GPU never overlap."""
    log = tmp_path / "log"
    monkeypatch.setenv("GPUISO_LEASE_LOG", str(log))
    gpuiso_spawn.copy("lease_log.py")
    args = ("-n", "2", "--gpu-isolate-devices=0", "-k", "one_gpu", "lease_log.py")
    sessions = [gpuiso_spawn.popen(*args), gpuiso_spawn.popen(*args)]
    try:
        outputs = [p.communicate(timeout=120)[0].decode() for p in sessions]
    finally:
        for p in sessions:
            p.kill()
    for out in outputs:
        assert "6 passed" in out, out
    rows = _log(log)
    assert len(rows) == 12
    assert _max_overlap(rows, "0") == 1, rows
