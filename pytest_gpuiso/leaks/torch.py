"""torch's CUDA allocator around one test (``--gpu-isolate-torch-check``).

The child half runs in the test's process (``allocated`` before the test,
``growth`` after its teardown); the parent turns each growth it reports into a
``gpu_memory`` leak (``leak``). Never initialises CUDA: a test that did not use
the GPU has nothing to compare.
"""

from __future__ import annotations

import gc
import sys
from typing import Any

from ..values import size_text
from . import Leak


def allocated() -> dict[int, int]:
    """Bytes held by torch's CUDA allocator per device; {} when CUDA is not initialised."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return {}
    return {d: int(torch.cuda.memory_allocated(d)) for d in range(torch.cuda.device_count())}


def growth(before: dict[int, int]) -> dict[int, int]:
    """Growth of ``allocated()`` since ``before``, after dropping unreachable tensors."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    after = allocated()
    return {d: n - before.get(d, 0) for d, n in after.items() if n > before.get(d, 0)}


def leak(data: dict[str, Any]) -> Leak:
    """The leak of one growth the test's process reported ({device, bytes})."""
    return Leak(
        "gpu_memory",
        f"cuda:{data['device']}: torch.cuda.memory_allocated() grew by {size_text(data['bytes'])} "
        "during the test (tensors still referenced after teardown)",
        {"device": f"cuda:{data['device']}", "bytes": data["bytes"], "source": "torch"},
    )
