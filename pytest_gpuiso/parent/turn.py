"""What one test's run holds until it ends: its processes, its lease, its port.

The runner fills a ``Turn`` as the test's run goes (its process started, then running;
a distributed test's ranks, each its own); ``release`` gives back what is left, its
processes first: killed and reaped where their run never got to ``wait``, then the lease
(unless its pinned worker's) and the port. ``pinned_part``: the part of a pinned worker's
GPUs a test runs under; ``probes_for``: the leak probes of one process of the test,
besides the process sweep.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..gpu import pinning
from ..gpu.leases import Lease
from ..gpu.ports import PortLease
from ..leaks import Probe
from ..leaks.gpu_memory import GpuMemoryProbe
from ..leaks.shm import ShmProbe
from ..values import GpuMemory
from .plans import Plan
from .session import State
from .started import Started
from .supervisor import Running
from .watch import Bounds
from .worker import Worker


class CannotRun(Exception):
    """Why a test's process cannot run: its setup error (a bad marker, a lease refused)."""


@dataclass
class Turn:
    """What one test's run holds until it ends (see the module's docstring)."""

    started: Started | None = None
    running: Running | None = None
    lease: Lease | None = None
    owned: bool = True  # the lease is the test's own (not its pinned worker's)
    port: PortLease | None = None
    probes: tuple[Probe, ...] = ()
    env: dict[str, str] = field(default_factory=dict)  # its process's, with its go
    ranks: list[Started | Running] = field(default_factory=list)  # a distributed test's

    def go(self, worker: Worker, bounds: Bounds) -> Running:
        """Give its process its go: from now on the process is its run's."""
        self.running = worker.go(self.started, self.env, self.probes, bounds)
        self.started = None
        return self.running

    def release(self, worker: Worker) -> None:
        for process in [self.running, self.started, *self.ranks]:
            if isinstance(process, Running) and not process.waited:
                worker.discard(process.started)  # before its lease goes
            elif isinstance(process, Started):
                worker.discard(process)
        self.running, self.started, self.ranks = None, None, []
        if self.lease is not None and self.owned:
            worker.gpus.leases.release(self.lease)
            self.owned = False
        if self.port is not None:
            self.port.release()
            self.port = None


def pinned_part(worker: Worker, n: int, memory: GpuMemory | None) -> Lease | None:
    """The part of the worker's pinned GPUs (--gpu-isolate-pin-workers) a test needing
    ``n`` runs under (a distributed test: all its ranks' together); None: it leases its
    own; ``CannotRun`` where it could never get them while the pinned workers hold theirs."""
    gpus = worker.gpus
    pinned = pinning.within(gpus.pin, n, memory, gpus.devices)
    never = pinning.never_granted(gpus.leases, gpus.pin, n) if pinned is None else None
    if never is not None:
        raise CannotRun(never)
    return pinned


def probes_for(
    plan: Plan, state: State, worker: Worker, lease: Lease | None, *, alone: bool = True
) -> tuple[Probe, ...]:
    """The leak probes of one process of a test, besides the process sweep (which always
    runs); ``lease``: the GPUs whose memory it checks (None: none); ``alone``: no other
    process of the test runs beside it (a distributed test's ranks: each has its own)."""
    s, nvml, spec = worker.settings, worker.gpus.nvml, plan.spec
    probes: list[Probe] = []
    if s.leak_level("shm") != "off":
        cleanup = s.cleanup and "shm" not in spec.allow_leaks
        alone = alone and not state.parallel
        probes.append(ShmProbe(s.shm_ignore, cleanup=cleanup, alone=alone))
    if lease is not None and s.leak_level("gpu_memory") != "off" and nvml.available():
        tolerance = s.gpu_tolerance_mib
        probes.append(GpuMemoryProbe(nvml, lease.devices, tolerance, shared=plan.shared))
    return tuple(probes)
