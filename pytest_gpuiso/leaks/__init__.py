"""Leak checks around one isolated test: one probe per kind, one interface.

Every probe takes the same steps (``Probe``): before its test's start, its snapshot,
the child's environment, during the run, and its check once the child and its
descendants are gone, which returns ``Leak`` records. The policy (warn / fail / off per kind, the
marker's ``allow_leaks``; parsed in ``settings``) is applied by ``judge``: probes
only observe, except the process probe, which always kills what it finds (a
leftover process is never left running, whatever the policy says about reporting it).

Also here: ``gpu_memory`` (residual GPU memory and escaped holders, through NVML; what a
test left on each GPU, as plain text for the health probes), ``shm`` (leaked /dev/shm
entries), ``shm_log`` (the shim's log of the entries a test's processes created) and
``torch`` (torch's CUDA allocator around one test).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

# What to do about a leak of each kind: said once with the failure or warning naming it.
ADVICE = {
    "shm": "to fix: unlink the segment before the test ends (SharedMemory.unlink(), "
    'os.unlink of its /dev/shm path); to allow: allow_leaks=["shm"] in the test\'s '
    "gpu_isolated marker",
    "process": "to fix: wait for the processes the test started (join(), wait(), or "
    'terminate() then wait()); to allow: allow_leaks=["process"] in the test\'s '
    "gpu_isolated marker",
    "gpu_memory": "to fix: free what the test holds on the GPU (drop its tensors, end the "
    'processes it started); to allow: allow_leaks=["gpu_memory"] in the test\'s '
    "gpu_isolated marker, or a --gpu-isolate-gpu-tolerance in MiB",
}


def advice(kinds: list[str]) -> str:
    """One line of what to do for each kind among ``kinds`` (in the order of KINDS)."""
    return "\n".join(f"  {kind}: {ADVICE[kind]}" for kind in ADVICE if kind in kinds)


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


class StartedProcess(Protocol):
    """What a probe may read of a started test's process (``parent.started.Started``)."""

    @property
    def pid(self) -> int: ...

    @property
    def shm_log(self) -> str | None: ...  # the /dev/shm shim's log (None: no shim)


class Probe:
    """One leak check's part in a test's run, step by step (each a no-op unless overridden).

    The supervisor takes every probe through the same steps, in this order:

    1. ``before_start(started)``: the test's process as started (it may have been started
       ahead of its turn), before anything is measured: what it was started with (the
       /dev/shm shim's log);
    2. ``snapshot()``: the state before the test's go (GPUs: after the lease);
    3. ``child_env()``: what the test's process gets in its environment with its go;
    4. ``during(pid)``: the process ``pid`` has its go and runs (a sampler may start);
    5. ``check(before, run)``: the process and its descendants are gone (``before``:
       what ``snapshot`` returned); the leaks found.

    ``settles``: its check needs the process's end, not only its exit (the driver frees
    a process's GPU memory as it is torn down), so a test's process that says it is
    exiting is waited for, and an interrupted run skips the check.
    """

    kind = ""
    settles = False

    def before_start(self, started: StartedProcess) -> None:
        return None

    def snapshot(self) -> Any:
        return None

    def child_env(self) -> dict[str, str]:
        return {}

    def during(self, pid: int) -> None:
        return None

    def check(self, before: Any, run: RunInfo) -> list[Leak]:
        return []


@dataclass(frozen=True)
class Verdict:
    """The leaks of one test after the policy: what to record, what fails the test."""

    records: list[dict[str, Any]]  # every reported leak, for the JSON report
    failing: list[Leak]  # leaks of kinds whose level is "fail" (and not allowed or known)
    warning: list[Leak]  # leaks of kinds whose level is "warn" (and not allowed or known)
    policy_text: str = ""  # how the failing level was set, for the failure message
    known: list[Leak] = field(default_factory=list)  # in the leak baseline: reported only


def judge(
    leaks: list[Leak],
    policy: dict[str, str],
    allowed: frozenset[str],
    known: frozenset[str] = frozenset(),
) -> Verdict:
    """Apply the per-kind levels, the marker's ``allow_leaks`` and the kinds the leak
    baseline knows of this test (``known``); ``off`` kinds vanish.

    Each record says what became of it: ``"allowed": true`` (its marker allows it), or
    its ``level``: ``fail`` (it fails the test), ``warn`` or ``known`` (in the baseline:
    it never fails the test, and it is not warned of).
    """
    records, failing, warning, known_leaks = [], [], [], []
    for leak in leaks:
        level = policy[leak.kind]
        if level == "off":
            continue
        record = leak.as_record()
        if leak.kind in allowed:
            record["allowed"] = True
        else:
            level = "known" if leak.kind in known else level
            record["level"] = level
            {"fail": failing, "warn": warning, "known": known_leaks}[level].append(leak)
        records.append(record)
    text = ",".join(f"{k}={v}" for k, v in policy.items())
    return Verdict(records, failing, warning, text, known_leaks)
