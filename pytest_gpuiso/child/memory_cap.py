"""A test's GPU memory lease, enforced on torch's CUDA allocator in the test's process.

The parent tells the test's process its lease in ``PYTEST_GPUISO_GPU_MEMORY`` (bytes
on each leased GPU). When torch is (or gets) imported here, a call is queued with
``torch.cuda._lazy_call``: it runs when torch initialises CUDA, and caps the caching
allocator of each visible GPU at the lease (``set_per_process_memory_fraction``). A
test that never uses CUDA never creates a context for it. Going over the cap raises
torch's ``OutOfMemoryError``; its report then gets a section naming the lease.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from typing import Any

from ..values import size_text
from ..wire.environment import MEMORY_ENV


def lease() -> int:
    """This process's lease in bytes per GPU; 0 when it has none."""
    text = os.environ.get(MEMORY_ENV, "")  # set by the parent for every isolated test
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 19 else 0


def install() -> None:
    """Cap torch's allocator at the lease once torch initialises CUDA (imported or not yet)."""
    size = lease()
    if not size:
        return
    torch = sys.modules.get("torch")
    if torch is not None:
        _queue(torch, size)
    elif not any(isinstance(f, _AfterTorchImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorchImport(size))


def _queue(torch: Any, size: int) -> None:
    cuda = getattr(torch, "cuda", None)
    lazy_call = getattr(cuda, "_lazy_call", None)
    if lazy_call is None:
        return  # a torch without it: the lease is scheduled, not enforced

    def cap() -> None:
        for index in range(cuda.device_count()):
            total = cuda.get_device_properties(index).total_memory
            cuda.set_per_process_memory_fraction(min(1.0, size / total), index)

    lazy_call(cap)


class _AfterTorchImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``torch`` is imported, queues the cap once it is loaded."""

    def __init__(self, size: int) -> None:
        self.size = size

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torch":
            return None
        sys.meta_path.remove(self)  # once, and not for the find_spec below
        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute, size = loader.exec_module, self.size

        def exec_module(module: Any) -> None:
            execute(module)
            _queue(module, size)

        loader.exec_module = exec_module
        return spec


def describe_overrun(excinfo: Any) -> str | None:
    """For a test that ran out of GPU memory under its lease: a line naming the lease."""
    size = lease()
    if not size or excinfo is None or type(excinfo.value).__name__ != "OutOfMemoryError":
        return None
    return (
        f"this test's GPU memory lease is {size_text(size)} on each GPU "
        f"(gpu_memory=, or 1/slots of the GPU): torch's allocator is capped at it"
    )
