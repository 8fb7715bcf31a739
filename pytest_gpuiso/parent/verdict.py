"""One isolated test's verdict: what became of it (``Ran``), assembled from what its
process did (``Outcome``) and what it held (``Held``: its lease, probes, port, its GPUs'
checkup).

``assemble`` judges its leaks under the session's policy, replays into pytest what the
process sent (warnings, junit records, output outside capture, CUDA used without a
lease), makes its reports (a process that could not start: its own words), hands the
plugins' payloads to ``pytest_gpuiso_parent_payload`` and notes whether the session
stops after it. It runs after the test's lease and port are given back; nothing here
starts or waits for a process.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import pytest

from ..gpu.health import Checkup
from ..gpu.leases import Lease
from ..leaks import Probe, Verdict, judge
from ..leaks import torch as torch_check
from ..leaks.gpu_memory import GpuMemoryProbe
from ..reports.record import RankEntry, Record
from ..settings import IsolationSpec
from ..values import KINDS
from . import replay, start_failures
from .outcome import Outcome, SessionStop
from .recording import build_record
from .results import attach_xids, item_reports
from .session import State
from .start_failures import StartFailure


@dataclass
class Ran:
    """What became of one isolated test: its reports and what its record is made of."""

    reports: list[pytest.TestReport]
    spec: IsolationSpec | None = None
    _: KW_ONLY  # what follows is named where a Ran is made
    outcome: Outcome | None = None  # None: no process ran
    lease: Lease | None = None
    verdict: Verdict | None = None
    stop: SessionStop | None = None  # pytest.exit() or Ctrl-C in the test: end the session
    payload: dict[str, Any] = field(default_factory=dict)  # pytest_gpuiso_child_payload's
    peak: int | None = None  # most GPU memory its processes held on one GPU (NVML)
    port: int | None = None  # its MASTER_PORT (None: the user's own, or none leased)
    health: Checkup | None = None  # its GPUs' probe after it (None: not probed)
    leak_checks: tuple[str, ...] = ()  # the leak kinds checked after it
    folded: int = 0  # its warnings an earlier test's process gave (not replayed again)
    gpu_notes: tuple[str, ...] = ()  # GPU holders on its GPUs that were not its: not blamed
    start_failure: StartFailure | None = None  # its process could not start (its words)
    halt: str | None = None  # why the session stops after it (none of its processes can start)
    ranks: tuple[RankEntry, ...] = ()  # a distributed test's ranks, each its entry

    @property
    def complete(self) -> bool:
        """No process ran, or it finished: it neither crashed nor timed out."""
        return self.outcome is None or self.outcome.finished

    def record(self, item: pytest.Item, attempt: int = 1, rerun: bool = False) -> Record:
        return build_record(item.nodeid, item.location, self, attempt, rerun)


@dataclass(frozen=True)
class Held:
    """What the test's run held, read before its lease and port went back."""

    lease: Lease | None
    probes: tuple[Probe, ...]
    port: int | None  # its MASTER_PORT (None: the user's own, or none leased)
    health: Checkup | None  # its GPUs' probe after it (None: not probed)


def gpu_probe(probes: tuple[Probe, ...]) -> GpuMemoryProbe | None:
    """The test's GPU memory probe, if it had one."""
    return next((p for p in probes if isinstance(p, GpuMemoryProbe)), None)


def assemble(
    item: pytest.Item,
    spec: IsolationSpec,
    state: State,
    outcome: Outcome,
    held: Held,
    start_error: list[SessionStop],
) -> Ran:
    """The test's verdict from its ``outcome``; ``start_error``: a start notice that a
    warning filter made an error (the session stops after this test)."""
    failure = start_failures.of(outcome)
    halt = start_failures.note(state, outcome, failure)
    leaks = outcome.end.leaks + [torch_check.leak(data) for data in outcome.sent.torch_leaks]
    known = state.baseline.kinds(item.nodeid) if state.baseline is not None else frozenset()
    verdict = judge(leaks, dict(state.settings.leaks), spec.allow_leaks, known)
    seen = state.warned if state.settings.warnings == "once" else None
    folded = replay.replay_warnings(item.config, outcome.sent.warnings, seen)
    verdict = replay.warn_leaks(item, verdict)
    replay.replay_junit(item.config, outcome.sent.junit)
    replay.warn_cuda_without_gpu(item, spec.gpus == 0, outcome.sent.driver)
    if outcome.finished and outcome.end.output and failure is None:  # not its start's noise
        replay.echo(item.config, outcome.end.output)
    stop = outcome.sent.exits or start_error
    reports = failure.reports(item) if failure else item_reports(item, spec, outcome, verdict)
    checked = held.health
    attach_xids(item, reports, checked.xids if checked else [])
    payload: dict[str, Any] = {}
    for sent in outcome.sent.payloads:  # one, unless a plugin misbehaved
        payload.update(sent)
        item.config.hook.pytest_gpuiso_parent_payload(item=item, payload=sent, reports=reports)
    gpu = gpu_probe(held.probes)
    kinds = {p.kind for p in held.probes} | {"process"}  # the sweep always runs
    ran = [k for k in KINDS if k in kinds and state.settings.leak_level(k) != "off"]
    return Ran(
        reports,
        spec,
        outcome=outcome,
        lease=held.lease,
        verdict=verdict,
        stop=stop[0] if stop else None,
        payload=payload,
        peak=gpu.peak if gpu is not None else None,
        port=held.port,
        health=checked,
        leak_checks=() if outcome.sent.interrupted else tuple(ran),
        folded=folded,
        gpu_notes=tuple(gpu.notes) if gpu is not None else (),  # said in the summary
        start_failure=failure,
        halt=halt,
    )
