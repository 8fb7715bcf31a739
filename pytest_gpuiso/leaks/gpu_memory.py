"""Residual GPU memory and escaped GPU holders, measured from the parent through NVML.

No CUDA context is ever created here: NVML reads the driver's accounting.

* Baseline: right after the lease is taken, before the child starts: used memory
  and the set of processes on each leased GPU.
* After reaping: the driver tears a dead process's context down asynchronously,
  so the check is repeated with backoff (``BACKOFF``) until the GPU is back to
  its baseline; only what persists past the last attempt is reported:
  - a process on the GPU that was not there before and is still there: an
    escaped GPU holder. NVML's pids are compared as opaque sets, so this works
    inside containers where NVML reports host pids;
  - used memory above the baseline by more than the tolerance.
* With ``--gpu-isolate-slots`` > 1 or memory leases other tests ran on the GPU at
  the same time; the record says ``shared`` so a reader knows the numbers are not the
  test's alone.
* Peak: while the test runs, a thread samples its GPUs every ``PEAK_EVERY`` seconds and
  keeps the most memory the test's processes (its process and descendants, by NVML's
  per-process accounting) held on any of them: ``peak``, for right-sizing leases. Where
  NVML's pids are not ours (a container), the device's growth over the baseline stands
  in when the GPU was not shared; else the peak is unknown (None).

``NvmlReader`` is the only part that talks to the driver; tests replace it with
recorded samples.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..settings import DEFAULT_TOLERANCE_MIB
from . import Leak, RunInfo

MIB = 1 << 20
BACKOFF = (0.0, 0.05, 0.1, 0.2, 0.4, 0.8, 1.2)  # seconds between attempts: ~2.75 s at most
PEAK_EVERY = 0.2  # seconds between samples of the running test's GPU memory


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


@dataclass(frozen=True)
class Finding:
    device: str
    new_pids: dict[int, int]  # escaped GPU holders: pid -> bytes
    growth: int  # bytes above the baseline


def compare(before: dict[str, Sample], after: dict[str, Sample], tolerance: int) -> list[Finding]:
    """Devices that are not back to their baseline."""
    found = []
    for device, base in before.items():
        now = after[device]
        new = {pid: b for pid, b in now.processes.items() if pid not in base.processes}
        growth = now.used - base.used
        if new or growth > tolerance:
            found.append(Finding(device, new, growth))
    return found


class GpuMemoryProbe:
    """Checks the leased GPUs of one test; ``reader`` is shared by the session."""

    kind = "gpu_memory"

    def __init__(
        self,
        reader: Any,
        devices: Sequence[str],
        tolerance_mib: float = DEFAULT_TOLERANCE_MIB,
        shared: bool = False,
        backoff: Sequence[float] = BACKOFF,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.reader = reader
        self.devices = tuple(devices)
        self.tolerance = int(tolerance_mib * MIB)
        self.shared = shared
        self.backoff = tuple(backoff)
        self.sleep = sleep
        self.peak: int | None = None  # most bytes the test's processes held on one GPU
        self._base: dict[str, Sample] | None = None
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None

    def _sample_all(self) -> dict[str, Sample] | None:
        try:
            return {d: self.reader.sample(d) for d in self.devices}
        except NvmlUnavailable:
            return None

    def snapshot(self) -> dict[str, Sample] | None:
        self._base = self._sample_all()
        return self._base

    def watch(self, pid: int, every: float = PEAK_EVERY) -> None:
        """Sample the test's GPU memory while its process ``pid`` runs (until ``check``)."""
        if self._base is None or self._sampler is not None:
            return
        self._sampler = threading.Thread(
            target=self._sample_peak, args=(pid, every), name="gpuiso-peak", daemon=True
        )
        self._sampler.start()

    def _sample_peak(self, pid: int, every: float) -> None:
        import psutil

        base = self._base or {}
        while True:
            try:
                tree = {pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))}
            except psutil.Error:
                tree = {pid}
            now = self._sample_all()
            if now is not None:
                for device, sample in now.items():
                    mine = [b for p, b in sample.processes.items() if p in tree]
                    if mine:
                        used = sum(mine)
                    elif not self.shared and device in base:  # NVML pids not ours
                        used = max(sample.used - base[device].used, 0)
                    else:
                        continue
                    self.peak = max(self.peak or 0, used)
            if self._stop.wait(every):
                return

    def check(self, before: dict[str, Sample] | None, run: RunInfo) -> list[Leak]:
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join(5)
        if not before:
            return []
        findings: list[Finding] = []
        for delay in self.backoff:
            if delay:
                self.sleep(delay)
            after = self._sample_all()
            if after is None:
                return []
            findings = compare(before, after, self.tolerance)
            if not findings:
                return []
        return [leak for f in findings for leak in self._leaks(f)]

    def _leaks(self, f: Finding) -> list[Leak]:
        common: dict[str, Any] = {"device": f.device}
        note = ""
        if self.shared:
            common["shared"] = True
            note = " (the GPU was shared with other tests at the time)"
        leaks = []
        for pid, used in sorted(f.new_pids.items()):
            size = f", {used / MIB:.0f} MiB" if used else ""
            leaks.append(
                Leak(
                    "gpu_memory",
                    f"GPU {f.device}: process {pid} (NVML pid{size}) appeared on the GPU during "
                    f"the test and still holds it after the test's processes were reaped{note}",
                    {**common, "pid": pid, "bytes": used, "holder": True},
                )
            )
        # What escaped holders use is reported with them; only the rest is residual memory.
        residual = f.growth - sum(f.new_pids.values())
        if residual > self.tolerance:
            leaks.append(
                Leak(
                    "gpu_memory",
                    f"GPU {f.device}: {residual / MIB:.0f} MiB more in use than before the test "
                    f"(tolerance {self.tolerance / MIB:g} MiB){note}",
                    {**common, "bytes": residual},
                )
            )
        return leaks
