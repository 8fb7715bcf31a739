"""Leak checks around one isolated test: one probe per kind, one interface.

Every probe is used the same way by the supervisor::

    before = probe.snapshot()          # before the child starts (GPUs: after the lease)
    ...                                # the child runs and is reaped
    leaks = probe.check(before, run)   # after the child and its descendants are gone

``check`` returns ``Leak`` records. The policy (warn / fail / off per kind, the
marker's ``allow_leaks``) is applied by the caller: probes only observe, except
the process probe, which always kills what it finds (a leftover process is never
left running, whatever the policy says about reporting it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

KINDS = ("shm", "process", "gpu_memory")
LEVELS = ("warn", "fail", "off")


@dataclass(frozen=True)
class RunInfo:
    """What a probe may need to know about the run it checks."""

    pid: int  # the test's process
    started: float  # time.time() when the child was started
    ended: float  # time.time() when it was reaped
    grace: float  # SIGTERM -> SIGKILL delay for leftover processes
    tree_pids: frozenset[int] = frozenset()  # the child and every descendant seen


@dataclass(frozen=True)
class Leak:
    """One leaked resource. ``fields`` are the kind-specific JSON fields."""

    kind: str
    detail: str  # one line of human text
    fields: dict[str, Any] = field(default_factory=dict)

    def as_record(self) -> dict[str, Any]:
        return {"kind": self.kind, "detail": self.detail, **self.fields}


class Probe(Protocol):
    kind: str

    def snapshot(self) -> Any: ...

    def check(self, before: Any, run: RunInfo) -> list[Leak]: ...


def parse_policy(text: str, what: str) -> dict[str, str]:
    """``warn``, ``fail``, ``off`` or per kind ``shm=fail,process=warn`` (a bare level sets
    the default of the kinds not named). Raises ``SpecError`` naming the bad part."""
    from ..spec import SpecError

    default = "warn"
    named: dict[str, str] = {}
    parts = [part.strip() for part in text.split(",")]
    expected = f"expected {'|'.join(LEVELS)} or kind=level with kinds {', '.join(KINDS)}"
    seen_default = False
    for part in parts:
        kind, sep, level = (s.strip() for s in part.partition("="))
        if not sep:
            kind, level = "", kind
        bad = f"invalid value {text!r} for {what}: bad part {part!r}"
        if level not in LEVELS or (sep and kind not in KINDS):
            raise SpecError(f"{bad} ({expected})")
        if kind in named:
            raise SpecError(f"{bad}: {kind} is given twice")
        if kind:
            named[kind] = level
        elif seen_default:
            raise SpecError(f"{bad}: a level for every kind is given twice")
        else:
            default, seen_default = level, True
    return {kind: named.get(kind, default) for kind in KINDS}


def parse_allowed(value: Any, what: str) -> frozenset[str]:
    """The marker's ``allow_leaks``: a list of kinds (or one kind as a string, or ``"all"``)."""
    from ..spec import SpecError

    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple, set, frozenset)) or not all(
        isinstance(k, str) for k in items
    ):
        raise SpecError(
            f"invalid value {value!r} for {what}: expected a list of kinds ({', '.join(KINDS)})"
        )
    unknown = sorted(set(items) - {*KINDS, "all"})
    if unknown:
        raise SpecError(
            f"invalid value {value!r} for {what}: unknown kind {unknown[0]!r} "
            f"(expected {', '.join(KINDS)} or all)"
        )
    return frozenset(KINDS) if "all" in items else frozenset(items)


@dataclass(frozen=True)
class Verdict:
    """The leaks of one test after the policy: what to record, what fails the test."""

    records: list[dict[str, Any]]  # every reported leak, for the JSON report
    failing: list[Leak]  # leaks of kinds whose level is "fail" (and not allowed)
    warning: list[Leak]  # leaks of kinds whose level is "warn" (and not allowed)
    policy_text: str = ""  # how the failing level was set, for the failure message


def judge(leaks: list[Leak], policy: dict[str, str], allowed: frozenset[str]) -> Verdict:
    """Apply the per-kind levels and the marker's ``allow_leaks``; ``off`` kinds vanish."""
    records, failing, warning = [], [], []
    for leak in leaks:
        level = policy[leak.kind]
        if level == "off":
            continue
        record = leak.as_record()
        if leak.kind in allowed:
            record["allowed"] = True
        elif level == "fail":
            failing.append(leak)
        else:
            warning.append(leak)
        records.append(record)
    text = ",".join(f"{k}={v}" for k, v in policy.items())
    return Verdict(records, failing, warning, text)
