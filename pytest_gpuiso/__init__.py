"""pytest-gpuiso: run GPU tests in fresh processes with a clean CUDA context, crash-proof.

PYTEST_DONT_REWRITE: pytest rewrites the asserts of a plugin distribution's modules;
ours have none a user debugs, and are imported in every pytest process (pytest's, the
fork server's, each spawned test's), so they are imported as any library's are.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any


def _import_plainly() -> None:
    """Take this package off pytest's list of modules to rewrite (pytest marked it, as
    a plugin distribution's, before importing it): its other modules then load from
    their installed bytecode, not compiled again by the rewriter in each process
    (~0.2 s in each where bytecode is not written, as under PYTHONDONTWRITEBYTECODE).
    Nothing changes where pytest's hook is not what this expects."""
    for finder in sys.meta_path:
        marked = getattr(finder, "_must_rewrite", None)
        cache = getattr(finder, "_marked_for_rewrite_cache", None)
        if isinstance(marked, set) and __name__ in marked and isinstance(cache, dict):
            marked.discard(__name__)
            cache.clear()


_import_plainly()

from .values import VERSION  # noqa: E402 - unmarked first
from .warning_types import GpuIsoLeakWarning, GpuIsoStartWarning  # noqa: E402

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
__version__ = VERSION  # written once, on the bottom floor (values.py)


def __getattr__(name: str) -> Any:
    """``run_isolated`` and its exceptions, imported on first use: pytest loads this
    package in every session, and most isolate nothing."""
    if name in _CALL:
        from .parent import call

        return getattr(call, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
