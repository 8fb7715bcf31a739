"""NVML, read from pytest's process: the GPUs it sees, their memory, who holds them.

No CUDA context is ever created here: NVML reads the driver's accounting. One reader
serves the session (``runner.State.nvml``): the lease table sizes its devices with it
(``leases``) and the GPU memory leak check samples through it (``leaks.gpu_memory``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Sample:
    """One device at one moment."""

    used: int  # bytes in use on the device
    processes: dict[int, int] = field(default_factory=dict)  # NVML pid -> bytes (0: unknown)


class NvmlUnavailable(Exception):
    """No driver, no NVML library, or a device NVML does not know."""


class NvmlReader:
    """Samples devices through nvidia-ml-py. Initialised once, on first use."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._handles: dict[str, Any] = {}
        self.error: str | None = None

    def available(self) -> bool:
        if self._nvml is None and self.error is None:
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
            except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, ...
                self.error = _nvml_reason(exc)
        return self._nvml is not None

    def _handle(self, device: str) -> Any:
        handle = self._handles.get(device)
        if handle is None:
            nvml = self._nvml
            try:
                if device.isdigit():
                    handle = nvml.nvmlDeviceGetHandleByIndex(int(device))
                else:
                    handle = nvml.nvmlDeviceGetHandleByUUID(device)
            except Exception as exc:
                raise NvmlUnavailable(f"GPU {device}: {_nvml_reason(exc)}") from None
            self._handles[device] = handle
        return handle

    def close(self) -> None:
        """Shut NVML down (it is initialised again on the next use)."""
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
            self._nvml, self._handles = None, {}

    def count(self) -> int:
        """GPUs NVML sees; 0 without a driver."""
        if not self.available():
            return 0
        try:
            return int(self._nvml.nvmlDeviceGetCount())
        except Exception:
            return 0

    def devices(self) -> list[str]:
        """The GPUs NVML sees, as names for CUDA_VISIBLE_DEVICES: their indices; where a GPU
        is in MIG mode, its MIG instances' UUIDs instead (and every other GPU's UUID, since
        CUDA_VISIBLE_DEVICES cannot mix MIG UUIDs with indices). [] without a driver."""
        if not self.available():
            return []
        nvml = self._nvml
        try:
            gpus = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(self.count())]
            migs = [self._mig_instances(handle) for handle in gpus]
            if not any(migs):
                return [str(i) for i in range(len(gpus))]
            names = []
            for handle, instances in zip(gpus, migs, strict=True):
                names += instances or [_text(nvml.nvmlDeviceGetUUID(handle))]
            return names
        except Exception:  # NVMLError: as without a driver
            return []

    def _mig_instances(self, handle: Any) -> list[str]:
        """The UUIDs of a GPU's MIG instances; [] when it is not in MIG mode."""
        nvml = self._nvml
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
        except Exception:  # not supported: no MIG on this GPU
            return []
        if current != getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1):
            return []
        found = []
        for i in range(int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))):
            try:
                found.append(
                    _text(
                        nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i))
                    )
                )
            except Exception:  # NVML_ERROR_NOT_FOUND: no instance at that index
                continue
        return found

    def total(self, device: str) -> int:
        """The device's memory in bytes; 0 when NVML cannot tell."""
        if not self.available():
            return 0
        try:
            return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle(device)).total)
        except Exception:  # NvmlUnavailable, NVMLError
            return 0

    def sample(self, device: str) -> Sample:
        if not self.available():
            raise NvmlUnavailable(self.error or "NVML unavailable")
        nvml = self._nvml
        handle = self._handle(device)
        try:
            used = int(nvml.nvmlDeviceGetMemoryInfo(handle).used)
        except Exception as exc:
            raise NvmlUnavailable(f"GPU {device}: {_nvml_reason(exc)}") from None
        processes: dict[int, int] = {}
        for kind in ("Compute", "Graphics"):
            query = f"nvmlDeviceGet{kind}RunningProcesses"
            with contextlib.suppress(Exception):  # not supported on some (v)GPUs
                for p in getattr(nvml, query)(handle):
                    processes[int(p.pid)] = int(p.usedGpuMemory or 0)
        return Sample(used, processes)


def _text(value: Any) -> str:
    """NVML's strings are bytes in old nvidia-ml-py releases."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml_reason(exc: Exception) -> str:
    if isinstance(exc, ImportError):
        return "nvidia-ml-py is not installed"
    text = str(exc) or type(exc).__name__
    return f"NVML: {text}"
