"""What an Xid means for a test and its GPU, by NVIDIA's own Xid catalog.

The table is our reading of NVIDIA's "Analyzing Xid Errors with the Xid Catalog" for
Ampere and later GPUs (https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html,
as read on 2026-11-29): for each Xid the catalog lists as in use on A100 or later, a short
description and its "Resolution Bucket (Immediate Action)". The bucket decides our class:

- ``ignore``: informational (a corrected error, the clean-up after another Xid): noted;
- ``application``: the application's fault (a bad kernel, a page fault): the test that
  held the GPU alone fails, naming the Xid; the GPU is not quarantined;
- ``reset``, ``reboot``, ``service``: the GPU is quarantined, and the catalog's action
  is said (never attempted here: a reset needs root and an idle GPU).

An Xid the table does not hold (a new driver's, or one the catalog marks unused on these
GPUs) is quarantined too, as ``unknown``: a GPU is never trusted on an Xid we cannot read.
Other sources disagree on some (Kubernetes' device plugin ignores 13, 31, 43, 45, 68, 109;
DCGM fails 48, 74, 79, 95, 119, 120, 140 always): the catalog is the one followed here.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

IGNORE, APPLICATION, RESET, REBOOT, SERVICE, UNKNOWN = (
    "ignore",
    "application",
    "reset",
    "reboot",
    "service",
    "unknown",
)
QUARANTINES = frozenset({RESET, REBOOT, SERVICE, UNKNOWN})

# The catalog's immediate-action bucket -> our class.
BUCKETS = {
    "IGNORE": IGNORE,
    "WORKFLOW_XID_45": IGNORE,  # the clean-up after another Xid: that one says what to do
    "RESTART_APP": APPLICATION,
    "RESET_GPU": RESET,
    "XID_154_EVAL": RESET,  # the recovery action NVML reports decides; a reset at least
    "RESTART_BM": REBOOT,
    "RESTART_VM": REBOOT,
    "CONTACT_SUPPORT": SERVICE,
    "CHECK_MECHANICALS": SERVICE,
}

ACTIONS = {
    IGNORE: "none (informational)",
    APPLICATION: "restart the application: the test's code or kernel is at fault, not the GPU",
    RESET: "reset the GPU (nvidia-smi -r as root, with no process on it)",
    REBOOT: "reboot the machine",
    SERVICE: "the GPU needs service: contact your provider or NVIDIA support",
    UNKNOWN: "not in NVIDIA's Xid catalog: read the driver's log (dmesg) and the catalog",
}

# Xid -> (what it is, the catalog's immediate-action bucket), A100 and later.
CATALOG: dict[int, tuple[str, str]] = {
    8: ("GPU stopped processing", "RESTART_APP"),
    11: ("invalid or corrupted push buffer stream", "RESTART_APP"),
    13: ("graphics engine exception", "RESTART_APP"),
    31: ("GPU memory page fault", "RESTART_APP"),
    43: ("GPU stopped processing (a channel the driver reset)", "IGNORE"),
    45: ("preemptive clean-up after earlier errors", "WORKFLOW_XID_45"),
    48: ("double-bit ECC error", "RESET_GPU"),
    61: ("internal micro-controller breakpoint or warning", "RESET_GPU"),
    62: ("internal micro-controller halt", "RESET_GPU"),
    63: ("ECC page retirement or row remapping recorded", "IGNORE"),
    64: ("ECC page retirement or row remapping could not be recorded", "RESET_GPU"),
    68: ("video decoder (NVDEC) exception", "RESTART_APP"),
    69: ("graphics engine class error", "RESTART_APP"),
    74: ("NVLink error", "RESET_GPU"),
    79: ("GPU has fallen off the bus", "RESTART_BM"),
    92: ("high single-bit ECC error rate", "IGNORE"),
    94: ("contained ECC error", "RESTART_APP"),
    95: ("uncontained ECC error", "RESET_GPU"),
    109: ("context switch timeout", "RESET_GPU"),
    119: ("GSP RPC timeout", "RESET_GPU"),
    120: ("GSP error", "RESET_GPU"),
    121: ("C2C link corrected error", "IGNORE"),
    126: ("a fault the catalog puts on the application", "RESTART_APP"),
    140: ("unrecovered ECC error", "RESET_GPU"),
    154: ("GPU recovery action changed", "XID_154_EVAL"),
}


@dataclass(frozen=True)
class Xid:
    """One Xid as the catalog reads it."""

    number: int
    name: str  # what it is ("" when the catalog does not hold it)
    kind: str  # our class: IGNORE, APPLICATION, RESET, REBOOT, SERVICE, UNKNOWN

    @property
    def action(self) -> str:
        """What the catalog says to do about it."""
        return ACTIONS[self.kind]

    @property
    def quarantines(self) -> bool:
        return self.kind in QUARANTINES

    def text(self) -> str:
        """What it is and what to do: "Xid 79 (GPU has fallen off the bus): reboot the machine"."""
        return f"Xid {self.number} ({self.name or 'unknown'}): {self.action}"

    def entry(self, device: str) -> dict[str, object]:
        """Its entry in a test's record (``gpu_health``'s ``xids``)."""
        return {
            "device": device,
            "xid": self.number,
            "name": self.name,
            "class": self.kind,
            "action": self.action,
        }

    def judged(self, device: str, shared: bool, others: Collection[int]) -> dict[str, object]:
        """Its entry, judged: an application's fails the test (``fails_test``) only when
        the GPU was the test's alone: not ``shared`` with other tests, and no process of
        ``others`` (NVML pids not the test's, then in ``other_pids``) on it."""
        application = self.kind == APPLICATION
        entry = {**self.entry(device), "fails_test": application and not shared and not others}
        if application and others:
            entry["other_pids"] = sorted(others)
        return entry


def faults_text(entries: Iterable[dict[str, Any]], during: str = "the test") -> str | None:
    """The application Xids of judged entries (``Xid.judged``) that fail their test or
    call, one line each ("Xid 31 (GPU memory page fault) on GPU 0 during the test:
    NVIDIA's Xid catalog says ..."); None when none does."""
    lines = [
        f"Xid {x['xid']} ({x['name']}) on GPU {x['device']} during {during}: "
        f"NVIDIA's Xid catalog says {x['action']}"
        for x in entries
        if x.get("fails_test")
    ]
    return "\n".join(lines) or None


def classify(number: int) -> Xid:
    """The catalog's reading of Xid ``number`` (``UNKNOWN`` when it does not hold it)."""
    name, bucket = CATALOG.get(number, ("", ""))
    return Xid(number, name, BUCKETS.get(bucket, UNKNOWN))
