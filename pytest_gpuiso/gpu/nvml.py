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
        self._events: dict[str, Any] = {}  # device -> its NVML event set (Xid critical errors)
        self._ecc: dict[str, int | None] = {}  # device -> uncorrectable ECC errors when watched
        self._aliases: dict[str, str] = {}  # a session's name of a GPU -> its UUID (``alias``)
        self.error: str | None = None

    def alias(self, device: str, uuid: str) -> None:
        """Read ``device`` as the GPU ``uuid`` from now on (an index CUDA numbers otherwise
        than NVML)."""
        self._aliases[device] = uuid
        self._handles.pop(device, None)

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
            known = self._aliases.get(device, device)
            try:
                if known.isdigit():
                    handle = nvml.nvmlDeviceGetHandleByIndex(int(known))
                else:
                    handle = nvml.nvmlDeviceGetHandleByUUID(known)
            except Exception as exc:
                raise NvmlUnavailable(f"GPU {device}: {_nvml_reason(exc)}") from None
            self._handles[device] = handle
        return handle

    def close(self) -> None:
        """Shut NVML down (it is initialised again on the next use)."""
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                for events in self._events.values():
                    self._nvml.nvmlEventSetFree(events)
                self._nvml.nvmlShutdown()
            self._nvml, self._handles, self._events, self._ecc = None, {}, {}, {}

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

    def identity(self, device: str) -> str | None:
        """The UUID of the GPU (or MIG instance) ``device`` names, whatever way it is named:
        an index in NVML's order, a UUID or a unique prefix of one; None when NVML cannot
        tell (no driver, no such device)."""
        if not self.available():
            return None
        nvml = self._nvml
        try:
            if device.isdigit():
                return _text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(int(device))))
            found = [uuid for uuid in self.uuids() if uuid.startswith(device)]
        except Exception:  # NVMLError
            return None
        return found[0] if len(found) == 1 else None

    def uuids(self) -> list[str]:
        """Every GPU's UUID, each followed by its MIG instances' ([] without a driver)."""
        nvml = self._nvml
        found = []
        for i in range(self.count()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            found += [_text(nvml.nvmlDeviceGetUUID(handle)), *self._mig_instances(handle)]
        return found

    def inventory(self) -> dict[str, Any] | None:
        """The CUDA driver's version and each GPU's name, memory and UUID, for a report
        (``{"cuda_driver": "580.95", "gpus": [...]}``); None without NVML."""
        if not self.available():
            return None
        nvml = self._nvml
        try:
            gpus = []
            for i in range(self.count()):
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                gpus.append(
                    {
                        "name": _text(nvml.nvmlDeviceGetName(handle)),
                        "memory": int(nvml.nvmlDeviceGetMemoryInfo(handle).total),
                        "uuid": _text(nvml.nvmlDeviceGetUUID(handle)),
                    }
                )
            return {"cuda_driver": _text(nvml.nvmlSystemGetDriverVersion()), "gpus": gpus}
        except Exception:  # NVMLError
            return None

    def models(self) -> set[str]:
        """The models of the GPUs NVML sees ({} without a driver)."""
        nvml = self._nvml
        try:
            return {
                _text(nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(i)))
                for i in range(self.count())
            }
        except Exception:  # NVMLError
            return set()

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

    # ---------------------------------------------------------------- health (GPU health)

    def track_errors(self, device: str) -> list[int]:
        """From now on, collect ``device``'s Xid critical errors and count its uncorrectable
        ECC errors from here (``problems`` says what came since); the Xids that came since
        the last reading (none before the first: NVML's events start at registration),
        which are no run's of this reader. Quiet where NVML cannot ([])."""
        if not self.available():
            return []
        nvml = self._nvml
        with contextlib.suppress(Exception):  # NvmlUnavailable, NOT_SUPPORTED (vGPU, MIG)
            handle = self._handle(device)
            if device not in self._events:
                events = nvml.nvmlEventSetCreate()
                try:
                    nvml.nvmlDeviceRegisterEvents(handle, XID_CRITICAL, events)
                except Exception:
                    nvml.nvmlEventSetFree(events)
                    raise
                self._events[device] = events
        before = self.xids(device)  # not this run's: judged apart (health.Health.lease)
        self._ecc[device] = self._uncorrectable(device)
        return before

    def xids(self, device: str) -> list[int]:
        """The Xid critical errors of ``device`` since the last call (``track_errors``)."""
        events, found = self._events.get(device), []
        nvml = self._nvml
        wait = getattr(nvml, "nvmlEventSetWait_v2", None) or getattr(nvml, "nvmlEventSetWait", None)
        while events is not None and wait is not None:
            try:
                event = wait(events, 0)
            except Exception:  # NVML_ERROR_TIMEOUT: none (left), or the set went bad
                break
            found.append(int(event.eventData))
        return found

    def _uncorrectable(self, device: str) -> int | None:
        nvml = self._nvml
        try:
            return int(
                nvml.nvmlDeviceGetTotalEccErrors(self._handle(device), UNCORRECTED, VOLATILE_ECC)
            )
        except Exception:  # no ECC (consumer GPUs), not supported, not in this NVML
            return None

    def problems(self, device: str) -> list[str]:
        """What NVML says is wrong with ``device`` since ``track_errors``: it does not
        answer, pages waiting to be retired or rows to be remapped (or a row that could
        not be), new uncorrectable ECC errors. Its Xids are read apart (``xids``), and
        judged by NVIDIA's catalog (``health``, ``xids``)."""
        if not self.available():
            return []
        nvml = self._nvml
        try:
            handle = self._handle(device)
        except NvmlUnavailable:  # a name NVML does not know (a UUID prefix): it cannot tell
            return []
        try:
            nvml.nvmlDeviceGetMemoryInfo(handle)
        except Exception as exc:  # GPU_IS_LOST, a device that no longer answers
            return [f"it does not answer NVML ({_nvml_reason(exc)})"]
        found = []
        with contextlib.suppress(Exception):  # not supported: no page retirement (Ampere on)
            if nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle):
                found.append("memory pages are waiting to be retired (a reset retires them)")
        with contextlib.suppress(Exception):  # not supported: no row remapping (before Ampere)
            _corrected, _uncorrected, pending, failed = nvml.nvmlDeviceGetRemappedRows(handle)
            if failed:
                found.append("a memory row could not be remapped (the GPU needs service)")
            elif pending:
                found.append("memory rows are waiting to be remapped (a reset remaps them)")
        before, now = self._ecc.get(device), self._uncorrectable(device)
        if before is not None and now is not None and now > before:
            found.append(f"{now - before} uncorrectable ECC errors")
        return found


XID_CRITICAL = 0x8  # nvmlEventTypeXidCriticalError
UNCORRECTED = 1  # NVML_MEMORY_ERROR_TYPE_UNCORRECTED
VOLATILE_ECC = 0  # NVML_VOLATILE_ECC: since the driver loaded


def _text(value: Any) -> str:
    """NVML's strings are bytes in old nvidia-ml-py releases."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml_reason(exc: Exception) -> str:
    if isinstance(exc, ImportError):
        return "nvidia-ml-py is not installed"
    text = str(exc) or type(exc).__name__
    return f"NVML: {text}"
