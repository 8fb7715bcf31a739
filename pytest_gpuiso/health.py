"""GPU health: a GPU a test broke is probed before anyone leases it again, and quarantined.

A fresh process per test cures a poisoned CUDA context, not a poisoned device: an
illegal memory access that left the GPU in an error state, an Xid 79 (fallen off the
bus), an uncorrectable ECC error, a kernel that keeps running after its process died.
After an isolated test that held GPUs crashed (a signal), timed out, or failed with a
sticky CUDA error (``why_probe``), each of its GPUs is probed while its lease is still
held (``checkup``):

1. NVML (``nvml.NvmlReader.problems``, a few ms): the device answers, no Xid critical
   error since the lease, no pages waiting to be retired, no new uncorrectable ECC
   error; and the GPU memory leak check (when on) found neither the test's process
   still on it nor its memory still in use;
2. when that passes, the CUDA driver in a fresh process (``gpu_probe``: a context, an
   allocation, a synchronise), bounded by ``PROBE_TIMEOUT``.

A GPU that fails is quarantined in the lease table (``leases.Leases.quarantine``): no
session of the user leases it until ``python -m pytest_gpuiso reset --device N``
re-probes it and lifts it, or the session itself does every ``--gpu-isolate-reprobe``
seconds. With ``--gpu-isolate-health=always`` the NVML part also runs on every lease
(``Health.lease``).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from typing import Any

from .leaks import Leak
from .leases import Lease, Leases, visible_env
from .nvml import NvmlReader
from .settings import GpuMemory

PROBE_TIMEOUT = 20.0  # seconds for the driver part: a context on a healthy GPU takes < 1 s
# What a test's failure says when CUDA's error is sticky: the context (often the device)
# is unusable until the process ends, and the device may stay so after it.
STICKY = re.compile(
    r"illegal memory access|an illegal instruction|misaligned address|unspecified launch "
    r"failure|uncorrectable ECC|ECC error|device-side assert|\bXid\b|GPU is lost|fallen off "
    r"the bus|CUDA_ERROR_(?:ILLEGAL_ADDRESS|LAUNCH_FAILED|ECC_UNCORRECTABLE|ASSERT|"
    r"HARDWARE_STACK_ERROR|ILLEGAL_INSTRUCTION|MISALIGNED_ADDRESS|INVALID_PC)",
    re.IGNORECASE,
)


def why_probe(outcome: Any) -> str | None:
    """Why a test's GPUs are probed after its run (``outcome``): it crashed, timed out, or
    its reports or errors carry a sticky CUDA error; None for anything else (an ordinary
    failure never puts a GPU in doubt)."""
    if outcome.signal_name:
        return f"it crashed with {outcome.signal_name}"
    if outcome.timed_out:
        return "it timed out"
    said = json.dumps([outcome.reports, outcome.errors], default=str)
    found = STICKY.search(said)
    return f"a sticky CUDA error ({found.group(0)})" if found else None


def driver_probe(env: dict[str, str], timeout: float = PROBE_TIMEOUT) -> str | None:
    """The driver part (``gpu_probe``) in a fresh process with ``env`` (the one GPU made
    visible); what failed, or None."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pytest_gpuiso.gpu_probe"],
            env={**os.environ, **env},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return f"the CUDA driver probe did not finish within {timeout:g} s"
    except OSError:  # out of processes: that says nothing of the GPU
        return None
    if done.returncode == 0:
        return None
    said = (done.stdout.strip().splitlines() or done.stderr.strip().splitlines() or [""])[-1]
    return f"the CUDA driver probe failed: {said or f'exit status {done.returncode}'}"


def _leaked_on(device: str, leaks: list[Leak]) -> list[str]:
    """What the GPU memory leak check found still on ``device`` after the test's end."""
    found = []
    for leak in leaks:
        if leak.kind == "gpu_memory" and leak.fields.get("device") == device:
            if leak.fields.get("holder"):
                found.append(f"process {leak.fields['pid']} still holds it")
            else:
                found.append(f"{leak.fields['bytes'] >> 20} MiB still in use")
    return found


def checkup(
    devices: tuple[str, ...],
    nvml: NvmlReader,
    leaks: list[Leak],
    env_of: dict[str, dict[str, str]],
    *,
    driver: bool = True,
) -> dict[str, str]:
    """Probe each of ``devices`` (``env_of``: the driver probe's environment for each);
    what failed on each that is not healthy ({} when all are)."""
    failed = {}
    for device in devices:
        problems = nvml.problems(device) + _leaked_on(device, leaks)
        if not problems and driver:
            broken = driver_probe(env_of[device])
            problems = [broken] if broken else []
        if problems:
            failed[device] = "; ".join(problems)
    return failed


def quarantine_reason(problem: str, nodeid: str, why: str) -> str:
    """The reason the lease table keeps: what failed, after which test and why it was
    probed; cut to what the table holds, the test's name last."""
    return f"{problem} (probed after {nodeid}: {why})"


class Health:
    """The session's side of GPU health: leases taken healthy, GPUs probed after a test
    that put them in doubt, quarantined GPUs probed again every ``reprobe`` seconds."""

    def __init__(
        self, leases: Leases, nvml: NvmlReader, mode: str, via: str, reprobe: float | None = None
    ) -> None:
        self.leases = leases
        self.nvml = nvml
        self.mode = mode  # settings.HEALTH_MODES
        self.via = via  # how the GPUs are named to CUDA (CUDA_VISIBLE_DEVICES or ROCm's)
        self.reprobe = reprobe
        self._tried: dict[str, float] = {}  # device -> time.monotonic() of its last re-probe

    def _env(self, device: str) -> dict[str, str]:
        return visible_env((device,), self.via)

    def lease(self, n: int, label: str, timeout: float | None, memory: GpuMemory | None) -> Lease:
        """``leases.acquire``, then watch the GPUs (Xid events, ECC counts: ``after`` says
        what came since). With mode "always", a GPU whose NVML part fails is quarantined
        first and the lease taken again, among the others."""
        self._reprobe()
        while True:
            lease = self.leases.acquire(n, label, timeout, memory)
            if self.mode == "off":
                return lease
            for device in lease.devices:
                self.nvml.watch(device)
            found = (
                {d: self.nvml.problems(d) for d in lease.devices} if self.mode == "always" else {}
            )
            failed = {d: "; ".join(p) for d, p in found.items() if p}
            if not failed:
                return lease
            for device, problem in failed.items():
                why = quarantine_reason(problem, label, "before its lease")
                self.leases.quarantine(device, why)
            self.leases.release(lease)

    def after(self, nodeid: str, lease: Lease, outcome: Any) -> dict[str, Any] | None:
        """Probe the test's GPUs when its run put them in doubt, and quarantine those that
        fail (before its lease is released); what was probed and why (None: not probed)."""
        why = None if self.mode == "off" else why_probe(outcome)
        if why is None:
            return None
        env_of = {device: self._env(device) for device in lease.devices}
        failed = checkup(lease.devices, self.nvml, outcome.leaks, env_of)
        for device, problem in failed.items():
            self.leases.quarantine(device, quarantine_reason(problem, nodeid, why))
        return {"probed": why, "devices": list(lease.devices), "quarantined": failed}

    def _reprobe(self) -> None:
        """Probe again the quarantined GPUs whose last probe is ``reprobe`` seconds old, and
        lift those that pass."""
        if self.reprobe is None or self.mode == "off":
            return
        now = time.monotonic()
        for device, entry in self.leases.quarantined().items():
            age = time.time() - entry["since_ns"] / 1e9
            if min(age, now - self._tried.get(device, -math.inf)) < self.reprobe:
                continue
            self._tried[device] = now
            problems = self.nvml.problems(device)
            if not problems and driver_probe(self._env(device)) is None:
                self.leases.lift(device)
