"""`pytest --gpu-isolate` on a suite nobody marked, on a real GPU: each test
leases the GPU and sees it, where before it saw none (and a skipif(not
torch.cuda.is_available()) suite went green having tested nothing). Skipped without CUDA
or torch (tests/gpu/conftest.py); this process never imports torch."""

from __future__ import annotations


def test_unmarked_tests_get_the_gpu_and_a_port(gpuiso):
    gpuiso.copy("gpu_every_test.py")
    args = ("--gpu-isolate", "-n", "2", "--gpu-isolate-slots=2", "--gpu-isolate-report=report.json")
    result = gpuiso.run(*args, "-rs", "gpu_every_test.py")
    result.assert_outcomes(passed=3)
    records = gpuiso.records()
    assert all(len(r["gpus"]) == 1 for r in records.values()), records
    assert all(r["master_port"] for r in records.values()), records


def test_a_test_without_a_gpu_that_loads_cuda_is_named(gpuiso):
    """Without a preload, the test's own process imports torch and asks
    torch.cuda.is_available() (in its skipif), seeing no GPU. A CUDA 12 build loads the
    driver then, a CUDA 13 build at import: either way the test's code loaded it. (A
    cuInit that found no GPU leaves no other trace: with torch's CUDA 13 build preloaded,
    the driver is mapped before the test, and such a test is not named.)"""
    gpuiso.copy("gpu_every_test.py")
    args = ("--gpu-isolate", "--gpu-isolate-gpus=0", "--gpu-isolate-preload=none")
    args += ("--gpu-isolate-report=report.json",)
    result = gpuiso.run(*args, "-rs", "-k", "sees_one", "gpu_every_test.py")
    result.assert_outcomes(skipped=1, warnings=1)
    result.stdout.fnmatch_lines(["*this test loaded libcuda.so* but leased no GPU*"])
    (record,) = gpuiso.records().values()
    assert record["cuda_without_gpu"], record


def test_a_pinned_worker_s_in_process_test_sees_its_gpu(gpuiso_spawn):
    """Not isolated: the test runs in the xdist worker, which pinned the GPU."""
    gpuiso_spawn.copy("gpu_every_test.py")
    args = ("--gpu-isolate-pin-workers", "-n", "1", "-rs", "-k", "sees_one")
    result = gpuiso_spawn.run(*args, "gpu_every_test.py")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*pinned workers (--gpu-isolate-pin-workers): each of the 1*"])
