"""pytest-gpuiso: run GPU tests in fresh processes with a clean CUDA context, crash-proof."""

from __future__ import annotations

from .parent.call import IsolatedTimeout, IsolationError, RemoteError, run_isolated
from .warning_types import GpuIsoLeakWarning, GpuIsoStartWarning

__all__ = [
    "GpuIsoLeakWarning",
    "GpuIsoStartWarning",
    "IsolatedTimeout",
    "IsolationError",
    "RemoteError",
    "run_isolated",
    "__version__",
]
__version__ = "0.1.0"  # the one place the version is written (pyproject reads it)
