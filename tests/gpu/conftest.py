"""tests/gpu/ needs a CUDA device and torch: every test here is skipped without them.

This, the pytest parent process, never imports torch and never creates a CUDA
context: CUDA is detected with nvidia-smi, torch with ``importlib.util.find_spec``
(which does not import it). Importing torch here would also break the second test
of a module: pytester restores ``sys.modules`` after each test, so torch would be
imported twice in one process ("function '_has_torch_function' already has a
docstring"). torch runs only in the isolated test processes of the pytester sessions.
"""

from __future__ import annotations

import functools
import importlib.util
import shutil
import subprocess

import pytest


@functools.cache
def _has_cuda() -> bool:
    # Ask nvidia-smi / NVML, never torch.cuda in this (parent) process.
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


@pytest.fixture(autouse=True)
def _requires_cuda_and_torch() -> None:
    if not _has_cuda():
        pytest.skip("no CUDA device")
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
