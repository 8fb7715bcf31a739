"""Pinned workers (``--gpu-isolate-pin-workers``): a pytest process holds its GPUs for life.

For suites that do not isolate every test: each xdist worker (or the one pytest
process without xdist) gets ``--gpu-isolate-gpus`` GPUs (default 1) from the shared
lease table for its whole life, in ``pytest_configure``, before any test module is
collected, and ``CUDA_VISIBLE_DEVICES`` is set to them, so its in-process tests see
only its GPUs. ``python -m pytest_gpuiso status`` lists each lease as "pinned worker
gw0 of pytest pid N"; other sessions' tests and pinned workers wait for them as for
any lease, so two sessions pinning the same GPUs never overbook them.

Under xdist the controller takes every worker's lease, all or none, before it starts
the workers, and hands each worker its GPUs (``workerinput``). A worker that waited
for its GPU while holding none would be safe, but a session whose first worker got
one and second waits could never end to free it: two sessions each holding half the
GPUs would wait for each other forever. So the controller takes the leases without
waiting, and when one is refused it releases those it took and tries again a little
later (each try after a random pause, up to a second); ``--gpu-isolate-lease-timeout``
bounds the whole wait, and a wait that GPU quarantines make endless (too few GPUs not
quarantined for every worker) fails in one line, as every lease does without a lease
timeout (``Leases.never_enough``). Each worker then makes its lease its own
(``_adopt``): it lives as long as the worker, not the controller, so a SIGKILLed
controller frees no GPU its workers still use (the kernel frees each with its worker).

An isolated test in a pinned worker runs under the worker's lease when it fits
(no more GPUs, no more memory on each); otherwise it leases more as usual, unless
that could never be granted while the pinned workers hold theirs: then it fails
in one line instead of waiting forever.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import pytest

from ..settings import Settings
from ..values import GpuMemory
from .devices import Devices
from .leases import Lease, LeaseError, Leases, LeaseTimeout
from .workers import gpu_slots, tests_per_gpu

PINNED = "pinned"  # the first word of a pinned worker's label in the lease table
FLAG = "--gpu-isolate-pin-workers"
WORKERINPUT = "gpuiso_pinned"  # a worker's lease, handed over by its controller


def is_controller(config: pytest.Config) -> bool:
    """xdist's main process of a distributed session (it runs no test itself)."""
    if hasattr(config, "workerinput"):
        return False
    return config.getoption("dist", "no") != "no" and bool(config.getoption("tx", None))


def problem(config: pytest.Config, settings: Settings, devices: Devices) -> str | None:
    """Why pinning cannot work in this session (one line), or None."""
    if not settings.pin_workers:
        return None
    if settings.devices == []:
        return f"{FLAG} needs GPUs to pin, but --gpu-isolate-devices is none"
    if settings.gpus == 0:
        return (
            f"{FLAG} pins --gpu-isolate-gpus GPUs to each worker, and "
            f"{settings.gpus_source} is 0: choose 1 or more"
        )
    n = settings.gpus or 1
    if devices.names and n > len(devices.names):
        return (
            f"{FLAG}: each worker would hold {n} GPUs, {len(devices.names)} available "
            f"({devices.describe()}, from {devices.source})"
        )
    if devices.names and is_controller(config):
        slots = gpu_slots(settings, devices)
        count = len(config.getoption("tx"))
        if count > slots:
            return (
                f"{FLAG}: {count} xdist workers, but only {slots} GPU slot"
                f"{'s' if slots != 1 else ''} ({len(devices.names)} GPUs from {devices.source}, "
                f"{n} per worker): the rest could never get one; use -n {slots} or -n auto"
            )
    return None


def pin(config: pytest.Config, settings: Settings, leases: Leases | None) -> list[Lease]:
    """Lease the GPUs pinning needs: this process's own (without xdist), or, in xdist's
    controller, one lease per worker (``gw0``...), all or none; [] when pinning is off
    or there are no GPUs. In a worker: nothing (its controller leased its GPUs)."""
    if not settings.pin_workers or leases is None or hasattr(config, "workerinput"):
        return []
    k = settings.gpus or 1
    if not is_controller(config):
        label = f"{PINNED} pytest pid {os.getpid()}"
        try:
            lease = leases.acquire(k, label, settings.lease_timeout, settings.gpu_memory)
        except LeaseError as exc:
            raise pytest.UsageError(f"gpu-isolate: {FLAG}: {exc}") from None
        os.environ.update(leases.child_env(lease))
        return [lease]
    count = len(config.getoption("tx"))
    labels = [f"{PINNED} worker gw{i} of pytest pid {os.getpid()}" for i in range(count)]
    start = time.monotonic()
    pause = 0.05
    per_gpu = tests_per_gpu(settings, leases.devices)
    while True:
        held: list[Lease] = []
        try:
            if settings.lease_timeout is None:  # each round: a quarantine landing meanwhile
                leases.never_enough(k, count, per_gpu)  # ends the wait too
            for label in labels:
                held.append(leases.acquire(k, label, 0.0, settings.gpu_memory))
            return held
        except LeaseTimeout:
            pass
        except LeaseError as exc:
            _release(leases, held)
            raise pytest.UsageError(f"gpu-isolate: {FLAG}: {exc}") from None
        _release(leases, held)
        waited = time.monotonic() - start
        if settings.lease_timeout is not None and waited > settings.lease_timeout:
            raise pytest.UsageError(
                f"gpu-isolate: {FLAG}: waited {waited:.1f} s for the GPUs of {count} workers "
                f"(--gpu-isolate-lease-timeout); held by: {leases.holders_text()}"
                + leases.quarantine_text()
            )
        time.sleep(pause * (0.5 + random.random()))
        pause = min(pause * 2, 1.0)


def _release(leases: Leases, held: list[Lease]) -> None:
    for lease in held:
        leases.release(lease)


def assign(pins: list[Lease], taken: dict[str, Lease], worker: str) -> dict[str, Any] | None:
    """The lease handed to ``worker`` (its ``workerinput`` entry): its own, else one no
    live worker has (a worker restarted after a crash takes the dead one's)."""
    lease = taken.get(worker)
    if lease is None:
        free = [p for p in pins if all(p is not t for t in taken.values())]
        if not free:
            return None
        lease = taken[worker] = free[0]
    return {"id": lease.lease_id, "devices": list(lease.devices), "memory": lease.memory}


def own(
    config: pytest.Config, settings: Settings, pins: list[Lease], leases: Leases | None
) -> Lease | None:
    """The pinned GPUs this process's tests run under: a worker's, handed over by its
    controller (``_adopt``); the lone pytest process's own (``pins``); none in the
    controller, which runs no test."""
    if is_controller(config):
        return None
    return _adopt(config, settings, leases) or (pins[0] if pins else None)


def _adopt(config: pytest.Config, settings: Settings, leases: Leases | None) -> Lease | None:
    """In a worker: the lease its controller took for it, made its own in the table (it
    then lives as long as the worker, whatever becomes of the controller: a SIGKILLed
    controller frees nothing its workers still use) and the GPUs this process sees. When
    that lease is no longer the controller's (a worker started in place of a crashed one
    is handed the dead worker's, which died with it), the worker leases its GPUs itself,
    waiting no longer than the lease timeout (without one, not at all: two sessions'
    replacement workers must never wait for each other's GPUs), else fails in one line."""
    given = getattr(config, "workerinput", {}).get(WORKERINPUT)
    if not given or leases is None:
        return None
    lease = Lease(given["id"], tuple(given["devices"]), 0.0, given["memory"])
    if leases.adopt(lease) != len(lease.devices):
        label = f"{PINNED} worker {config.workerinput.get('workerid', '?')} (pid {os.getpid()})"
        try:
            wait = settings.lease_timeout or 0.0
            lease = leases.acquire(settings.gpus or 1, label, wait, settings.gpu_memory)
        except LeaseError as exc:
            raise pytest.UsageError(f"gpu-isolate: {FLAG}: {exc}") from None
    os.environ.update(leases.child_env(lease))
    return lease


def within(pin: Lease | None, n: int, memory: GpuMemory | None, devices: Devices) -> Lease | None:
    """The part of the worker's pinned lease an isolated test runs under, or None when
    the test needs more GPUs, or more memory on each, than the worker holds."""
    if pin is None or n > len(pin.devices):
        return None
    names = pin.devices[:n]
    wanted = [memory.on(devices.capacity(name)) for name in names] if memory else []
    if wanted and pin.memory and not all(wanted):
        return None  # a size on a GPU of unknown memory: lease it as usual (and skip)
    if wanted and pin.memory and max(wanted) > pin.memory:
        return None
    each = min(wanted) if wanted and all(wanted) else pin.memory
    return Lease(pin.lease_id, names, 0.0, each)


def never_granted(leases: Leases, pin: Lease | None, n: int) -> str | None:
    """Why a pinned worker's request for ``n`` more GPUs could never be granted while
    the pinned workers (of every session) hold theirs, or None. A GPU any pinned worker
    holds counts as taken."""
    if pin is None:
        return None
    snapshot = leases.region.snapshot() if leases.region is not None else {"holders": []}
    pinned = {
        leases.devices.name_of(h["device"])
        for h in snapshot["holders"]
        if h["alive"] and h["label"].startswith(PINNED)
    } | set(pin.devices)
    free = [name for name in leases.devices.names if name not in pinned]
    if n <= len(free):
        return None
    others = f"{len(free)} other GPU{'s are' if len(free) != 1 else ' is'}" if free else "no other"
    return (
        f"test needs {n} GPU{'s' if n != 1 else ''}; its pinned worker holds {len(pin.devices)} "
        f"({', '.join(pin.devices)}) and {others if free else 'no other GPU is'} free of pinned "
        f"workers: it could never get them while they hold theirs (pin more per worker with "
        f"--gpu-isolate-gpus, or mark it gpus={len(pin.devices)})"
    )
