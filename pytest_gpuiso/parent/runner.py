"""One isolated test, parent side: its attempts, its GPUs, its lease, its probes, its run.

``protocol`` is pytest's runtest protocol for it: each attempt (``run_item``) in a fresh
process while ``pytest_gpuiso_rerun`` says so (``mark_rerun`` an attempt run again), the
last made final (``finish_item``), the reports logged. One attempt:

1. take the test's plan (``plans``: its ``IsolationSpec``, its GPUs, its job; a bad
   marker is the test's setup error, missing GPUs its skip);
2. lease its GPUs and port (in this process: a child that crashes can never strand
   a GPU), and take its process from the worker's door: prewarmed, or started now;
3. give it its go with the leak probes of the session's policy (``Worker.go``);
4. while it runs, have the next tests' processes started (``Worker.prepare_next``);
5. wait for its outcome (``Running.wait``; a fresh process where its own could not run
   it), judge its GPUs, give back its lease and port; ``verdict.assemble`` turns the
   ``Outcome`` into the test's ``Ran``: its leaks judged, what it sent replayed, its
   reports;
6. after the last attempt, tear down the parent's own fixtures that ``nextitem``
   no longer needs, as in-process; attach each attempt's JSON record to its last
   report.

A test's processes come and go through one door, the session's ``worker.Worker``,
made once and handed in by the hook (its verbs: ``take``, ``waiting``, ``ready``,
``again``, ``go``, ``prepare_next``, ``changed``, ``discard``; its settings and GPUs),
which is called from here, downward, and never calls back; the waiting is
``supervisor``'s. The session's flags live in ``session.State``. A test that cannot run
(a bad marker, a lease refused, no process) fails its setup with why (``CannotRun``).
"""

from __future__ import annotations

import dataclasses

import pytest

from .. import _compat
from ..gpu import ports
from ..gpu.leases import LeaseError
from ..proc import workdir
from ..settings import wants_isolation
from ..warning_types import GpuIsoStartWarning, warn_session
from . import distributed, supervisor, verdict
from .launcher import StartError
from .outcome import Outcome, SessionStop
from .plans import PLAN, Plan, plan_for
from .prewarm import WarmJob
from .recording import attach_record
from .results import (
    apply_xfail,
    setup_error_reports,
    skip_reports,
)
from .session import STATE, State, settle
from .supervisor import Running
from .turn import CannotRun, Turn, pinned_part, probes_for
from .verdict import Ran
from .watch import Bounds
from .worker import Worker


def protocol(item: pytest.Item, nextitem: pytest.Item | None, worker: Worker | None) -> None:
    """pytest's runtest protocol for an isolated test: each attempt in a fresh process
    while ``pytest_gpuiso_rerun`` says so, its reports logged as pytest logs them.
    ``worker``: the session's (``worker.start_worker``); None where it could not be made."""
    ihook = item.ihook
    attempt = 1
    while True:
        ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        ran = run_item(item, nextitem, worker)
        again = None
        if ran.stop is None:
            again = item.config.hook.pytest_gpuiso_rerun(
                item=item,
                attempt=attempt,
                reports=ran.reports,
                payload=ran.payload,
                complete=ran.complete,
            )
        if again is not None:  # a plugin counts this test's attempts (pytest-rerunfailures)
            for rep in ran.reports:
                rep.rerun = attempt - 1  # type: ignore[attr-defined] - as rerunfailures sets it
        if not again:
            break
        mark_rerun(item, ran, attempt)
        for rep in ran.reports:
            ihook.pytest_runtest_logreport(report=rep)
        ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        attempt += 1
    finish_item(item, nextitem, ran, attempt)
    for rep in ran.reports:
        ihook.pytest_runtest_logreport(report=rep)
    if ran.stop is not None:  # pytest.exit() or Ctrl-C in the test: end the session here too
        stop_session(ran.stop)
    ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    if ran.halt is not None and not item.session.shouldstop:  # as -x stops it (and xdist's
        item.session.shouldstop = ran.halt  # controller, told by the worker)


def run_item(item: pytest.Item, nextitem: pytest.Item | None, worker: Worker | None) -> Ran:
    """Run one attempt of an isolated test (its turn has come); ``finish_item`` or
    ``mark_rerun`` then make its reports final.

    In one line: its plan, its lease, its process (prewarmed, or started now), the go,
    the next tests' processes started while it runs, the wait, the verdict."""
    state = item.config.stash[STATE]
    turn, spec, warmed = Turn(), None, False
    try:
        if worker is None:  # its work directory could not be made: each test says why
            raise CannotRun(state.no_worker)
        turn.started = worker.take(item.nodeid)
        plan = plan_for(item, worker)  # its temporary directory may fail to be made
        del item.stash[PLAN]  # another attempt plans afresh (a new basetemp)
        spec = plan.spec
        if plan.error is not None:  # a bad marker
            raise CannotRun(plan.error)
        if plan.missing is not None:
            ran = Ran(skip_reports(item, f"gpu-isolate: test needs {plan.missing}"))
        elif state.cannot_start is not None:  # no process of this session can start
            ran = Ran(state.cannot_start.reports(item), spec, start_failure=state.cannot_start)
        elif spec.distributed:  # its ranks (even one), waited for as one
            ran = distributed.run_ranks(item, plan, state, worker, turn)
            said = _tell_start_problems(item, worker.changed())  # as _finish does
            if said and ran.stop is None:
                ran = dataclasses.replace(ran, stop=said[0])
            _prewarm_safely(item, nextitem, state, worker)
            warmed = True
        else:
            running = _go(item, plan, state, worker, turn)
            _prewarm_safely(item, nextitem, state, worker)
            warmed = True
            ran = _finish(item, plan, state, worker, turn, running)
    except (CannotRun, StartError, workdir.WorkdirError, OSError) as exc:  # out of
        ran = Ran(setup_error_reports(item, _why(exc)), spec)  # processes, files, GPUs:
    finally:  # this test fails, the session goes on
        if worker is not None:
            turn.release(worker)
    if ran.stop is None and not warmed and worker is not None:
        _prewarm(item, nextitem, state, worker)
    return ran


def _why(exc: Exception) -> str:
    """The setup error of a test that could not run for ``exc``; an ``OSError`` other
    than running out of processes or descriptors is raised again."""
    if not isinstance(exc, OSError):
        return str(exc)
    if exc.errno not in workdir.EXHAUSTED:
        raise exc
    return f"could not watch the isolated process: {workdir.describe(exc)}"


def finish_item(item: pytest.Item, nextitem: pytest.Item | None, ran: Ran, attempt: int) -> None:
    """The test's last attempt: tear down the parent's fixtures ``nextitem`` no longer
    needs (an error there fails this test's teardown), then attach the record."""
    if ran.stop is None:
        _teardown_parent_stack(item, nextitem, ran.reports)
    attach_record(ran.reports, ran.record(item, attempt))  # once every report is final


def mark_rerun(item: pytest.Item, ran: Ran, attempt: int) -> None:
    """An attempt that runs again in a fresh process: its failed reports become "rerun"
    (as pytest-rerunfailures logs them) and its record says so."""
    record = ran.record(item, attempt, rerun=True)
    for report in ran.reports:
        if report.failed:
            report.outcome = "rerun"  # type: ignore[assignment] - pytest-rerunfailures' word
    attach_record(ran.reports, record)


def stop_session(stop: SessionStop) -> None:
    """End the session as the test's ``pytest.exit()`` or Ctrl-C did in its process."""
    if stop.interrupt:
        raise KeyboardInterrupt(stop.message)
    pytest.exit(stop.message, returncode=stop.returncode)


def _go(item: pytest.Item, plan: Plan, state: State, worker: Worker, turn: Turn) -> Running:
    """Lease the test's GPUs (in this process) and port, and give its process its go;
    ``CannotRun`` where it cannot get them."""
    spec, gpus = plan.spec, worker.gpus
    n = plan.gpus
    checks = worker.health  # there with the lease table: there are GPUs to lease
    if n > 0 and gpus.leases is not None and checks is not None:
        pinned = pinned_part(worker, n, spec.gpu_memory)
        turn.owned = pinned is None
        if turn.started is None and turn.owned:  # start its process while it waits: the
            turn.started = worker.waiting(plan.job)  # the lease is used from its first ms
        try:
            turn.lease = turn.lease or checks.lease(
                n, item.nodeid, worker.settings.lease_timeout, spec.gpu_memory, pinned
            )
        except LeaseError as exc:  # a timeout, a slot-count conflict, a stuck table
            raise CannotRun(str(exc)) from None
    env = gpus.go_env(turn.lease)
    if state.master_port:
        try:
            turn.port = ports.lease()
        except ports.PortError as exc:  # none free, or binding refused: this test and
            state.master_port = False  # the rest run without one, said once
            worker.notice(str(exc))
        except OSError as exc:  # out of descriptors: starting its process fails too,
            if exc.errno not in workdir.EXHAUSTED:  # and says why
                raise
        if turn.port is not None:
            env.update(turn.port.env())
    turn.env = env
    turn.started = worker.ready(turn.started, plan.job, env)
    turn.probes = probes_for(plan, state, worker, turn.lease)
    return turn.go(worker, Bounds(spec.timeout, spec.startup_timeout, spec.grace))


def _finish(
    item: pytest.Item, plan: Plan, state: State, worker: Worker, turn: Turn, running: Running
) -> Ran:
    """Wait for the test's process, judge its GPUs before anyone else may lease them, give
    back its lease and port; then its verdict (``verdict.assemble``)."""
    outcome = _wait(plan, state, worker, turn, running)
    checked = None
    gpu = verdict.gpu_probe(turn.probes)
    if turn.lease is not None and worker.health is not None:
        others = gpu.others if gpu is not None else None  # NVML pids on its GPUs not its
        run_end = outcome.run_end()
        checked = worker.health.after(item.nodeid, turn.lease, run_end, plan.shared, others)
    port = turn.port.port if turn.port is not None else None
    held = verdict.Held(turn.lease, turn.probes, port, checked)
    turn.release(worker)
    # what the test changed: taught modules, prewarming turned off; said as notices
    start_error = _tell_start_problems(item, worker.changed())
    return verdict.assemble(item, plan.spec, state, outcome, held, start_error)


def _wait(plan: Plan, state: State, worker: Worker, turn: Turn, running: Running) -> Outcome:
    """The test's outcome. Its process initialised CUDA before it knew its GPUs, or died
    before it read its go (killed by someone who cleans up processes): none of the test
    ran there, a fresh one runs it (at most ``supervisor.REPLACEMENTS`` times for the
    second)."""
    outcome = running.wait()
    replaced = 0
    while outcome.sent.stale is not None or running.unstarted is not None:
        if running.unstarted is not None:
            replaced += 1
            if replaced > supervisor.REPLACEMENTS:
                raise StartError(supervisor.unstarted_error(running.unstarted, replaced))
        stale = outcome.sent.stale if running.unstarted is None else None
        turn.started = worker.again(plan.job, dict(turn.env), stale)
        turn.probes = probes_for(plan, state, worker, turn.lease)
        running = turn.go(worker, running.bounds)
        outcome = running.wait()
        outcome.launch.prewarmed = False
    return outcome


def _prewarm_safely(
    item: pytest.Item, nextitem: pytest.Item | None, state: State, worker: Worker
) -> None:
    """``_prewarm`` while the test runs: a failure there must not cost the test."""
    try:
        _prewarm(item, nextitem, state, worker)
    except Exception as exc:
        worker.notice(f"prewarming failed: {exc}")


def _prewarm(item: pytest.Item, nextitem: pytest.Item | None, state: State, worker: Worker) -> None:
    """Have the processes of the next isolated tests started (see ``prewarm``): the
    first ``depth`` isolated tests past this one, those that run in a process."""
    candidates = worker.upcoming(item.session.items, nextitem, state.parallel)
    if not candidates:
        return
    wanted = worker.settings
    upcoming = list({c.nodeid: c for c in candidates if wants_isolation(c, wanted)}.values())
    jobs = []
    for candidate in upcoming[: worker.ahead]:
        try:
            plan = plan_for(candidate, worker)
        except OSError:  # its temporary directory: its own run says why
            continue
        if plan.runs and not plan.spec.distributed:  # a distributed test's ranks start together
            jobs.append(WarmJob(candidate.nodeid, plan.job, plan.warm_env))
    worker.prepare_next(jobs)


def _tell_start_problems(item: pytest.Item, messages: list[str]) -> list[SessionStop]:
    """Say once (as a warning of the session) that the fork server or prewarming is not
    used, and why (``messages``: the worker's notices). A filter that makes
    ``GpuIsoStartWarning`` an error ends the session after this test, as a usage error
    (returned as the stop of ``Ran``)."""
    for text in messages:  # the session's, not this test's: no test location
        if not warn_session(item.config, GpuIsoStartWarning(f"gpu-isolate: {text}")):
            message = f"gpu-isolate: {text} (GpuIsoStartWarning is an error by -W/filterwarnings)"
            return [SessionStop(False, message, pytest.ExitCode.USAGE_ERROR)]
    return []


def _teardown_parent_stack(item: pytest.Item, nextitem: pytest.Item | None, reports: list) -> None:
    """Tear down fixtures that earlier in-process tests left up and ``nextitem`` no longer needs.

    In-process, this teardown would belong to the test run just before
    ``nextitem``, so an error in it fails this test's teardown (an expected failure
    of an xfail test, as pytest's skipping plugin makes it in-process).
    """
    setupstate = _compat.setup_state(item.session)
    if setupstate is None or not setupstate.stack:
        return
    settle(item.config)  # pytest's own code runs: see settle
    call = pytest.CallInfo.from_call(lambda: setupstate.teardown_exact(nextitem), when="teardown")
    if call.excinfo is None or not reports or reports[-1].when != "teardown":
        return
    failed = item.ihook.pytest_runtest_makereport(item=item, call=call)
    apply_xfail(item, failed, call.excinfo.value)
    failed.sections = list(reports[-1].sections) + list(failed.sections)
    reports[-1] = failed
