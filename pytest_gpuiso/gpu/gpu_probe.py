"""The driver part of a GPU's health probe: ``python -m pytest_gpuiso.gpu.gpu_probe``.

Run in a fresh process (never pytest's: no CUDA context there), with
``CUDA_VISIBLE_DEVICES`` naming the one GPU to probe. Through the CUDA driver API
(ctypes, no torch): initialise, create a context, allocate 1 MiB, synchronise, free,
destroy. Exit status 0 when every step succeeded; 2 when there is no CUDA driver to
load (nothing said of the GPU: an AMD machine); 3 when a step failed only for want of
memory (the GPU is full, of someone else's memory perhaps: full is not broken); else 1.
On failure, one line on stdout names the step and the driver's error
("cuCtxSynchronize: CUDA_ERROR_ILLEGAL_ADDRESS (700)"). The caller bounds it with a
timeout (a GPU that hangs fails the probe).
"""

from __future__ import annotations

import ctypes
import sys

ALLOC_BYTES = 1 << 20


NO_DRIVER = 2  # exit status: no CUDA driver to probe with (not the GPU's fault)
FULL = 3  # exit status: the GPU had no memory to give (not the GPU's fault either)
OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY


class ProbeFailed(Exception):
    pass


class NoDriver(Exception):
    pass


class Full(ProbeFailed):
    pass


def _error_name(cuda: ctypes.CDLL, code: int) -> str:
    name = ctypes.c_char_p()
    try:
        if cuda.cuGetErrorName(code, ctypes.byref(name)) == 0 and name.value:
            return f"{name.value.decode()} ({code})"
    except AttributeError:  # a driver without cuGetErrorName
        pass
    return f"CUDA error {code}"


def _call(cuda: ctypes.CDLL, name: str, *args: object) -> None:
    code = getattr(cuda, name)(*args)
    if code == OUT_OF_MEMORY:
        raise Full(f"{name}: {_error_name(cuda, code)}")
    if code != 0:
        raise ProbeFailed(f"{name}: {_error_name(cuda, code)}")


def probe() -> None:
    """Every step of the probe; ``ProbeFailed`` naming the first that fails."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise NoDriver(f"the CUDA driver cannot be loaded: {exc}") from None
    device, context, pointer = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
    _call(cuda, "cuInit", 0)
    _call(cuda, "cuDeviceGet", ctypes.byref(device), 0)
    _call(cuda, "cuCtxCreate_v2", ctypes.byref(context), 0, device)
    _call(cuda, "cuMemAlloc_v2", ctypes.byref(pointer), ctypes.c_size_t(ALLOC_BYTES))
    _call(cuda, "cuCtxSynchronize")
    _call(cuda, "cuMemFree_v2", pointer)
    _call(cuda, "cuCtxDestroy_v2", context)


def main() -> int:
    try:
        probe()
    except NoDriver as exc:
        print(exc, flush=True)
        return NO_DRIVER
    except Full as exc:
        print(exc, flush=True)
        return FULL
    except ProbeFailed as exc:
        print(exc, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
