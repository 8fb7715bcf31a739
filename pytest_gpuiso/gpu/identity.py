"""Which GPU each of a session's device names is: its UUID, the lease table's row.

A session may call one GPU ``0`` (``CUDA_VISIBLE_DEVICES=0``), another its UUID (NVML
discovery, where a GPU is in MIG mode) or a prefix of it: each must lease the one row
of that GPU. An index is NVML's when the numbering is the PCI bus order (NVML's own, or
``CUDA_DEVICE_ORDER=PCI_BUS_ID``) or every GPU is one model (CUDA's default order, the
fastest first, is then the PCI order); otherwise CUDA itself is asked, in a fresh
process (``python -m pytest_gpuiso.gpu.identity``: ``cuDeviceGetUuid_v2``, no context),
never in pytest's.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from typing import Protocol

ASK_TIMEOUT = 30.0  # seconds for CUDA's answer (cuInit takes < 1 s on a healthy machine)


class Named(Protocol):
    names: tuple[str, ...]
    via: str

    @property
    def in_pci_order(self) -> bool: ...


class Reader(Protocol):
    def identity(self, device: str) -> str | None: ...

    def uuids(self) -> list[str]: ...

    def models(self) -> set[str]: ...


def identities(devices: Named, nvml: Reader) -> list[str]:
    """Each name's UUID, or the name itself where it cannot be known."""
    from . import rocm

    if devices.via != rocm.CUDA:
        return list(devices.names)
    indices = [name for name in devices.names if name.isdigit()]
    asked: dict[str, str] = {}
    if indices and not devices.in_pci_order and len(nvml.models()) > 1:
        asked = _ask_cuda(indices, nvml.uuids())
    return [asked.get(name) or nvml.identity(name) or name for name in devices.names]


def _ask_cuda(indices: list[str], known: list[str]) -> dict[str, str]:
    """CUDA's UUID of each index, as NVML spells it ({} when CUDA cannot say)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(indices)}
    try:
        said = subprocess.run(
            [sys.executable, "-m", "pytest_gpuiso.gpu.identity"],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=ASK_TIMEOUT,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return {}
    by_hex = {_hex(uuid): uuid for uuid in known}
    return {i: by_hex[h] for i, h in zip(indices, said, strict=False) if h in by_hex}


def _hex(uuid: str) -> str:
    return uuid.split("-", 1)[-1].replace("-", "").lower()


def main() -> int:
    """Print the UUID (32 hex digits) of each GPU CUDA sees, in its order."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 2
    count, device, uuid = ctypes.c_int(), ctypes.c_int(), (ctypes.c_ubyte * 16)()
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 1
    for ordinal in range(count.value):
        if cuda.cuDeviceGet(ctypes.byref(device), ordinal) != 0:
            return 1
        if cuda.cuDeviceGetUuid_v2(ctypes.byref(uuid), device) != 0:
            return 1
        print(bytes(uuid).hex(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
