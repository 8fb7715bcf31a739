"""Device discovery and GPU leases over the native table (native/gpuiso_lease.c).

The pytest process (the xdist worker under xdist) takes a test's lease before
starting its child and releases it after the child is reaped, so a crashing or
killed child can never strand a GPU. The table is shared by every pytest
process of the user on the machine.

Devices are found without ever creating a CUDA context here: from the user's
``CUDA_VISIBLE_DEVICES`` when set, else from NVML (nvidia-ml-py), else none.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from .settings import CUDA_ID, SpecError
from .workdir import user_name

REGION_ENV = "PYTEST_GPUISO_LEASE_REGION"  # another table path (tests, or sharing across users)
LEASED_ENV = "PYTEST_GPUISO_LEASED"  # set in an isolated child: the GPUs its test holds
CHOOSE_PATH = f"choose another path with {REGION_ENV}=PATH"
EXHAUSTED = {errno.ENOSPC, errno.EDQUOT, errno.ENOMEM, errno.EMFILE, errno.ENFILE}


def region_path() -> str:
    """The user's lease table: ``/dev/shm/pytest-gpuiso-leases-<uid>`` (0600)."""
    if os.environ.get(REGION_ENV):
        return os.environ[REGION_ENV]
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"pytest-gpuiso-leases-{os.getuid()}")


def open_region(path: str | None = None) -> Any:
    """Attach to (or create) the table; ``RegionError`` with one line naming the problem."""
    from ._lease import Region, RegionError

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
    from ._lease import REGION_SIZE

    return int(REGION_SIZE)


@dataclass(frozen=True)
class Devices:
    names: tuple[str, ...]
    source: str  # "--gpu-isolate-devices", "CUDA_VISIBLE_DEVICES", "NVML", ...
    pci_order: bool = False  # names are NVML indices: children need CUDA_DEVICE_ORDER=PCI_BUS_ID

    def shortfall(self, n: int) -> str | None:
        """None when ``n`` GPUs can be leased here; else "N GPUs, <what there is> available"."""
        have = len(self.names)
        if n <= have:
            return None
        found = f"{have} ({', '.join(self.names)})" if have else "none"
        return f"{n} GPU{'s' if n != 1 else ''}, {found} available"


def discover(setting: list[str] | None, what: str) -> Devices:
    """The devices to lease; ``SpecError`` naming the source when the table cannot hold them."""
    if setting is not None:
        return _checked(Devices(tuple(setting), what))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        names = []
        for part in visible.split(","):  # CUDA stops at the first invalid entry
            part = part.strip()
            if not CUDA_ID.match(part):
                break
            names.append(part)
        return _checked(Devices(tuple(names), "CUDA_VISIBLE_DEVICES"), visible)
    return _checked(Devices(tuple(str(i) for i in range(_nvml_count())), "NVML", pci_order=True))


def _checked(devices: Devices, value: str | None = None) -> Devices:
    from ._lease import MAX_DEVICES

    names = devices.names
    where = devices.source if value is None else f"{devices.source}={value}"
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise SpecError(f"invalid device list {where}: device {twice[0]} is listed twice")
    if len(names) > MAX_DEVICES:
        raise SpecError(
            f"{len(names)} devices from {devices.source}: the lease table holds at most "
            f"{MAX_DEVICES}"
        )
    long = [name for name in names if len(name.encode()) >= 64]
    if long:
        raise SpecError(f"invalid device name {long[0]!r} from {devices.source}: over 63 bytes")
    return devices


def _nvml_count() -> int:
    """GPUs NVML sees; 0 without a driver. NVML never creates a CUDA context."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    except Exception:
        return 0
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


@dataclass(frozen=True)
class Lease:
    lease_id: int
    devices: tuple[str, ...]
    waited: float  # seconds spent waiting (not charged to the test's timeout)


class LeaseError(Exception):
    """A lease could not be had: the one-line message says why (fails the test's setup)."""


class LeaseTimeout(LeaseError):
    """Waited longer than the lease timeout; the message names the holders."""


def visible_env(devices: tuple[str, ...] | list[str]) -> dict[str, str]:
    """Environment of a child that may use exactly ``devices`` (and no other GPU)."""
    names = ",".join(devices)
    return {"CUDA_VISIBLE_DEVICES": names, LEASED_ENV: names}


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
        from ._lease import RegionError

        if self.region is None:
            try:
                self.region = open_region(self.path)
            except RegionError as exc:
                if not (exhausted_ok and getattr(exc, "errno", 0) in EXHAUSTED):
                    raise
        return self.region

    def acquire(self, n: int, label: str, timeout: float | None) -> Lease:
        from ._lease import RegionError

        label = label.encode("utf-8", "replace").decode()  # a nodeid may hold surrogates
        start = time.monotonic()
        try:
            region = self._attach()
            self._release_pending()
            got = region.acquire(list(self.devices.names), self.slots, n, label, timeout)
        except RegionError as exc:
            hint = " (--gpu-isolate-slots)" if "this session asks for" in str(exc) else ""
            raise LeaseError(f"{exc}{hint}") from None
        waited = time.monotonic() - start
        if got is None:
            raise LeaseTimeout(
                f"waited {waited:.1f} s for {n} GPU{'s' if n != 1 else ''} of "
                f"{', '.join(self.devices.names)} (--gpu-isolate-lease-timeout); held by: "
                + (self.holders_text() or "nobody (the queue ahead was still being served)")
            )
        lease_id, names = got
        return Lease(lease_id, tuple(names), waited)

    def release(self, lease: Lease) -> None:
        """Release, or (the table's lock held by a stopped process) release at the next
        acquire, which then fails naming that process if it is still stopped."""
        self._unreleased.append(lease.lease_id)
        self._release_pending(quiet=True)

    def _release_pending(self, quiet: bool = False) -> None:
        from ._lease import RegionError

        while self._unreleased:
            try:
                self.region.release(self._unreleased[0])
            except RegionError:
                if quiet:
                    return
                raise
            self._unreleased.pop(0)

    def holders_text(self) -> str:
        from ._lease import RegionError

        try:
            snapshot = self._attach().snapshot()
        except RegionError as exc:
            return f"unknown ({exc})"
        holders = [h for h in snapshot["holders"] if h["device"] in self.devices.names]
        return "; ".join(f"GPU {h['device']}: {_who(h)} ({h['label']})" for h in holders)

    def child_env(self, lease: Lease | None) -> dict[str, str]:
        """What the isolated child must see: exactly its leased devices.

        ``LEASED_ENV`` tells nested ``run_isolated`` calls in the child which GPUs
        their test already holds, so they use those instead of queueing behind them.
        """
        env = visible_env(lease.devices if lease else ())
        if self.devices.pci_order and "CUDA_DEVICE_ORDER" not in os.environ:
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA numbers GPUs as NVML does
        return env


def _who(entry: dict[str, Any]) -> str:
    """The entry's pid, saying when it is of another pid namespace (another container)."""
    return f"pid {entry['pid']}" + ("" if entry.get("here", True) else " (another pid namespace)")


def status_table(snapshot: dict[str, Any], path: str) -> str:
    """The lease table as text, like a tiny nvidia-smi for our semaphores."""
    lines = [f"lease table {path}"]
    if not snapshot["devices"]:
        return "\n".join([*lines, "no devices registered"])
    rows = [("DEVICE", "SLOT", "PID", "SINCE", "STATE", "TEST")]
    held = {(h["device"], h["slot"]): h for h in snapshot["holders"]}
    for name, slots in snapshot["devices"]:
        for slot in range(slots):
            h = held.get((name, slot))
            if h is None:
                rows.append((name, str(slot), "-", "-", "free", ""))
            else:
                since = time.strftime("%H:%M:%S", time.localtime(h["since_ns"] / 1e9))
                state = "held" if h["alive"] else "dead (freed on next use)"
                if h["alive"] and h.get("stopped"):
                    state = "held (stopped)"
                elif h["alive"] and not h.get("here", True):
                    state = "held (another pid namespace)"
                rows.append((name, str(slot), str(h["pid"]), since, state, h["label"]))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    for row in rows:
        lines.append(
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[5]
        )
    for w in sorted(snapshot["waiters"], key=lambda w: w["ticket"]):
        since = time.strftime("%H:%M:%S", time.localtime(w["since_ns"] / 1e9))
        stopped = " (stopped: not holding others back)" if w.get("stopped") else ""
        lines.append(
            f"waiting: {_who(w)} for {w['n']} GPU(s) since {since} (ticket {w['ticket']}){stopped} "
            f"{w['label']}"
        )
    return "\n".join(line.rstrip() for line in lines)
