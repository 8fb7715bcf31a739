"""GPU health on a real GPU: a healthy GPU passes both parts of the probe (NVML, then the
CUDA driver in a fresh process), and each part's cost is printed for
docs/gpu-validation.md. Skipped without CUDA (tests/gpu/conftest.py)."""

from __future__ import annotations

import statistics
import time

from pytest_gpuiso.gpu.health import driver_probe
from pytest_gpuiso.gpu.leases import visible_env
from pytest_gpuiso.gpu.nvml import NvmlReader


def test_a_healthy_gpu_passes_its_probe(capsys) -> None:
    nvml = NvmlReader()
    try:
        assert nvml.available(), nvml.error
        [first, *_] = nvml.devices()
        nvml.track_errors(first)
        times = []
        for _ in range(50):
            start = time.perf_counter()
            assert nvml.problems(first) == []
            times.append(time.perf_counter() - start)
    finally:
        nvml.close()
    start = time.perf_counter()
    assert driver_probe(visible_env((first,))) is None
    driver = time.perf_counter() - start
    with capsys.disabled():
        print(
            f"\nGPU {first}: NVML part median {statistics.median(times) * 1e3:.2f} ms, max "
            f"{max(times) * 1e3:.2f} ms (target <= 10 ms); driver part {driver:.2f} s"
        )
