"""Residual GPU memory and escaped GPU holders, measured from the parent through NVML.

No CUDA context is ever created here: NVML reads the driver's accounting.

* Baseline: right after the lease is taken, before the child starts: used memory
  and the set of processes on each leased GPU.
* After reaping: the driver tears a dead process's context down asynchronously,
  so the check is repeated with backoff (``BACKOFF``) until the GPU is back to
  its baseline; only what persists past the last attempt is reported:
  - a process on the GPU that was not there before and is still there: an
    escaped GPU holder, when it is the test's (``of_test``: its process, or a
    descendant the peak sampler or the sweep saw, the same process by its start
    time, not a later one with its pid). A holder that is not the test's (another
    user's job, a notebook) is never blamed on it: it is noted (``notes``), and its
    memory is not counted as the test's. Inside a container where NVML reports host
    pids, no holder can be shown to be the test's: all are noted;
  - used memory above the baseline by more than the tolerance.
* With ``--gpu-isolate-slots`` > 1 or memory leases other tests ran on the GPU at
  the same time; the record says ``shared`` so a reader knows the numbers are not the
  test's alone.
* Others: every process NVML showed on a leased GPU from the baseline to the last check
  that is not the test's (``others``, device -> NVML pids): NVML's Xid events carry no
  pid, so an application Xid is put on the test only where no other process was seen
  (``gpu.health.Health.after``). Where NVML's pids are not ours (a container), the test's
  own processes are among them: its Xids are then noted, never blamed.
* Peak: while the test runs, a thread samples its GPUs every ``PEAK_EVERY`` seconds and
  keeps the most memory the test's processes (its process and descendants, by NVML's
  per-process accounting) held on any of them: ``peak``, for right-sizing leases. Where
  NVML's pids are not ours (a container), the device's growth over the baseline stands
  in when the GPU was not shared; else the peak is unknown (None).

NVML is read through ``nvml.NvmlReader`` (the session's, shared with the leases);
tests replace it with recorded samples.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psutil

from ..gpu.nvml import NvmlUnavailable, Sample
from ..values import DEFAULT_TOLERANCE_MIB
from . import Leak, Probe, RunInfo

MIB = 1 << 20
BACKOFF = (0.0, 0.05, 0.1, 0.2, 0.4, 0.8, 1.2)  # seconds between attempts: ~2.75 s at most
PEAK_EVERY = 0.2  # seconds between samples of the running test's GPU memory


@dataclass(frozen=True)
class Residue:
    device: str
    new_pids: dict[int, int]  # escaped GPU holders: pid -> bytes
    growth: int  # bytes above the baseline


def compare(before: dict[str, Sample], after: dict[str, Sample], tolerance: int) -> list[Residue]:
    """Devices that are not back to their baseline."""
    found = []
    for device, base in before.items():
        now = after[device]
        new = {pid: b for pid, b in now.processes.items() if pid not in base.processes}
        growth = now.used - base.used
        if new or growth > tolerance:
            found.append(Residue(device, new, growth))
    return found


def of_test(pid: int, tree: set[tuple[int, float]], swept: frozenset[int], ended: float) -> bool:
    """Whether the GPU holder ``pid`` (NVML's) is the test's: a process the peak sampler
    saw in the test's tree (``tree``: (pid, start time)) and the same process still (or
    gone: its pid not yet anyone else's), or one the sweep found (``swept``) not started
    after the test's end (``ended``, ``time.time()``). Any other is not the test's."""
    seen = any(p == pid for p, _ in tree)
    if not seen and pid not in swept:
        return False
    try:
        created = psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:  # there but unreadable: not shown to be the test's
        return False
    return (pid, created) in tree or (pid in swept and created <= ended)


class GpuMemoryProbe(Probe):
    """Checks the leased GPUs of one test; ``reader`` is shared by the session."""

    kind = "gpu_memory"
    settles = True  # the driver frees a process's memory as the process is torn down

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
        self.tree: set[tuple[int, float]] = set()  # the test's processes seen: (pid, start)
        self.notes: list[str] = []  # GPU holders that are not the test's (not blamed)
        self.others: dict[str, set[int]] = {}  # device -> NVML pids not the test's (``check``)
        self._seen: dict[str, set[int]] = {d: set() for d in self.devices}  # NVML pids
        self._base: dict[str, Sample] | None = None
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None

    def _sample_all(self) -> dict[str, Sample] | None:
        try:
            samples = {d: self.reader.sample(d) for d in self.devices}
        except NvmlUnavailable:
            return None
        for device, sample in samples.items():
            self._seen[device].update(sample.processes)
        return samples

    def snapshot(self) -> dict[str, Sample] | None:
        self._base = self._sample_all()
        return self._base

    def during(self, pid: int, every: float = PEAK_EVERY) -> None:
        """Sample the test's GPU memory while its process ``pid`` runs (until ``check``)."""
        if self._base is None or self._sampler is not None:
            return
        self._sampler = threading.Thread(
            target=self._sample_peak, args=(pid, every), name="gpuiso-peak", daemon=True
        )
        self._sampler.start()

    def _sample_peak(self, pid: int, every: float) -> None:
        base = self._base or {}
        while True:
            try:
                top = psutil.Process(pid)
                procs = [top, *top.children(recursive=True)]
            except psutil.NoSuchProcess:  # ended (a zombie too): nothing more to sample, and
                return  # a run that never got to its check leaves no sampler behind
            except psutil.Error:
                procs = []
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    self.tree.add((p.pid, p.create_time()))
            tree = {pid, *(p.pid for p in procs)}
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
        try:
            return self._check(before, run)
        finally:  # who else NVML showed on the GPUs, the test's processes now all known
            for device, pids in self._seen.items():
                found = {
                    p for p in set(pids) if not of_test(p, self.tree, run.tree_pids, run.ended)
                }
                if found:
                    self.others[device] = found

    def _check(self, before: dict[str, Sample] | None, run: RunInfo) -> list[Leak]:
        if not before:
            return []
        findings: list[Residue] = []
        for delay in self.backoff:
            if delay:
                self.sleep(delay)
            after = self._sample_all()
            if after is None:
                return []
            findings = compare(before, after, self.tolerance)
            if not findings:
                return []
        return [leak for f in findings for leak in self._leaks(f, run)]

    def _leaks(self, f: Residue, run: RunInfo) -> list[Leak]:
        common: dict[str, Any] = {"device": f.device}
        note = ""
        if self.shared:
            common["shared"] = True
            note = " (the GPU was shared with other tests at the time)"
        leaks = []
        unsized = False  # a holder not the test's whose memory NVML does not say
        for pid, used in sorted(f.new_pids.items()):
            if not of_test(pid, self.tree, run.tree_pids, run.ended):
                unsized = unsized or not used
                held = f"holds {used / MIB:.0f} MiB" if used else "holds it"
                self.notes.append(
                    f"GPU {f.device}: pid {pid} (not this test's) {held}: noted, not blamed"
                )
                continue
            size = f", {used / MIB:.0f} MiB" if used else ""
            leaks.append(
                Leak(
                    "gpu_memory",
                    f"GPU {f.device}: process {pid} (NVML pid{size}) appeared on the GPU during "
                    f"the test and still holds it after the test's processes were reaped{note}",
                    {**common, "pid": pid, "bytes": used, "holder": True},
                )
            )
        # What the holders use (the test's, reported with them, or not the test's at all)
        # is not residual memory: only the rest is.
        residual = f.growth - sum(f.new_pids.values())
        if residual > self.tolerance and unsized:  # it may all be theirs
            self.notes.append(
                f"GPU {f.device}: {residual / MIB:.0f} MiB more in use, beside a process that "
                "is not this test's: noted, not blamed"
            )
        elif residual > self.tolerance:
            leaks.append(
                Leak(
                    "gpu_memory",
                    f"GPU {f.device}: {residual / MIB:.0f} MiB more in use than before the test "
                    f"(tolerance {self.tolerance / MIB:g} MiB){note}",
                    {**common, "bytes": residual},
                )
            )
        return leaks


def left_on_gpus(leaks: Sequence[Leak]) -> dict[str, list[str]]:
    """Device -> what the GPU memory check found still on it after the test's end (what
    health probes judge a GPU by, as plain text): a process of the test's holding it, or
    memory still in use. On a GPU shared with other tests, what it saw may be theirs:
    not counted."""
    left: dict[str, list[str]] = {}
    for leak in leaks:
        fields = leak.fields
        if leak.kind != "gpu_memory" or fields.get("shared") or "device" not in fields:
            continue
        if fields.get("holder"):
            text = f"process {fields['pid']} still holds it"
        else:
            text = f"{fields['bytes'] >> 20} MiB still in use"
        left.setdefault(str(fields["device"]), []).append(text)
    return left
