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
every ``--gpu-isolate-reprobe`` seconds. A quarantine the driver part decided (its
reason's problem is the driver probe's, ``judged_by_driver``) is lifted by a passing
driver part alone where NVML cannot be loaded; any other needs NVML's part to pass too.

Xids that came while none of the session's tests held a GPU (an in-process test, another
user's job, a late report of the driver) are read at its next lease: one that needs a
reset, a reboot or service quarantines the GPU "between tests" (``between_reason``) and
the lease is taken among the others (``Health.lease``). With ``--gpu-isolate-health=always``
the NVML part also runs on every lease.

An application Xid fails the test only when it can be the test's alone: no other test
could use the GPU beside it (``shared``), and NVML showed no process on the GPU during the
test that was not the test's (``others``: NVML's Xid events carry no pid, the GPU's
process list is what says who else could have raised it).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..values import GpuMemory
from . import rocm, xids
from .gpu_probe import FULL, NO_DRIVER
from .leases import LABEL_LEN, Lease, LeaseError, Leases
from .nvml import NvmlReader

PROBE_TIMEOUT = 20.0  # seconds for the driver part: a context on a healthy GPU takes < 1 s
KILL_WAIT = 5.0  # seconds a killed probe gets to end before it is left behind
NODEID_KEPT = 100  # bytes of a test's name a quarantine's reason keeps (its end)
DRIVER_PART = "the CUDA driver probe "  # how every problem the driver part finds begins
# What a test's failure says when CUDA's error is sticky: the context (often the device)
# is unusable until the process ends, and the device may stay so after it.
STICKY = re.compile(
    r"illegal memory access|an illegal instruction|misaligned address|unspecified launch "
    r"failure|uncorrectable ECC|ECC error|device-side assert|\bXid\b|GPU is lost|fallen off "
    r"the bus|CUDA_ERROR_(?:ILLEGAL_ADDRESS|LAUNCH_FAILED|ECC_UNCORRECTABLE|ASSERT|"
    r"HARDWARE_STACK_ERROR|ILLEGAL_INSTRUCTION|MISALIGNED_ADDRESS|INVALID_PC)",
    re.IGNORECASE,
)


@dataclass
class Checkup:
    """What ``Health.after`` found of a test's GPUs: each device's quarantine (why),
    why they were probed (None: they were not), which could not be assessed (why), what
    their lease found between tests, and the Xids they raised, judged."""

    devices: list[str]
    quarantined: dict[str, str]
    probed: str | None = None
    unassessed: dict[str, str] = field(default_factory=dict)
    between_tests: dict[str, Any] = field(default_factory=dict)
    xids: list[dict[str, Any]] = field(default_factory=list)

    def as_record(self) -> dict[str, Any]:
        """The record's ``gpu_health`` (docs/json-report.md): empty parts left out."""
        parts = ("probed", "unassessed", "between_tests", "xids")
        record = {"devices": self.devices, "quarantined": self.quarantined}
        return record | {part: getattr(self, part) for part in parts if getattr(self, part)}


@dataclass(frozen=True)
class RunEnd:
    """How a test's run ended, as the health probe reads it (pytest's side makes it from
    the run's outcome: ``parent.outcome.Outcome.run_end``)."""

    timed_out: bool  # a bound ran out and its process was stopped
    signal_name: str | None  # the signal that ended its process, if one did
    errors: list[str]  # what its process said went wrong
    reports: list[dict[str, Any]]  # its serialized pytest reports
    gpu_left: Mapping[str, list[str]]  # device -> what the GPU memory check found on it


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
        return f"{DRIVER_PART}did not finish within {timeout:g} s", None
    last = (said.strip().splitlines() or [""])[-1]
    if proc.returncode == NO_DRIVER:
        return None, last or "no CUDA driver"
    if proc.returncode in (0, FULL):
        return None, None
    return f"{DRIVER_PART}failed: {last or f'exit status {proc.returncode}'}", None


def examine(
    device: str,
    nvml: NvmlReader,
    env: dict[str, str],
    found: list[str] = (),
    driver_cause: bool = False,
) -> tuple[str, str]:
    """What is wrong with ``device``: NVML's part (with the Xids NVIDIA's catalog says
    put it in doubt) and ``found``, what else is known of it; then, only when that finds
    nothing, the driver part with ``env``. Returns (what is wrong, why it could not be
    assessed): ("", "") when it is healthy; ("", why) when a part could not run (no
    NVML, no CUDA driver): not known to be healthy, nor unhealthy. ``driver_cause``: the
    doubt is one the driver part judges (``judged_by_driver``), so NVML's absence leaves
    nothing of it untold."""
    untold = [] if nvml.available() or driver_cause else [f"NVML: {nvml.error or 'unavailable'}"]
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
    left: Mapping[str, list[str]],
    env_of: dict[str, dict[str, str]],
) -> tuple[dict[str, str], dict[str, str]]:
    """Probe each of ``devices`` (``left``: what the test left on each, ``RunEnd.gpu_left``;
    ``env_of``: the driver probe's environment for each): what failed on each that is not
    healthy, and why each that could not be assessed was not ({}, {} when all are
    healthy)."""
    failed, unassessed = {}, {}
    for device in devices:
        problem, untold = examine(device, nvml, env_of[device], left.get(device, []))
        if problem:
            failed[device] = problem
        elif untold:
            unassessed[device] = untold
    return failed, unassessed


def quarantine_reason(problem: str, nodeid: str, why: str) -> str:
    """The reason the lease table keeps (``LABEL_LEN`` bytes): after which test and why it
    was probed, then what failed, cut to fit (a very long test name keeps its end)."""
    return _fit(f"after {_named(nodeid)} ({why}): {problem}")


def between_reason(problem: str, nodeid: str) -> str:
    """The reason of a quarantine for what came while none of the session's tests held
    the GPU (``nodeid``: the test whose lease found it, which it is not put on)."""
    return _fit(f"between tests (found at the lease of {_named(nodeid)}): {problem}")


def judged_by_driver(reason: str) -> bool:
    """Whether a quarantine's ``reason`` (``quarantine_reason``, ``between_reason``) is a
    problem the driver part found: its problem follows the first "): ", which a test's
    name in it never holds (``_named``)."""
    _, sep, problem = reason.partition("): ")
    return bool(sep) and problem.startswith(DRIVER_PART)


def _named(nodeid: str) -> str:
    """A test's name as a reason holds it: its end when very long, and never "): " (which
    ends the reason's "why" part)."""
    if len(nodeid.encode()) > NODEID_KEPT:
        nodeid = "..." + nodeid.encode()[-NODEID_KEPT:].decode("utf-8", "ignore")
    return nodeid.replace("): ", ") : ")


def _fit(text: str) -> str:
    """``text`` cut to what the lease table keeps of a reason."""
    data = text.encode()
    if len(data) > LABEL_LEN:
        data = data[: LABEL_LEN - 3] + b"..."
    return data.decode("utf-8", "ignore")


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
        self._between: dict[int, dict[str, str]] = {}  # lease id -> what its lease found

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
        events, ECC counts: ``after`` says what came since). A GPU found in doubt at the
        lease (``_admit``: an Xid between tests; with mode "always", NVML's part) is
        quarantined "between tests" first and the lease taken again, among the others (a
        pinned worker's test fails instead: its GPUs are its worker's). Without a lease
        timeout, a test that needs more GPUs than quarantines leave fails at once
        (``Leases.never_enough``: it would wait forever)."""
        if self.mode != "off" and pinned is None:
            quarantined = self.leases.quarantined()
            self._reprobe(quarantined)
            for device in quarantined:  # what came before (or during) a GPU's quarantine is
                self.nvml.xids(device)  # the quarantine's: never judged at a later lease
        between: dict[str, str] = {}
        while True:
            lease = pinned or self.leases.acquire(n, label, timeout, memory)
            failed = self._admit(lease)
            if not failed:
                if between:  # said in the record of the test whose lease found it
                    self._between[lease.lease_id] = between
                return lease
            for device, problem in failed.items():
                refused = self.leases.quarantine(device, between_reason(problem, label))
                if refused:  # taken again, it would be found again: never leased in doubt
                    if pinned is None:
                        self.leases.release(lease)
                    raise LeaseError(f"GPU {device} is in doubt ({problem}): {refused}")
                between[device] = problem
            if pinned is not None:
                found = "; ".join(f"GPU {d}: {p}" for d, p in failed.items())
                raise LeaseError(f"its pinned worker's GPUs are in doubt ({found})")
            self.leases.release(lease)

    def _admit(self, lease: Lease) -> dict[str, str]:
        """Watch the lease's GPUs from now on; what puts each in doubt now (device ->
        problem): the Xids it raised since the session last read it (none before its
        first lease: NVML keeps no past) that NVIDIA's catalog says need a reset, a
        reboot or service (an application's says nothing of the GPU, and is no test's
        of this session); with mode "always", what NVML's part finds wrong."""
        if self.mode == "off":
            return {}
        found = {}
        for device in lease.devices:
            came = map(xids.classify, self.nvml.track_errors(device))
            doubts = [xid.text() for xid in came if xid.quarantines]
            if self.mode == "always":
                doubts += self.nvml.problems(device)
            if doubts:
                found[device] = "; ".join(doubts)
        return found

    def after(
        self,
        nodeid: str,
        lease: Lease,
        outcome: RunEnd,
        shared: bool = False,
        others: Mapping[str, Collection[int]] | None = None,
    ) -> Checkup | None:
        """Judge the Xids of the test's GPUs since its lease by NVIDIA's catalog, probe
        its GPUs when its run put them in doubt, and quarantine those that fail or had an
        Xid that needs a reset, a reboot or service (before its lease is released). What
        was found (None: nothing): ``xids`` (each with ``fails_test``: an application Xid
        is the test's own failure on a GPU no other test shared (``shared``) where NVML
        showed no process that was not the test's (``others``: device -> NVML pids, then
        in ``other_pids``)), ``probed`` (why), ``quarantined`` and ``unassessed`` (device
        -> why), ``between_tests`` (device -> what its lease found and quarantined)."""
        if self.mode == "off":
            return None
        between = self._between.pop(lease.lease_id, {})
        seen = [(d, xids.classify(n)) for d in lease.devices for n in self.nvml.xids(d)]
        why = why_probe(outcome)
        if why is None and not seen and not between:
            return None
        failed: dict[str, str] = {}
        for device, xid in seen:
            if xid.quarantines:
                failed[device] = "; ".join(filter(None, (failed.get(device), xid.text())))
        unassessed: dict[str, str] = {}
        if why is not None:
            rest = tuple(d for d in lease.devices if d not in failed)
            env_of = {device: self.leases.visible((device,)) for device in rest}
            found, unassessed = checkup(rest, self.nvml, outcome.gpu_left, env_of)
            failed.update(found)
        elif failed:
            why = "an Xid during it"
        for device, problem in failed.items():
            refused = self.leases.quarantine(device, quarantine_reason(problem, nodeid, why))
            if refused:
                failed[device] = f"{problem} (not quarantined: {refused})"
        return Checkup(
            devices=list(lease.devices),
            quarantined=failed,
            probed=why,
            unassessed=unassessed,
            between_tests=between,
            xids=[x.judged(d, shared, (others or {}).get(d, ())) for d, x in seen],
        )

    def _reprobe(self, quarantined: dict[str, dict[str, Any]]) -> None:
        """Probe again the ``quarantined`` GPUs whose last probe is ``reprobe`` seconds old,
        and lift those that pass."""
        if self.reprobe is None:
            return
        now = time.monotonic()
        for device, entry in quarantined.items():
            age = time.time() - entry["since_ns"] / 1e9
            if min(age, now - self._tried.get(device, -math.inf)) < self.reprobe:
                continue
            self._tried[device] = now
            env = self.leases.visible((device,))
            driver_cause = judged_by_driver(entry["why"])
            if examine(device, self.nvml, env, driver_cause=driver_cause) == ("", ""):
                self.leases.lift(device)  # healthy, not only: could not be assessed
