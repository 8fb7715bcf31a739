"""Distributed tests (``ranks=N``) on a real GPU: two ranks sharing one GPU by memory
slices all_reduce CUDA tensors over gloo; NCCL with a GPU a rank where there are two;
a rank failing while the other waits in a CUDA collective is named as the cause and its
peer ends long before the timeout. Skipped without CUDA or torch (tests/gpu/conftest.py).
"""

from __future__ import annotations

import subprocess

FAILS = "gpu_ranks.py::test_rank_1_fails_while_rank_0_waits_in_a_cuda_all_reduce"


def _gpus() -> int:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


def test_ranks_on_the_gpu(gpuiso):
    gpuiso.copy("gpu_ranks.py")
    result = gpuiso.run("--gpu-isolate-report=report.json", "-rs", "gpu_ranks.py", timeout=300)
    many = _gpus() >= 2
    result.assert_outcomes(passed=1 + many, failed=1, skipped=0 if many else 1)
    if not many:
        result.stdout.fnmatch_lines(["SKIPPED *gpu_ranks.py:*test needs 2 GPUs, 1 (*) available"])
    records = gpuiso.records()
    shared = records["gpu_ranks.py::test_gloo_on_cuda_tensors_on_memory_slices"]
    assert [r["outcome"] for r in shared["ranks"]] == ["passed", "passed"], shared
    failed = records[FAILS]
    assert failed["duration"] < 60, failed  # not the 120 s timeout
    waited, cause = failed["ranks"]
    assert cause["error"] == "RuntimeError: rank 1 ran out of data", failed["ranks"]
    assert waited["outcome"] == "failed", waited  # gloo fails it, or rank_wait stops it
