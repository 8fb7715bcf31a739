"""Has this process touched CUDA? Answered without touching it.

A process that has loaded the CUDA driver library (``libcuda.so``, which every
CUDA runtime loads on its first call, ``cuInit``) or has a CUDA context cannot be
forked safely: the child inherits a driver state it cannot use ("Cannot
re-initialize CUDA in forked subprocess"), or worse, shares one. The fork server
asks before every fork, and every isolated child asks when it starts.

The NVIDIA management library (``libnvidia-ml.so``) counts too: it creates no
context, but whoever loaded it has asked about the GPUs, and the answer (say
``torch.cuda.device_count()``, which goes through NVML) was computed for the
GPUs visible then, which are not the ones a test will be leased.

Importing ``torch`` loads neither; ``torch.cuda.is_available()``,
``device_count()`` and any allocation do.
"""

from __future__ import annotations

import os
import sys

DRIVER = "libcuda.so"
NVML = "libnvidia-ml.so"


def loaded(library: str) -> str | None:
    """The path of ``library`` (a file name prefix) if it is mapped in this process."""
    try:
        with open("/proc/self/maps", "rb") as f:
            for line in f:
                path = line.rpartition(b" ")[2].strip()
                if os.path.basename(path).startswith(library.encode()):
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
    path = loaded(DRIVER)
    if path is not None:
        return f"the CUDA driver library is loaded ({path})"
    path = loaded(NVML)
    if path is not None:
        return f"the NVIDIA management library is loaded ({path}): GPUs were queried"
    return None
