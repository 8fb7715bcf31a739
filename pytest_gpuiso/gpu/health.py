"""GPU health: a GPU a test broke is probed before anyone leases it again, and quarantined.

A fresh process per test cures a poisoned CUDA context, not a poisoned device: an
illegal memory access that left the GPU in an error state, an Xid 79 (fallen off the
bus), an uncorrectable ECC error, a kernel that keeps running after its process died.
After every isolated test that held GPUs, the Xids each GPU raised since its lease are
judged by NVIDIA's catalog (``xids``, a 0 ms NVML event wait): an application's fails
the test (on a GPU no other test shared), one that needs a reset, a reboot or service
quarantines the GPU. After a test that crashed (a signal), timed out, or failed with a
sticky CUDA error (``why_probe``), each of its GPUs is also probed while its lease is
still held (``checkup``):

1. NVML (``nvml.NvmlReader.problems``, a few ms): the device answers, no Xid that puts
   it in doubt since the lease, no pages waiting to be retired, no new uncorrectable ECC
   error; and the GPU memory leak check (when on) found neither the test's process
   still on it nor its memory still in use (a holder that is not the test's, another
   user's job, is only noted: it says nothing of the GPU, ``leaks.gpu_memory.of_test``);
2. when that passes, the CUDA driver in a fresh process (``gpu_probe``: a context, an
   allocation, a synchronise), bounded by ``PROBE_TIMEOUT``.

A GPU a part could not run on (no NVML, no CUDA driver) is "not assessed": neither
healthy nor quarantined, and said so. A GPU that fails is quarantined in the lease
table (``leases.Leases.quarantine``): no session of the user leases it until ``python -m
pytest_gpuiso reset --device N`` re-probes it and lifts it, or the session itself does
every ``--gpu-isolate-reprobe`` seconds. With ``--gpu-isolate-health=always`` the NVML
part also runs on every lease (``Health.lease``).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import subprocess
import sys
import time
from typing import Any, Protocol

from ..leaks import Leak
from ..values import GpuMemory
from . import rocm, xids
from .gpu_probe import FULL, NO_DRIVER
from .leases import LABEL_LEN, Lease, LeaseError, Leases
from .nvml import NvmlReader

PROBE_TIMEOUT = 20.0  # seconds for the driver part: a context on a healthy GPU takes < 1 s
KILL_WAIT = 5.0  # seconds a killed probe gets to end before it is left behind
NODEID_KEPT = 100  # bytes of a test's name a quarantine's reason keeps (its end)
# What a test's failure says when CUDA's error is sticky: the context (often the device)
# is unusable until the process ends, and the device may stay so after it.
STICKY = re.compile(
    r"illegal memory access|an illegal instruction|misaligned address|unspecified launch "
    r"failure|uncorrectable ECC|ECC error|device-side assert|\bXid\b|GPU is lost|fallen off "
    r"the bus|CUDA_ERROR_(?:ILLEGAL_ADDRESS|LAUNCH_FAILED|ECC_UNCORRECTABLE|ASSERT|"
    r"HARDWARE_STACK_ERROR|ILLEGAL_INSTRUCTION|MISALIGNED_ADDRESS|INVALID_PC)",
    re.IGNORECASE,
)


class RunEnd(Protocol):
    """How a test's run ended, as the health probe reads it (``parent.outcome.Outcome``)."""

    @property
    def timed_out(self) -> bool: ...

    @property
    def signal_name(self) -> str | None: ...

    errors: list[str]  # what its process said went wrong
    reports: list[dict[str, Any]]  # its serialized pytest reports
    leaks: list[Leak]


def why_probe(outcome: RunEnd) -> str | None:
    """Why a test's GPUs are probed after its run (``outcome``): it timed out, crashed, or
    failed with a sticky CUDA error (in its failure's message, or the errors its process
    said); None for anything else (an ordinary failure never puts a GPU in doubt)."""
    if outcome.timed_out:
        return "it timed out"
    if outcome.signal_name:
        return f"it crashed with {outcome.signal_name}"
    said = [*outcome.errors, *map(_failure, outcome.reports)]
    found = STICKY.search("\n".join(said))
    return f"a sticky CUDA error ({found.group(0)})" if found else None


def _failure(report: dict[str, Any]) -> str:
    """The message a failed report's exception ends with ("" for a passed or skipped one):
    not its traceback's source lines or captured output, where such words mean nothing."""
    if report.get("outcome") != "failed":
        return ""
    longrepr = report.get("longrepr")
    if isinstance(longrepr, dict):
        crash = longrepr.get("reprcrash")
        return str(crash.get("message", "")) if isinstance(crash, dict) else ""
    lines = str(longrepr or "").strip().splitlines()
    return lines[-1] if lines else ""


def driver_probe(env: dict[str, str], timeout: float = PROBE_TIMEOUT) -> str | None:
    """What the driver part (``driver_check``) found failed, or None."""
    return driver_check(env, timeout)[0]


def driver_check(
    env: dict[str, str], timeout: float = PROBE_TIMEOUT
) -> tuple[str | None, str | None]:
    """The driver part (``gpu_probe``) in a fresh process with ``env`` (the one GPU made
    visible): (what failed, why it could not tell), each None when there is nothing to
    say. It cannot tell without a CUDA driver or a process to be had; a GPU that only
    had no memory to give (full, of someone else's memory perhaps) is not broken. A probe
    stuck in the driver past ``timeout`` is killed and, if even that does not end it (a
    process in the kernel's uninterruptible sleep), left behind."""
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pytest_gpuiso.gpu.gpu_probe"],
            env={**os.environ, **env},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    except OSError as exc:  # out of processes: that says nothing of the GPU
        return None, f"no process for the CUDA driver probe ({exc.strerror or exc})"
    try:
        said, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=KILL_WAIT)
        return f"the CUDA driver probe did not finish within {timeout:g} s", None
    last = (said.strip().splitlines() or [""])[-1]
    if proc.returncode == NO_DRIVER:
        return None, last or "no CUDA driver"
    if proc.returncode in (0, FULL):
        return None, None
    return f"the CUDA driver probe failed: {last or f'exit status {proc.returncode}'}", None


def _leaked_on(device: str, leaks: list[Leak]) -> list[str]:
    """What the GPU memory leak check found still on ``device`` after the test's end."""
    found = []
    for leak in leaks:  # on a GPU shared with other tests, what it saw may be theirs
        fields = leak.fields
        if (
            leak.kind == "gpu_memory"
            and fields.get("device") == device
            and not fields.get("shared")
        ):
            if leak.fields.get("holder"):
                found.append(f"process {leak.fields['pid']} still holds it")
            else:
                found.append(f"{leak.fields['bytes'] >> 20} MiB still in use")
    return found


def examine(
    device: str, nvml: NvmlReader, env: dict[str, str], found: list[str] = ()
) -> tuple[str, str]:
    """What is wrong with ``device``: NVML's part (with the Xids NVIDIA's catalog says
    put it in doubt) and ``found``, what else is known of it; then, only when that finds
    nothing, the driver part with ``env``. Returns (what is wrong, why it could not be
    assessed): ("", "") when it is healthy; ("", why) when a part could not run (no
    NVML, no CUDA driver): not known to be healthy, nor unhealthy."""
    untold = [] if nvml.available() else [f"NVML: {nvml.error or 'unavailable'}"]
    doubts = [x.text() for x in map(xids.classify, nvml.xids(device)) if x.quarantines]
    problems = nvml.problems(device) + doubts + list(found)
    if problems:
        return "; ".join(problems), ""
    broken, cannot = driver_check(env)
    if broken:
        return broken, ""
    return "", "; ".join(untold + ([cannot] if cannot else []))


def checkup(
    devices: tuple[str, ...],
    nvml: NvmlReader,
    leaks: list[Leak],
    env_of: dict[str, dict[str, str]],
) -> tuple[dict[str, str], dict[str, str]]:
    """Probe each of ``devices`` (``env_of``: the driver probe's environment for each):
    what failed on each that is not healthy, and why each that could not be assessed
    was not ({}, {} when all are healthy)."""
    failed, unassessed = {}, {}
    for device in devices:
        problem, untold = examine(device, nvml, env_of[device], _leaked_on(device, leaks))
        if problem:
            failed[device] = problem
        elif untold:
            unassessed[device] = untold
    return failed, unassessed


def quarantine_reason(problem: str, nodeid: str, why: str) -> str:
    """The reason the lease table keeps (``LABEL_LEN`` bytes): after which test and why it
    was probed, then what failed, cut to fit (a very long test name keeps its end)."""
    if len(nodeid.encode()) > NODEID_KEPT:
        nodeid = "..." + nodeid.encode()[-NODEID_KEPT:].decode("utf-8", "ignore")
    text = f"after {nodeid} ({why}): {problem}".encode()
    if len(text) > LABEL_LEN:
        text = text[: LABEL_LEN - 3] + b"..."
    return text.decode("utf-8", "ignore")


class Health:
    """The session's side of GPU health: leases taken healthy, GPUs probed after a test
    that put them in doubt, quarantined GPUs probed again every ``reprobe`` seconds. GPUs
    named to ROCm are not probed (the probe speaks NVML and CUDA)."""

    def __init__(
        self, leases: Leases, nvml: NvmlReader, mode: str, reprobe: float | None = None
    ) -> None:
        self.leases = leases
        self.nvml = nvml
        self.mode = mode if leases.devices.via == rocm.CUDA else "off"  # settings.HEALTH_MODES
        self.reprobe = reprobe
        self._tried: dict[str, float] = {}  # device -> time.monotonic() of its last re-probe

    def lease(
        self,
        n: int,
        label: str,
        timeout: float | None,
        memory: GpuMemory | None,
        pinned: Lease | None = None,
    ) -> Lease:
        """The one way a test (or a call) gets GPUs: ``leases.acquire``, or ``pinned``, the
        part of its pinned worker's lease it runs under; then the GPUs are watched (Xid
        events, ECC counts: ``after`` says what came since). With mode "always", a GPU
        whose NVML part fails is quarantined first and the lease taken again, among the
        others (a pinned worker's test fails instead: its GPUs are its worker's). Without a
        lease timeout, a test that needs more GPUs than quarantines leave fails at once
        (``Leases.never_enough``: it would wait forever)."""
        if self.mode != "off" and pinned is None:
            self._reprobe()
        while True:
            lease = pinned or self.leases.acquire(n, label, timeout, memory)
            failed = self._admit(lease)
            if not failed:
                return lease
            for device, problem in failed.items():
                reason = quarantine_reason(problem, label, "before its lease")
                self.leases.quarantine(device, reason)
            if pinned is not None:
                found = "; ".join(f"GPU {d}: {p}" for d, p in failed.items())
                raise LeaseError(f"its pinned worker's GPUs failed NVML's check ({found})")
            self.leases.release(lease)

    def _admit(self, lease: Lease) -> dict[str, str]:
        """Watch the lease's GPUs from now on; with mode "always", what NVML finds wrong
        with each of them now (device -> problem)."""
        if self.mode == "off":
            return {}
        for device in lease.devices:
            self.nvml.track_errors(device)
        checked = lease.devices if self.mode == "always" else ()
        return {d: "; ".join(p) for d in checked if (p := self.nvml.problems(d))}

    def after(
        self, nodeid: str, lease: Lease, outcome: RunEnd, shared: bool = False
    ) -> dict[str, Any] | None:
        """Judge the Xids of the test's GPUs since its lease by NVIDIA's catalog, probe
        its GPUs when its run put them in doubt, and quarantine those that fail or had an
        Xid that needs a reset, a reboot or service (before its lease is released). What
        was found (None: no Xid, no probe): ``xids`` (each with ``fails_test``: an
        application Xid on a GPU no other test shared (``shared``) is the test's own
        failure), ``probed`` (why), ``quarantined`` and ``unassessed`` (device -> why)."""
        if self.mode == "off":
            return None
        seen = [(d, xids.classify(n)) for d in lease.devices for n in self.nvml.xids(d)]
        why = why_probe(outcome)
        if why is None and not seen:
            return None
        failed: dict[str, str] = {}
        for device, xid in seen:
            if xid.quarantines:
                failed[device] = "; ".join(filter(None, (failed.get(device), xid.text())))
        unassessed: dict[str, str] = {}
        if why is not None:
            rest = tuple(d for d in lease.devices if d not in failed)
            env_of = {device: self.leases.visible((device,)) for device in rest}
            found, unassessed = checkup(rest, self.nvml, outcome.leaks, env_of)
            failed.update(found)
        elif failed:
            why = "an Xid during it"
        for device, problem in failed.items():
            refused = self.leases.quarantine(device, quarantine_reason(problem, nodeid, why))
            if refused:
                failed[device] = f"{problem} (not quarantined: {refused})"
        checked: dict[str, Any] = {"devices": list(lease.devices), "quarantined": failed}
        if why is not None:
            checked["probed"] = why
        if unassessed:
            checked["unassessed"] = unassessed
        if seen:
            checked["xids"] = [
                {**x.entry(d), "fails_test": x.kind == xids.APPLICATION and not shared}
                for d, x in seen
            ]
        return checked

    def _reprobe(self) -> None:
        """Probe again the quarantined GPUs whose last probe is ``reprobe`` seconds old, and
        lift those that pass."""
        if self.reprobe is None:
            return
        now = time.monotonic()
        for device, entry in self.leases.quarantined().items():
            age = time.time() - entry["since_ns"] / 1e9
            if min(age, now - self._tried.get(device, -math.inf)) < self.reprobe:
                continue
            self._tried[device] = now
            if examine(device, self.nvml, self.leases.visible((device,))) == ("", ""):
                self.leases.lift(device)  # healthy, not only: could not be assessed
