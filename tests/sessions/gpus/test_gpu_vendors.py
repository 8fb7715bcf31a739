"""MIG instances and AMD GPUs as lease-table devices, without such hardware:
NVML's MIG devices through a stand-in nvidia-ml-py, MIG UUIDs in CUDA_VISIBLE_DEVICES,
and ROCm's HIP_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES / a stand-in amdsmi. Each test's
process must see exactly its device, through the variables its runtime reads."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers import GpuIso, program

GIB = 1 << 30
SEEN = """
import json, os, pytest

@pytest.mark.parametrize("i", range(3))
def test_sees(i):
    keys = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
    with open(os.environ["GPUISO_SEEN"], "a") as f:
        f.write(json.dumps({k: os.environ.get(k) for k in keys}) + "\\n")

@pytest.mark.gpu_isolated(gpu_memory="15GiB")
def test_fifteen_gib():
    with open(os.environ["GPUISO_SEEN"] + ".big", "a") as f:
        f.write(os.environ["CUDA_VISIBLE_DEVICES"] + "\\n")
"""
MIG_MACHINE = [
    {"uuid": "GPU-aaaa", "total": 80 * GIB, "mig": None},
    {
        "uuid": "GPU-bbbb",
        "total": 80 * GIB,
        "mig": [{"uuid": "MIG-b1", "total": 10 * GIB}, {"uuid": "MIG-b2", "total": 20 * GIB}],
    },
]


@pytest.fixture
def vendor_env(gpuiso_spawn: GpuIso, lease_region, tmp_path: Path, monkeypatch) -> Path:
    """No GPU variable of the user's; the stand-ins first on PYTHONPATH (no GPUs in them
    unless a test says so); the test file that logs what each test's process sees."""
    for name in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    stand_ins = [str(program("fake_nvml")), str(program("fake_amdsmi"))]
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([*stand_ins, os.environ.get("PYTHONPATH", "")])
    )
    monkeypatch.setenv("GPUISO_FAKE_NVML", "[]")
    monkeypatch.setenv("GPUISO_FAKE_AMDSMI", "[]")
    monkeypatch.setenv("GPUISO_SEEN", str(tmp_path / "seen"))
    gpuiso_spawn.pytester.makepyfile(test_seen=SEEN)
    return tmp_path / "seen"


def _seen(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_nvml_mig_instances_are_leased_as_devices(
    gpuiso_spawn: GpuIso, vendor_env: Path, monkeypatch
):
    """A GPU in MIG mode: its instances are the devices (with their own memory), beside the
    other GPU by UUID; a 15 GiB lease never lands on the 10 GiB instance."""
    monkeypatch.setenv("GPUISO_FAKE_NVML", json.dumps(MIG_MACHINE))
    result = gpuiso_spawn.run("--gpu-isolate")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(
        ["*gpu-isolate: GPUs GPU-aaaa (80 GiB), MIG-b1 (10 GiB), MIG-b2 (20 GiB) (from NVML)*"]
    )
    seen = {row["CUDA_VISIBLE_DEVICES"] for row in _seen(vendor_env)}
    assert seen <= {"GPU-aaaa", "MIG-b1", "MIG-b2"} and len(seen) >= 1, seen
    big = (vendor_env.parent / "seen.big").read_text().split()
    assert big in (["GPU-aaaa"], ["MIG-b2"]), big


def test_mig_uuids_in_cuda_visible_devices_get_nvml_memory(
    gpuiso_spawn: GpuIso, vendor_env: Path, monkeypatch
):
    monkeypatch.setenv("GPUISO_FAKE_NVML", json.dumps(MIG_MACHINE))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-b1,MIG-b2")
    result = gpuiso_spawn.run("--gpu-isolate", "-rs")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(
        ["*gpu-isolate: GPUs MIG-b1 (10 GiB), MIG-b2 (20 GiB) (from CUDA_VISIBLE_DEVICES)*"]
    )
    assert (vendor_env.parent / "seen.big").read_text().split() == ["MIG-b2"]


@pytest.mark.parametrize(
    ("variable", "value", "expect"),
    [
        (
            "HIP_VISIBLE_DEVICES",
            "0,1",
            lambda r: (
                r["HIP_VISIBLE_DEVICES"] in ("0", "1")
                and r["CUDA_VISIBLE_DEVICES"] == r["HIP_VISIBLE_DEVICES"]
                and r["ROCR_VISIBLE_DEVICES"] is None
            ),
        ),
        (
            "ROCR_VISIBLE_DEVICES",
            "GPU-x,GPU-y",
            lambda r: (
                r["ROCR_VISIBLE_DEVICES"] in ("GPU-x", "GPU-y")
                and r["HIP_VISIBLE_DEVICES"] == "0"
                and r["CUDA_VISIBLE_DEVICES"] == "0"
            ),
        ),
    ],
    ids=["hip", "rocr"],
)
def test_rocm_devices_from_the_environment(
    gpuiso_spawn: GpuIso, vendor_env: Path, monkeypatch, variable, value, expect
):
    monkeypatch.setenv(variable, value)
    result = gpuiso_spawn.run("--gpu-isolate", "-k", "sees")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines([f"*gpu-isolate: GPUs {value} (from {variable})*"])
    rows = _seen(vendor_env)
    assert len(rows) == 3 and all(expect(row) for row in rows), rows


def test_amd_gpus_and_their_memory_from_amdsmi(gpuiso_spawn: GpuIso, vendor_env: Path, monkeypatch):
    """No variable set and no NVIDIA GPU: amdsmi's GPUs, with their VRAM; a test sees
    one through HIP_VISIBLE_DEVICES (and CUDA_VISIBLE_DEVICES, which HIP honours too)."""
    monkeypatch.setenv("GPUISO_FAKE_AMDSMI", json.dumps([64 * GIB, 64 * GIB]))
    result = gpuiso_spawn.run("--gpu-isolate", "-k", "sees")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["*gpu-isolate: GPUs 0 (64 GiB), 1 (64 GiB) (from amdsmi)*"])
    rows = _seen(vendor_env)
    assert all(r["HIP_VISIBLE_DEVICES"] in ("0", "1") for r in rows), rows
    assert all(r["CUDA_VISIBLE_DEVICES"] == r["HIP_VISIBLE_DEVICES"] for r in rows), rows
