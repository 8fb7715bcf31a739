"""pytest-gpuiso: run GPU tests in fresh spawned processes, bounded and crash-proof."""

from __future__ import annotations

from .call import IsolatedTimeout, IsolationError, RemoteError, run_isolated

__all__ = ["IsolatedTimeout", "IsolationError", "RemoteError", "run_isolated", "__version__"]
__version__ = "0.1.0"
