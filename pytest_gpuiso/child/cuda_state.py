"""Has this process touched CUDA? Answered without touching it.

A process that has initialised the CUDA driver (``cuInit``, which every CUDA runtime
calls first) or has a CUDA context cannot be forked safely: the child inherits a
driver state it cannot use ("Cannot re-initialize CUDA in forked subprocess"), or
worse, shares one. The fork server asks before every fork, and every isolated child
asks when it starts.

The NVIDIA management library (``libnvidia-ml.so``) counts too: it creates no
context, but whoever loaded it has asked about the GPUs, and the answer (say
``torch.cuda.device_count()``, which goes through NVML) was computed for the
GPUs visible then, which are not the ones a test will be leased. So does an open
GPU device file (``/dev/nvidia*``): ``cuInit`` and ``nvmlInit`` open them.

The driver library merely mapped does not count. torch 2.11's CUDA 13 build maps
``libcuda.so`` at import (through ``libcudart``), as does ``import cupy``, without
initialising it; on an H100 (2026-11-26) a fork of such a process initialised CUDA
and computed normally, twice. Whether ``cuInit`` has run is asked of the driver:
``cuDeviceGetCount`` answers ``CUDA_ERROR_NOT_INITIALIZED`` before it and only then,
changing nothing. ``torch.cuda.is_available()``, ``device_count()`` and any
allocation run ``cuInit`` (or NVML).

But a ``cuInit`` that found no GPU (``CUDA_VISIBLE_DEVICES=""``) leaves the driver
answering "not initialised" again (H100, 2026-11-26), while torch has cached "no GPU"
for the process's life. So where the GPUs are hidden, the library's loading is the only
trace: ``hidden_touch()`` counts it for a process that runs user code before its GPUs
are given (a prewarmed one; one whose preload mapped it takes its go first instead,
``child.Channel.go_first``), and ``driver_libraries()`` names a driver the test's own
code loaded (since ``baseline()``) as one it used.
"""

from __future__ import annotations

import ctypes
import os
import sys

DRIVER = "libcuda.so"
NVML = "libnvidia-ml.so"
DEVICES = "/dev/nvidia"  # /dev/nvidiactl, /dev/nvidia0, /dev/nvidia-uvm, /dev/nvidia-caps/...
NOT_INITIALIZED = 3  # CUDA_ERROR_NOT_INITIALIZED: cuInit has not run in this process

_counters: dict[str, object] = {}  # the driver's path -> its cuDeviceGetCount, or None
_before_test: list[str | None] = [None]  # the driver mapped when the test's code began


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


def touched(maps: bytes | None = None) -> str | None:
    """Why this process counts as having initialised CUDA, or None when it has not.

    ``maps``: /proc/self/maps, read already."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        if cuda is not None and cuda.is_initialized():
            return "torch.cuda is initialised"
    except Exception:  # a stub or a half-imported torch: the checks below decide
        pass
    maps = _maps() if maps is None else maps
    path = loaded(DRIVER, maps)
    if path is not None and driver_initialised(path):
        return f"the CUDA driver is initialised ({path})"
    path = loaded(NVML, maps)
    if path is not None:
        return f"the NVIDIA management library is loaded ({path}): GPUs were queried"
    device = open_device()
    if device is not None:
        return f"a GPU device file is open ({device})"
    return None


def hidden_touch() -> str | None:
    """``touched()``, or the driver library mapped: for a process whose own code (plugins,
    conftests, modules) ran while its GPUs were hidden, where a ``cuInit`` that found
    none leaves no other trace (importing torch's CUDA 13 build alone maps it too)."""
    maps = _maps()
    reason = touched(maps)
    if reason is None and (path := loaded(DRIVER, maps)) is not None:
        reason = (
            f"the CUDA driver library was loaded ({path}) while the GPUs were hidden, where a "
            "CUDA call leaves no other trace; importing a CUDA 13 build of torch or CuPy loads "
            "it too: name it in --gpu-isolate-preload, and processes that preload it wait "
            "for their GPUs before running plugins and conftests"
        )
    return reason


def baseline() -> str | None:
    """The test's own code begins: a driver mapped later was loaded by it. Returns the
    driver mapped now (its path), or None."""
    _before_test[0] = loaded(DRIVER)
    return _before_test[0]


def driver_initialised(path: str) -> bool:
    """Whether ``cuInit`` has run in this process, where the driver at ``path`` is mapped.

    Asked with ``cuDeviceGetCount``, which before ``cuInit`` answers NOT_INITIALIZED and
    does nothing else; a driver that cannot be asked counts as initialised."""
    if path not in _counters:
        try:
            library = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
            count = library.cuDeviceGetCount
            count.argtypes = [ctypes.POINTER(ctypes.c_int)]
            count.restype = ctypes.c_int
        except (OSError, AttributeError):
            count = None
        _counters[path] = count
    count = _counters[path]
    if count is None:
        return True
    devices = ctypes.c_int(0)
    return count(ctypes.byref(devices)) != NOT_INITIALIZED


def open_device() -> str | None:
    """A GPU device file (``/dev/nvidia*``) this process has open, or None."""
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return None
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(DEVICES):
            return target
    return None


def driver_libraries() -> list[str]:
    """The file names of the CUDA driver and NVML libraries this process used: the
    driver initialised or loaded since ``baseline()``, NVML mapped."""
    maps = _maps()
    found = []
    path = loaded(DRIVER, maps)
    if path is not None and (path != _before_test[0] or driver_initialised(path)):
        found.append(os.path.basename(path))
    path = loaded(NVML, maps)
    if path is not None:
        found.append(os.path.basename(path))
    return found
