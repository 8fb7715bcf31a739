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
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from .settings import CUDA_ID

REGION_ENV = "PYTEST_GPUISO_LEASE_REGION"  # another table path (tests, or sharing across users)
LEASED_ENV = "PYTEST_GPUISO_LEASED"  # set in an isolated child: the GPUs its test holds


def region_path() -> str:
    """The user's lease table: ``/dev/shm/pytest-gpuiso-leases-<uid>`` (0600)."""
    if os.environ.get(REGION_ENV):
        return os.environ[REGION_ENV]
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"pytest-gpuiso-leases-{os.getuid()}")


def open_region(path: str | None = None) -> Any:
    from ._lease import Region

    return Region(path or region_path())


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
    if setting is not None:
        return Devices(tuple(setting), what)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        names = []
        for part in visible.split(","):  # CUDA stops at the first invalid entry
            part = part.strip()
            if not CUDA_ID.match(part):
                break
            names.append(part)
        return Devices(tuple(names), "CUDA_VISIBLE_DEVICES")
    return Devices(tuple(str(i) for i in range(_nvml_count())), "NVML", pci_order=True)


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


class LeaseTimeout(Exception):
    """Waited longer than the lease timeout; the message names the holders."""


def visible_env(devices: tuple[str, ...] | list[str]) -> dict[str, str]:
    """Environment of a child that may use exactly ``devices`` (and no other GPU)."""
    names = ",".join(devices)
    return {"CUDA_VISIBLE_DEVICES": names, LEASED_ENV: names}


class Leases:
    """This process's view of the shared table for one set of devices."""

    def __init__(self, devices: Devices, slots: int, path: str | None = None) -> None:
        self.devices = devices
        self.slots = slots
        self.region = open_region(path)

    def acquire(self, n: int, label: str, timeout: float | None) -> Lease:
        start = time.monotonic()
        got = self.region.acquire(list(self.devices.names), self.slots, n, label, timeout)
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
        self.region.release(lease.lease_id)

    def holders_text(self) -> str:
        holders = [
            h for h in self.region.snapshot()["holders"] if h["device"] in self.devices.names
        ]
        return "; ".join(f"GPU {h['device']}: pid {h['pid']} ({h['label']})" for h in holders)

    def child_env(self, lease: Lease | None) -> dict[str, str]:
        """What the isolated child must see: exactly its leased devices.

        ``LEASED_ENV`` tells nested ``run_isolated`` calls in the child which GPUs
        their test already holds, so they use those instead of queueing behind them.
        """
        env = visible_env(lease.devices if lease else ())
        if self.devices.pci_order and "CUDA_DEVICE_ORDER" not in os.environ:
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA numbers GPUs as NVML does
        return env


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
                rows.append((name, str(slot), str(h["pid"]), since, state, h["label"]))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    for row in rows:
        lines.append(
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[5]
        )
    for w in sorted(snapshot["waiters"], key=lambda w: w["ticket"]):
        since = time.strftime("%H:%M:%S", time.localtime(w["since_ns"] / 1e9))
        lines.append(
            f"waiting: pid {w['pid']} for {w['n']} GPU(s) since {since} (ticket {w['ticket']}) "
            f"{w['label']}"
        )
    return "\n".join(line.rstrip() for line in lines)
