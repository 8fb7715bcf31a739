"""pytest-gpuiso: run GPU tests in fresh processes with a clean CUDA context, crash-proof."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .warning_types import GpuIsoLeakWarning, GpuIsoStartWarning

if TYPE_CHECKING:
    from .parent.call import IsolatedTimeout, IsolationError, RemoteError, run_isolated

_CALL = ("IsolatedTimeout", "IsolationError", "RemoteError", "run_isolated")

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


def __getattr__(name: str) -> Any:
    """``run_isolated`` and its exceptions, imported on first use: pytest loads this
    package in every session, and most isolate nothing."""
    if name in _CALL:
        from .parent import call

        return getattr(call, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
