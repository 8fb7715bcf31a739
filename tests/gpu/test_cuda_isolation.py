"""GPU checks: each isolated test starts with a fresh, uninitialised CUDA context.

Skipped without CUDA. Run on a GPU machine: `pytest tests/gpu -v`. The tests in
fixtures/programs/gpu_state.py run isolated inside pytester sessions; this
module itself never initialises CUDA in the pytest parent.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest


def _has_cuda() -> bool:
    # Ask nvidia-smi / NVML, never torch.cuda in this (parent) process.
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


pytestmark = pytest.mark.skipif(not _has_cuda(), reason="no CUDA device")


def test_each_isolated_test_gets_a_clean_cuda_context(gpuiso):
    pytest.importorskip("torch")
    gpuiso.copy("gpu_state.py")
    result = gpuiso.run("--gpu-isolate", "-v", "gpu_state.py")
    result.assert_outcomes(passed=5)


def test_parent_never_initialises_cuda(gpuiso):
    pytest.importorskip("torch")
    gpuiso.copy("gpu_state.py")
    gpuiso.pytester.makeconftest(
        "import sys\n"
        "def pytest_sessionfinish(session):\n"
        "    torch = sys.modules.get('torch')\n"
        "    assert torch is None or not torch.cuda.is_initialized(), 'CUDA in parent'\n"
        "    print('PARENT-CUDA-CLEAN')\n"
    )
    result = gpuiso.run("--gpu-isolate", "-s", "gpu_state.py")
    result.assert_outcomes(passed=5)
    result.stdout.fnmatch_lines(["*PARENT-CUDA-CLEAN*"])
