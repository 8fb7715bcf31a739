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

``torch.cuda.is_available()``, ``device_count()`` and any allocation load the
driver library. Importing ``torch`` loads neither in CUDA 12 builds, but torch
2.11's CUDA 13 build maps ``libcuda.so`` at import (seen on an H200, 2026-11-26),
as does ``import cupy``: a mapped driver library says a CUDA framework was
imported, not that CUDA was initialised.
"""

from __future__ import annotations

import os
import sys

DRIVER = "libcuda.so"
NVML = "libnvidia-ml.so"


def loaded(library: str, maps: bytes | None = None) -> str | None:
    """The path of ``library`` (a file name prefix) if it is mapped in this process.

    ``maps``: /proc/self/maps, read already. One search over the whole text: this
    runs before every fork and in every test's process, ~0.05 ms (line by line: ~0.6).
    """
    if maps is None:
        maps = _maps()
    at = maps.find(b"/" + library.encode())
    if at < 0:
        return None
    start = maps.rfind(b" ", 0, at) + 1
    end = maps.find(b"\n", at)
    return maps[start : end if end >= 0 else len(maps)].decode(errors="replace")


def _maps() -> bytes:
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read()
    except OSError:
        return b""


def touched() -> str | None:
    """Why this process counts as having initialised CUDA, or None when it has not."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        if cuda is not None and cuda.is_initialized():
            return "torch.cuda is initialised"
    except Exception:  # a stub or a half-imported torch: the driver check below decides
        pass
    maps = _maps()
    path = loaded(DRIVER, maps)
    if path is not None:
        return f"the CUDA driver library is loaded ({path})"
    path = loaded(NVML, maps)
    if path is not None:
        return f"the NVIDIA management library is loaded ({path}): GPUs were queried"
    return None


def driver_libraries() -> list[str]:
    """The file names of the CUDA driver and NVML libraries mapped in this process."""
    maps = _maps()
    return [os.path.basename(path) for lib in (DRIVER, NVML) if (path := loaded(lib, maps))]
