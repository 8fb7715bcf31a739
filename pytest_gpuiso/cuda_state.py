"""Has this process touched CUDA? Answered without touching it.

A process that has loaded the CUDA driver library (``libcuda.so``, which every
CUDA runtime loads on its first call, ``cuInit``) or has a CUDA context cannot be
forked safely: the child inherits a driver state it cannot use ("Cannot
re-initialize CUDA in forked subprocess"), or worse, shares one. The fork server
asks before every fork, and every isolated child asks when it starts.

Importing ``torch`` does not load the driver; ``torch.cuda.is_available()`` does
(unless ``PYTORCH_NVML_BASED_CUDA_CHECK=1``), and so does any allocation.
"""

from __future__ import annotations

import os
import sys

DRIVER = "libcuda.so"


def driver_loaded() -> str | None:
    """The path of the CUDA driver library if it is mapped in this process."""
    try:
        with open("/proc/self/maps", "rb") as f:
            for line in f:
                path = line.rpartition(b" ")[2].strip()
                if os.path.basename(path).startswith(DRIVER.encode()):
                    return path.decode(errors="replace")
    except OSError:
        pass
    return None


def touched() -> str | None:
    """Why this process counts as having initialised CUDA, or None when it has not."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        if cuda is not None and cuda.is_initialized():
            return "torch.cuda is initialised"
    except Exception:  # a stub or a half-imported torch: the driver check below decides
        pass
    path = driver_loaded()
    if path is not None:
        return f"the CUDA driver library is loaded ({path})"
    return None
