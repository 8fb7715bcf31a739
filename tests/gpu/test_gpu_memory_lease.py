"""GPU memory leases on a real GPU: torch's allocator is capped at the lease, going over
fails naming it, a test without CUDA gets no context, and the JSON record has the peak
(NVML, sampled). Skipped without CUDA or torch (tests/gpu/conftest.py)."""

from __future__ import annotations


def test_the_lease_caps_torch_and_the_peak_is_recorded(gpuiso):
    gpuiso.copy("gpu_memory_lease.py")
    result = gpuiso.run("--gpu-isolate-report=report.json", "gpu_memory_lease.py")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(
        ["*OutOfMemoryError*", "this test's GPU memory lease is 1 GiB on each GPU*"]
    )
    records = gpuiso.records()
    within = records["gpu_memory_lease.py::test_within_the_lease"]
    assert within["gpu_memory"] == 1 << 30
    # NVML's per-process figure includes the CUDA context (a few hundred MiB), which the
    # allocator's cap does not cover
    peak = within["gpu_memory_peak"]
    assert peak is not None and 512 << 20 <= peak <= 2 << 30, peak
