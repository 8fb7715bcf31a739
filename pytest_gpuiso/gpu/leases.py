"""GPU leases over the native table (native/gpuiso_lease.c).

The pytest process (the xdist worker under xdist) takes a test's lease before
starting its child and releases it after the child is reaped, so a crashing or
killed child can never strand a GPU. The table is shared by every pytest
process of the user on the machine.

The devices come from ``devices.discover`` (never a CUDA context here). A test
leases an amount of each GPU's memory (``gpu_memory``, else 1/slots of the GPU),
and tests share a GPU while their leases fit.
"""

from __future__ import annotations

import errno
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from ..proc.workdir import EXHAUSTED, user_name
from ..values import WHOLE, GpuMemory, size_text
from ..wire.environment import LEASE_ID_ENV, LEASED_ENV, MEMORY_ENV, REGION_ENV, VIA_ENV
from . import rocm
from .devices import Devices

CHOOSE_PATH = f"choose another path with {REGION_ENV}=PATH"


def region_path() -> str:
    """The user's lease table: ``/dev/shm/pytest-gpuiso-leases-<uid>`` (0600)."""
    if os.environ.get(REGION_ENV):
        return os.environ[REGION_ENV]
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"pytest-gpuiso-leases-{os.getuid()}")


def open_region(path: str | None = None) -> Any:
    """Attach to (or create) the table; ``RegionError`` with one line naming the problem."""
    from .._lease import Region, RegionError

    path = path or region_path()
    try:
        return Region(path)
    except RegionError as exc:
        error = RegionError(_explain(exc, path))
        error.errno = getattr(exc, "errno", 0)
        raise error from None


def foreign_owner(path: str) -> str | None:
    """The owner of ``path`` ("user NAME (uid N)") when it exists and is not ours, else None."""
    try:
        uid = os.lstat(path).st_uid
    except OSError:
        return None
    return None if uid == os.geteuid() else user_name(uid)


def _explain(exc: Exception, path: str) -> str:
    """The native message, or what to do about a name taken by another user or a full disk."""
    owner = foreign_owner(path)
    if owner is not None:
        return f"lease table {path} belongs to {owner}, not to uid {os.geteuid()}: {CHOOSE_PATH}"
    if getattr(exc, "errno", 0) == errno.ENOSPC:
        where = os.path.dirname(path) or "."
        return (
            f"cannot create the lease table {path}: no space left in {where} (it needs "
            f"{_region_size() // 1024} KiB); free some space there or {CHOOSE_PATH}"
        )
    return str(exc)


def _region_size() -> int:
    from .._lease import REGION_SIZE

    return int(REGION_SIZE)


def held_lease(environ: dict[str, str] | os._Environ) -> list[str] | None:
    """The GPUs this process's test holds (``LEASED_ENV``), when a live holder of the
    table holds them under ``LEASE_ID_ENV``'s lease; None when there is no such lease: a
    ``PYTEST_GPUISO_LEASED`` exported outside any test grants nothing."""
    names = [name for name in environ.get(LEASED_ENV, "").split(",") if name]
    lease_id = environ.get(LEASE_ID_ENV, "")
    if LEASED_ENV not in environ or (names and not lease_id.isdigit()):
        return None
    if not names:
        return []  # inside a test that leased none
    try:
        holders = open_region().snapshot()["holders"]
    except Exception:  # RegionError: no table to vouch for it
        return None
    # the table keys GPUs by identity (UUIDs), the test names them: the lease id vouches
    mine = [h for h in holders if h["alive"] and h["lease"] == int(lease_id)]
    return names if len(mine) >= len(names) else None


@dataclass(frozen=True)
class Lease:
    lease_id: int
    devices: tuple[str, ...]
    waited: float  # seconds spent waiting (not charged to the test's timeout)
    memory: int = 0  # bytes it may use on each of its GPUs (0: the devices' size is unknown)


class LeaseError(Exception):
    """A lease could not be had: the one-line message says why (fails the test's setup)."""


class LeaseTimeout(LeaseError):
    """Waited longer than the lease timeout; the message names the holders."""


def visible_env(devices: tuple[str, ...] | list[str], via: str | None = None) -> dict[str, str]:
    """Environment of a child that may use exactly ``devices`` (and no other GPU), named
    through ``via`` (default: what this process's own lease was named through)."""
    via = via or os.environ.get(VIA_ENV, rocm.CUDA)
    env = {**rocm.visible(devices, via), LEASED_ENV: ",".join(devices)}
    return env if via == rocm.CUDA else {**env, VIA_ENV: via}


class Leases:
    """This process's view of the shared table for one set of devices."""

    def __init__(self, devices: Devices, slots: int, path: str | None = None) -> None:
        """Attach to the table: ``RegionError`` when it is not usable (another user's, of
        another version), except when the system is out of a resource (a full /dev/shm):
        then every lease tries again, and fails its test with the reason until it works."""
        self.devices = devices
        self.slots = slots
        self.path = path
        self.region: Any = None
        self._unreleased: list[int] = []  # lease ids a stuck table lock kept us from releasing
        self._attach(exhausted_ok=True)

    def _attach(self, exhausted_ok: bool = False) -> Any:
        from .._lease import RegionError

        if self.region is not None and self.region.unlinked:  # reset --force: the new table
            self.region, self._unreleased = None, []  # (leases of the old one went with it)
        if self.region is None:
            try:
                self.region = open_region(self.path)
            except RegionError as exc:
                if not (exhausted_ok and getattr(exc, "errno", 0) in EXHAUSTED):
                    raise
        return self.region

    def acquire(
        self, n: int, label: str, timeout: float | None, memory: GpuMemory | None = None
    ) -> Lease:
        """``n`` GPUs with ``memory`` on each (None: 1/slots of each); ``LeaseTimeout``
        after ``timeout`` seconds, ``LeaseError`` when the table refuses."""
        from .._lease import RegionError

        label = label.encode("utf-8", "replace").decode()  # a nodeid may hold surrogates
        if timeout is None:  # a wait no quarantine could ever end is a failure at once
            self.never_enough(n)
        start = time.monotonic()
        memory = memory or GpuMemory(f"1/{self.slots}", share=WHOLE // self.slots)
        how: dict[str, Any] = {"capacities": self.devices.sizes()}
        how.update({"amount": memory.size} if memory.size else {"share": memory.share})
        try:
            region = self._attach()
            self._release_pending()
            try:
                got = region.acquire(self.devices.rows(), self.slots, n, label, timeout, **how)
            except RegionError:
                if not region.unlinked:
                    raise
                left = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
                region = self._attach()  # deleted while it waited: wait in the new table
                got = region.acquire(self.devices.rows(), self.slots, n, label, left, **how)
        except RegionError as exc:
            hint = " (--gpu-isolate-devices)" if "this session says" in str(exc) else ""
            raise LeaseError(f"{exc}{hint}") from None
        waited = time.monotonic() - start
        if got is None:
            raise LeaseTimeout(
                f"waited {waited:.1f} s for {n} GPU{'s' if n != 1 else ''} of "
                f"{', '.join(self.devices.names)} (--gpu-isolate-lease-timeout); held by: "
                + (self.holders_text() or "nobody (the queue ahead was still being served)")
                + self.quarantine_text()
            )
        lease_id, rows = got
        names = [self.devices.name_of(row) or row for row in rows]
        each = [memory.on(self.devices.capacity(name)) for name in names]
        return Lease(lease_id, tuple(names), waited, min(each) if all(each) else 0)

    def release(self, lease: Lease) -> None:
        """Release, or (the table's lock held by a stopped process) release at the next
        acquire, which then fails naming that process if it is still stopped."""
        self._unreleased.append(lease.lease_id)
        self._release_pending(quiet=True)

    def _release_pending(self, quiet: bool = False) -> None:
        from .._lease import RegionError

        while self._unreleased:
            try:
                self.region.release(self._unreleased[0])
            except RegionError:
                if quiet:
                    return
                raise
            self._unreleased.pop(0)

    def adopt(self, lease: Lease) -> int:
        """Make ``lease``, held by this process's parent, this process's own (it then ends
        with this process, not the parent); how many of its GPUs were taken over (0 when
        the parent holds none of it any more, or the table cannot be used)."""
        from .._lease import RegionError

        try:
            return int(self._attach().adopt(lease.lease_id))
        except RegionError:
            return 0

    def quarantine(self, device: str, why: str) -> str | None:
        """No session of the user leases ``device`` until it is lifted (``lift``); why it
        could not be quarantined (a table reset meanwhile, its lock held), or None."""
        from .._lease import RegionError

        why = why.encode("utf-8", "replace").decode()  # a nodeid may hold surrogates
        try:
            self._attach().quarantine(self.devices.key(device), why)
        except (KeyError, RegionError) as exc:
            return str(exc).strip("'\"")
        return None

    def lift(self, device: str) -> bool:
        """Lease ``device`` again; whether it was quarantined."""
        return bool(self._attach().lift(self.devices.key(device)))

    def quarantined(self) -> dict[str, dict[str, Any]]:
        """This session's quarantined devices: name -> {since_ns, why}."""
        from .._lease import RegionError

        try:
            found = self._attach().quarantined()
        except RegionError:
            return {}
        named = {self.devices.name_of(q["device"]): q for q in found}
        return {name: q for name, q in named.items() if name is not None}

    def never_enough(self, n: int, wanted: int = 1, per_gpu: int = 1) -> None:
        """``LeaseError`` naming the quarantined GPUs when ``wanted`` leases of ``n`` GPUs
        each (``per_gpu`` of them fit on one GPU) cannot all be had from the GPUs that are
        not quarantined: every way to a lease (a test's, a call's, a pinned worker's, with
        or without health checks) fails in one line instead of waiting for a lift."""
        quarantined = self.quarantined()
        names = self.devices.names
        healthy = len(names) - len(quarantined)
        if not quarantined or (healthy >= n and wanted <= healthy * per_gpu // n):
            return
        each = f"{n} GPU{'s' if n != 1 else ''}"
        asked = each if wanted == 1 else f"{wanted} pinned workers of {each} each"
        raise LeaseError(
            f"{asked} wanted, {healthy} of {len(names)} healthy" + self.quarantine_text()
        )

    def quarantine_text(self) -> str:
        """ "; quarantined: GPU 1 (why); ..." for a lease that could not be had, or ""."""
        found = self.quarantined()
        if not found:
            return ""
        which = "; ".join(f"GPU {name} ({q['why']})" for name, q in sorted(found.items()))
        first = sorted(found, key=lambda name: (len(name), name))[0]
        lift = LIFT_HINT.format(device=self.devices.reset_name(first))
        return f"; quarantined: {which}; {lift} re-probes and lifts it"

    def holders_text(self) -> str:
        from .._lease import RegionError

        try:
            snapshot = self._attach().snapshot()
        except RegionError as exc:
            return f"unknown ({exc})"
        named = [(self.devices.name_of(h["device"]), h) for h in snapshot["holders"]]
        return "; ".join(f"GPU {name}: {_who(h)} ({h['label']})" for name, h in named if name)

    def died_text(self) -> str:
        """The leases of sessions that died holding them (freed at their next use), in one
        line: whose pid, during which test, on which GPU; "" when none."""
        from .._lease import RegionError

        try:
            snapshot = self._attach().snapshot()
        except RegionError:
            return ""
        died = [
            f"the pytest session of pid {h['pid']} died during {h['label'] or 'a test'} "
            f"(on GPU {name})"
            for h in snapshot["holders"]
            if not h["alive"] and (name := self.devices.name_of(h["device"]))
        ]
        return "; ".join(died)

    def child_env(self, lease: Lease | None) -> dict[str, str]:
        """What the isolated child must see: exactly its leased devices.

        ``LEASED_ENV`` tells nested ``run_isolated`` calls in the child which GPUs
        their test already holds, so they use those instead of queueing behind them;
        ``LEASE_ID_ENV`` lets them check that the lease is real (``held_lease``).
        """
        env = self.visible(lease.devices if lease else ())
        if lease is not None:
            env[LEASE_ID_ENV] = str(lease.lease_id)
        if lease is not None and lease.memory:
            env[MEMORY_ENV] = str(lease.memory)
        return env

    def visible(self, devices: tuple[str, ...]) -> dict[str, str]:
        """The environment that shows a process exactly ``devices``, numbered as this
        session names them (a test's process, a GPU's health probe)."""
        env = visible_env(devices, self.devices.via)
        if self.devices.pci_order and "CUDA_DEVICE_ORDER" not in os.environ:
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA numbers GPUs as NVML does
        return env


LIFT_HINT = "`python -m pytest_gpuiso reset --device {device}`"
LABEL_LEN = 191  # what the table keeps of a quarantine's reason (its LABEL_LEN, less the NUL)


def _who(entry: dict[str, Any]) -> str:
    """The entry's pid, saying when it is of another pid namespace (another container)."""
    return f"pid {entry['pid']}" + ("" if entry.get("here", True) else " (another pid namespace)")


def status_table(snapshot: dict[str, Any], path: str, indices: dict[str, str] | None = None) -> str:
    """The lease table as text, like a tiny nvidia-smi for our leases: each device's
    memory (leased, free), then each holder with its lease, then the queue. A row keyed
    by a GPU's UUID is shown by its NVML index (``indices``: UUID -> index), said after."""
    indices = indices or {}
    lines = [f"lease table {path}"]
    if not snapshot["devices"]:
        return "\n".join([*lines, "no devices registered"])
    rows = [("DEVICE", "MEMORY", "LEASED", "FREE", "PID", "SINCE", "STATE", "TEST")]
    holders: dict[str, list[dict[str, Any]]] = {}
    for h in snapshot["holders"]:
        holders.setdefault(h["device"], []).append(h)
    quarantined = {q["device"]: q for q in snapshot.get("quarantined", ())}
    for name, capacity, used in snapshot["devices"]:
        q = quarantined.get(name)
        shown = indices.get(name, name)
        if q is None:
            rows.append((shown, *_amounts(capacity, used), "", "", "", ""))
        else:
            since = time.strftime("%H:%M:%S", time.localtime(q["since_ns"] / 1e9))
            rows.append((shown, *_amounts(capacity, used), "", since, "QUARANTINED", q["why"]))
        for h in holders.get(name, []):
            since = time.strftime("%H:%M:%S", time.localtime(h["since_ns"] / 1e9))
            state = "held" if h["alive"] else "dead (freed on next use)"
            if h["alive"] and h.get("stopped"):
                state = "held (stopped)"
            elif h["alive"] and not h.get("here", True):
                state = "held (another pid namespace)"
            lease = _amounts(capacity, h["amount"])[1]
            rows.append(("", "", lease, "", str(h["pid"]), since, state, h["label"]))
    widths = [max(len(row[i]) for row in rows) for i in range(7)]
    for row in rows:
        cells = "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False))
        lines.append(f"{cells}  {row[7]}")
    for w in sorted(snapshot["waiters"], key=lambda w: w["ticket"]):
        since = time.strftime("%H:%M:%S", time.localtime(w["since_ns"] / 1e9))
        stopped = " (stopped: not holding others back)" if w.get("stopped") else ""
        each = size_text(w["amount"]) if w.get("amount") else f"{w.get('share', 0) / 1e4:g}%"
        lines.append(
            f"waiting: {_who(w)} for {w['n']} GPU(s), {each} each, since {since} "
            f"(ticket {w['ticket']}){stopped} {w['label']}"
        )
    keyed = [name for name, _, _ in snapshot["devices"] if name in indices]
    lines += [f"GPU {indices[name]} is {name}" for name in keyed]
    return "\n".join(line.rstrip() for line in lines)


def _amounts(capacity: int, amount: int) -> tuple[str, str, str]:
    """(memory, leased, free) of a device in words; shares of a device of unknown size."""
    if capacity:
        return size_text(capacity), size_text(amount), size_text(max(capacity - amount, 0))
    whole = WHOLE
    return "unknown", f"{amount / whole:.0%}", f"{max(whole - amount, 0) / whole:.0%}"
