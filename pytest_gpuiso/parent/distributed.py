"""A distributed test (``@pytest.mark.gpu_isolated(ranks=N)``), pytest's side: N ranks.

``run_ranks`` leases the group's GPUs (``gpus=`` each rank's, all or none, as one lease)
and one ``MASTER_PORT``, starts the N processes together through the worker's door
(``Worker.group``: each with its own temporary directory and environment: ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``PYTEST_GPUISO_RENDEZVOUS``
and only its own GPUs), gives each its go, waits for them as one (``group``: the first
rank to end gives the others ``rank_wait`` seconds), and makes one verdict of their
reports (``ranks``). Every rank's process is checked for leaks on its own: its process
tree swept, its ``/dev/shm`` entries (those its own shim log names); rank 0's also
carries the GPU memory check over the whole group's GPUs. Each leak names its rank, and
the test's verdict holds every rank's leaks.
"""

from __future__ import annotations

import copy
import dataclasses
import tempfile
import time
from pathlib import Path

import pytest

from ..gpu import ports
from ..gpu.leases import LeaseError
from ..leaks import Leak, Verdict
from ..reports.record import RankEntry
from ..wire.environment import RENDEZVOUS_ENV
from . import verdict
from .group import Ended, wait_group
from .outcome import Outcome
from .plans import Plan
from .ranks import RankRun, cause, first_line, in_doubt, one_verdict, state_of
from .session import State
from .turn import CannotRun, Turn, pinned_part, probes_for
from .verdict import Ran
from .watch import Bounds
from .worker import Worker


def run_ranks(item: pytest.Item, plan: Plan, state: State, worker: Worker, turn: Turn) -> Ran:
    """Run the test as ``plan.spec.ranks`` processes; its ``Ran`` (see the module). Where
    the ranks share their GPUs by memory slices (``plan.packed``), the group leases its
    ``gpus`` GPUs with every rank's slice, and each rank sees them all with its own."""
    spec = plan.spec
    if turn.started is not None:  # a single process started ahead is of no use here
        worker.discard(turn.started)
        turn.started = None
    # each rank's GPUs, or (packed) every rank's slice of the same GPUs
    total = plan.gpus if plan.packed else plan.gpus * spec.ranks
    memory = spec.gpu_memory.times(spec.ranks) if plan.packed else spec.gpu_memory
    if total > 0 and worker.health is not None and worker.gpus.leases is not None:
        pinned = pinned_part(worker, total, memory)  # the worker's, if pinned
        turn.owned = pinned is None
        try:
            turn.lease = worker.health.lease(
                total, item.nodeid, worker.settings.lease_timeout, memory, pinned
            )
        except LeaseError as exc:
            raise CannotRun(str(exc)) from None
    try:
        turn.port = ports.lease()
    except ports.PortError as exc:
        raise CannotRun(f"the ranks need a MASTER_PORT: {exc}") from None
    envs = _rank_envs(plan, worker, turn)
    beside = Path(plan.job.basetemp).parent  # each rank's basetemp beside the test's own
    jobs = [
        dataclasses.replace(plan.job, basetemp=tempfile.mkdtemp(prefix="isolated-", dir=beside))
        for _ in envs
    ]
    turn.ranks = list(worker.group(jobs, envs))
    probes = [
        probes_for(plan, state, worker, turn.lease if rank == 0 else None, alone=False)
        for rank in range(spec.ranks)
    ]
    bounds = Bounds(spec.timeout, spec.startup_timeout, spec.grace)
    runnings = []
    for rank, started in enumerate(list(turn.ranks)):
        running = worker.go(started, envs[rank], probes[rank], bounds)
        turn.ranks[rank] = running
        runnings.append(running)
    ended = wait_group(runnings, spec.rank_wait)
    checked = None
    if turn.lease is not None and worker.health is not None:
        runs = [e.outcome.run_end() for e in ended]
        worst = in_doubt(runs, [e.outcome.end.expired == "group" for e in ended])
        checked = worker.health.after(item.nodeid, turn.lease, worst, plan.shared, None)
    port = turn.port.port if turn.port is not None else None
    turn.release(worker)
    rans = []
    for rank, one in enumerate(ended):
        one.outcome.end.leaks = [_of_rank(leak, rank) for leak in one.outcome.end.leaks]
        held = verdict.Held(turn.lease, probes[rank], port, checked)
        rans.append(verdict.assemble(item, spec, state, one.outcome, held, []))
    runs = [
        RankRun(rank, ran.reports, one.ended_at, one.outcome.end.expired == "group", failed)
        for rank, (ran, one, failed) in enumerate(
            zip(rans, ended, map(_failed_at, ended), strict=True)
        )
    ]
    first = cause(runs)
    base = rans[first.rank] if first is not None else rans[0]  # its record
    leaks = _every_ranks([ran.verdict for ran in rans])
    records = leaks.records if leaks is not None else []
    entries = tuple(
        _entry(run, one, [r for r in records if r.get("rank") == run.rank])
        for run, one in zip(runs, ended, strict=True)
    )
    return dataclasses.replace(
        base,
        outcome=_every_ranks_escaped(base.outcome, ended),
        peak=max((ran.peak for ran in rans if ran.peak is not None), default=None),
        gpu_notes=tuple(dict.fromkeys(note for ran in rans for note in ran.gpu_notes)),
        folded=sum(ran.folded for ran in rans),
        # pytest.exit() in any rank ends the session, as in-process (the cause's first)
        stop=next((ran.stop for ran in (base, *rans) if ran.stop is not None), None),
        reports=one_verdict(item, runs),
        ranks=entries,
        verdict=leaks,
        leak_checks=tuple(dict.fromkeys(k for ran in rans for k in ran.leak_checks)),
    )


def _every_ranks_escaped(outcome: Outcome | None, ended: list[Ended]) -> Outcome | None:
    """``outcome`` (the record's rank's) with every rank's escaped processes, each named by
    its rank: the record's ``escaped`` and the session's count are the test's."""
    if outcome is None:
        return None
    escaped = [leak for one in ended for leak in one.outcome.end.leaks if leak.kind == "process"]
    own = [leak for leak in outcome.end.leaks if leak.kind != "process"]
    merged = copy.copy(outcome)
    merged.end = dataclasses.replace(outcome.end, leaks=[*escaped, *own])
    return merged


def _failed_at(one: Ended) -> float | None:
    """When the rank's own first failed report ended (``time.monotonic()``; None: its
    process sent none: it passed, crashed, or was stopped before it failed by itself)."""
    stops = [
        data["stop"]
        for data in one.outcome.sent.reports
        if data.get("outcome") == "failed" and isinstance(data.get("stop"), (int, float))
    ]
    return min(stops) - (time.time() - time.monotonic()) if stops else None


def _entry(run: RankRun, one: Ended, leaks: list[dict]) -> RankEntry:
    """Rank ``run``'s entry in the test's JSON record; ``leaks``: those of its rank."""
    end = one.outcome.end
    failed = any(r.failed for r in run.reports)
    return {
        "rank": run.rank,
        "outcome": state_of(run.reports),
        "pid": end.pid,
        "exit": end.exitcode,
        "signal": end.signal_name,
        "expired": end.expired,
        "duration": round(end.duration, 6),
        "error": first_line(run.reports) if failed else None,
        "stack": end.stack or None,
        "leaks": leaks,
    }


def _of_rank(leak: Leak, rank: int) -> Leak:
    """``leak``, found after rank ``rank``'s process: its line and its fields name the
    rank it is of. A leftover process is swept by the first rank checked, whichever
    rank left it: it names its own where its environment says it (``leaks.process``),
    else none."""
    if leak.kind == "process":
        if "rank" not in leak.fields:
            return Leak(leak.kind, f"a rank's {leak.detail}", {**leak.fields, "rank": None})
        rank = leak.fields["rank"]
    return Leak(leak.kind, f"rank {rank}: {leak.detail}", {**leak.fields, "rank": rank})


def _every_ranks(verdicts: list[Verdict | None]) -> Verdict | None:
    """The test's leak verdict: every rank's leaks, in rank order."""
    found = [v for v in verdicts if v is not None]
    if not found:
        return None
    return Verdict(
        [r for v in found for r in v.records],
        [leak for v in found for leak in v.failing],
        [leak for v in found for leak in v.warning],
        found[0].policy_text,
        [leak for v in found for leak in v.known],
    )


def _rank_envs(plan: Plan, worker: Worker, turn: Turn) -> list[dict[str, str]]:
    """Each rank's environment: its own GPUs, the group's port and rendezvous."""
    world, n, gpus = plan.spec.ranks, plan.gpus, worker.gpus
    rendezvous = Path(tempfile.mkdtemp(prefix="rendezvous-", dir=Path(plan.job.basetemp)))
    envs = []
    lease = turn.lease
    if lease is not None and plan.packed:  # each rank sees them all, with its slice of each
        lease = dataclasses.replace(lease, memory=lease.memory // world)
    for rank in range(world):
        share = None if lease is None or plan.packed else lease.devices[rank * n : (rank + 1) * n]
        env = gpus.go_env(lease, share)
        if turn.port is not None:
            env.update(turn.port.env())
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
        )
        env[RENDEZVOUS_ENV] = str(rendezvous / "store")
        envs.append(env)
    return envs
