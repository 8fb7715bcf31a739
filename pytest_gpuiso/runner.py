"""One isolated test, parent side: its GPUs, its lease, its probes, its run, its verdict.

``run_item`` runs one attempt, from the test's turn to its reports; ``finish_item``
makes the last attempt's reports final (``mark_rerun`` an attempt run again):

1. resolve the test's ``IsolationSpec`` (a bad marker: the test's setup error);
2. skip it when it needs more GPUs than there are; lease them (in this process:
   a child that crashes can never strand a GPU);
3. run it in a fresh process (``Supervisor.run``; a prewarmed one when there is
   one), with the leak probes of the session's policy;
4. judge the leaks, replay the child's warnings and junit properties, echo what
   it wrote outside capture, and turn the ``Outcome`` into pytest reports
   (``results``);
5. after the last attempt, tear down the parent's own fixtures that ``nextitem``
   no longer needs, as in-process; attach each attempt's JSON record to its last
   report.

The session-wide side (one ``Supervisor``, the lease table, prewarming) lives
in ``State``, in the config's stash.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from . import _compat, frames, imports, pinning, ports, replay, workdir
from ._linux import set_child_subreaper
from .child import ItemJob
from .forkserver import ServerBoot
from .leaks import Probe, Verdict, judge
from .leaks import torch as torch_check
from .leaks.gpu_memory import GpuMemoryProbe, NvmlReader
from .leaks.shm import ShmProbe, preload_env
from .leases import Devices, Lease, LeaseError, Leases
from .memory_cap import MEMORY_ENV
from .outcome import Outcome
from .prewarm import HIDDEN_GPUS, Prewarmer
from .proctree import REAP_WAIT
from .record import attach_record, build_record
from .results import apply_xfail, item_reports, setup_error_reports, skip_reports
from .settings import IsolationSpec, Settings, SpecError, spec_for_item, wants_isolation
from .supervisor import Started, StartError, Supervisor
from .warning_types import GpuIsoStartWarning, warn_session


@dataclass
class State:
    """The session's side of isolation, in one pytest process (a worker under xdist)."""

    settings: Settings
    report_path: Path | None = None
    summary_path: Path | None = None
    records: list[dict[str, Any]] = field(default_factory=list)
    supervisor: Supervisor | None = None
    devices: Devices = Devices((), "none")
    leases: Leases | None = None  # None: no GPUs, nothing to lease
    nvml: NvmlReader = field(default_factory=NvmlReader)
    parallel: bool = False  # an xdist worker: other isolated tests run at the same time
    prewarmer: Prewarmer | None = None
    child_options: tuple[tuple[str, Any], ...] | None = None  # pytest_gpuiso_child_options
    positions: dict[int, int] | None = None  # id(item) -> index in session.items
    told: int = 0  # how many of the supervisor's notices were shown
    master_port: bool = field(default_factory=ports.wanted)  # lease each test a MASTER_PORT
    pin: Lease | None = None  # the GPUs this process has for life (--gpu-isolate-pin-workers)
    pins: list[Lease] = field(default_factory=list)  # pinning leases this process took
    pinned_to: dict[str, Lease] = field(default_factory=dict)  # controller: worker -> lease
    cache: Any = None  # pytest's cache (config.cache; none with -p no:cacheprovider)


STATE = pytest.StashKey[State]()


@dataclass
class Ran:
    """What became of one isolated test: its reports and what its record is made of."""

    reports: list[pytest.TestReport]
    spec: IsolationSpec | None = None
    outcome: Outcome | None = None  # None: no process ran
    lease: Lease | None = None
    verdict: Verdict | None = None
    stop: dict[str, Any] | None = None  # pytest.exit() or Ctrl-C in the test: end the session
    payload: dict[str, Any] = field(default_factory=dict)  # pytest_gpuiso_child_payload's
    peak: int | None = None  # most GPU memory its processes held on one GPU (NVML)
    port: int | None = None  # its MASTER_PORT (None: the user's own, or none leased)

    @property
    def complete(self) -> bool:
        """No process ran, or it finished: it neither crashed nor timed out."""
        return self.outcome is None or self.outcome.finished

    def record(self, nodeid: str, attempt: int = 1, rerun: bool = False) -> dict[str, Any]:
        return build_record(
            nodeid,
            self.reports,
            self.outcome,
            self.spec,
            self.lease,
            self.verdict,
            attempt,
            rerun,
            self.peak,
            self.port,
        )


def isolated(item: pytest.Item) -> bool:
    state = item.config.stash.get(STATE, None)
    return state is not None and wants_isolation(item, state.settings)


def run_item(item: pytest.Item, nextitem: pytest.Item | None) -> Ran:
    """Run one attempt of an isolated test (its turn has come); ``finish_item`` or
    ``mark_rerun`` then make its reports final."""
    state = item.config.stash[STATE]
    started = state.prewarmer.take(item.nodeid) if state.prewarmer is not None else None
    prewarmed: list[bool] = []

    def prewarm() -> None:
        """Start the next tests' processes: once this test has its go, or was not run."""
        if not prewarmed:
            prewarmed.append(True)
            _prewarm(item, nextitem, state)

    try:
        spec = spec_for_item(item, state.settings)
    except SpecError as exc:
        ran = Ran(setup_error_reports(item, str(exc)))
    else:
        try:
            ran = _run(item, spec, state, started, prewarm)
        except (StartError, workdir.WorkdirError) as exc:  # out of processes, files: this
            ran = Ran(setup_error_reports(item, str(exc)), spec)  # test fails, the session goes on
        except OSError as exc:
            if exc.errno not in workdir.EXHAUSTED:
                raise
            why = f"could not watch the isolated process: {workdir.describe(exc)}"
            ran = Ran(setup_error_reports(item, why), spec)
        started = None
    finally:
        if started is not None:
            supervisor(item.config, state).discard(started)
    if ran.stop is None:
        prewarm()
    return ran


def settle(config: pytest.Config) -> None:
    """Before test code runs in pytest's own process (a test, a fixture's teardown): reap
    the isolated tests' processes the kernel still tears down (``leaving``), which its
    own ``os.wait()`` could take."""
    state = config.stash.get(STATE, None)
    if state is not None and state.supervisor is not None:
        state.supervisor.ending.reap(REAP_WAIT)


def finish_item(item: pytest.Item, nextitem: pytest.Item | None, ran: Ran, attempt: int) -> None:
    """The test's last attempt: tear down the parent's fixtures ``nextitem`` no longer
    needs (an error there fails this test's teardown), then attach the record."""
    if ran.stop is None:
        _teardown_parent_stack(item, nextitem, ran.reports)
    attach_record(ran.reports, ran.record(item.nodeid, attempt))  # once every report is final


def mark_rerun(item: pytest.Item, ran: Ran, attempt: int) -> None:
    """An attempt that runs again in a fresh process: its failed reports become "rerun"
    (as pytest-rerunfailures logs them) and its record says so."""
    record = ran.record(item.nodeid, attempt, rerun=True)
    for report in ran.reports:
        if report.failed:
            report.outcome = "rerun"  # type: ignore[assignment] - pytest-rerunfailures' word
    attach_record(ran.reports, record)


def stop_session(stop: dict[str, Any]) -> None:
    """End the session as the test's ``pytest.exit()`` or Ctrl-C did in its process."""
    if stop["interrupt"]:
        raise KeyboardInterrupt(stop["message"])
    pytest.exit(stop["message"], returncode=stop["returncode"])


def gpus_wanted(spec: IsolationSpec, state: State) -> int:
    """What an isolated test (marked, or isolated by --gpu-isolate) leases: its marker's
    gpus, else --gpu-isolate-gpus, else 1 where there are GPUs to lease and 0 where none."""
    return spec.gpus if spec.gpus is not None else default_gpus(state.settings, state.devices)


def default_gpus(settings: Settings, devices: Devices) -> int:
    """What a test leases when its marker does not say: --gpu-isolate-gpus, else 1 where
    there are GPUs to lease and 0 where none."""
    if settings.gpus is not None:
        return settings.gpus
    return 1 if devices.names else 0


def _run(
    item: pytest.Item,
    spec: IsolationSpec,
    state: State,
    started: Started | None,
    after_go: Callable[[], None] | None = None,
) -> Ran:
    """Lease the test's GPUs (in this process), run it in a child, release after reaping.

    ``started``: the test's prewarmed process, if any; discarded when the test does not run.
    ``after_go``: called once the child has its go (prewarming the next tests then keeps
    their starts from delaying this one).
    """
    runs = supervisor(item.config, state)
    n = gpus_wanted(spec, state)
    lease = port = None
    owned = True  # the lease is the test's own (not its pinned worker's): release it
    try:
        missing = state.devices.shortfall(n, spec.gpu_memory)
        if missing is not None:
            return Ran(skip_reports(item, f"gpu-isolate: test needs {missing}"))
        job = started.job if started is not None else _item_job(item, state.settings)
        if n > 0 and state.leases is not None:
            lease = pinning.within(state.pin, n, spec.gpu_memory, state.devices)
            owned = lease is None
            never = pinning.never_granted(state.leases, state.pin, n) if owned else None
            if never is not None:
                return Ran(setup_error_reports(item, never), spec)
            if started is None and owned:  # start its process while it waits: the lease
                started = _warm_while_waiting(job, state, runs)  # is used from its first ms
            try:
                lease = lease or state.leases.acquire(
                    n, item.nodeid, state.settings.lease_timeout, spec.gpu_memory
                )
            except LeaseError as exc:  # a timeout, a slot-count conflict, a stuck table
                return Ran(setup_error_reports(item, str(exc)))
        env = state.leases.child_env(lease) if state.leases is not None else {}
        env.setdefault(MEMORY_ENV, "")  # no lease of memory: never one inherited from our env
        if state.master_port:
            try:
                port = ports.lease()
            except ports.PortError as exc:
                return Ran(setup_error_reports(item, str(exc)), spec)
            except OSError as exc:  # out of descriptors: starting its process fails too,
                if exc.errno not in workdir.EXHAUSTED:  # and says why
                    raise
            if port is not None:
                env.update(port.env())
        probes = _probes(spec, state, lease)
        outcome, started = (
            runs.run(
                job,
                timeout=spec.timeout,
                grace=spec.grace,
                startup=spec.startup_timeout,
                env=env,
                probes=probes,
                started=started,
                after_go=after_go,
            ),
            None,
        )
    finally:
        if started is not None:
            runs.discard(started)
        if lease is not None and owned:
            state.leases.release(lease)
        if port is not None:
            port.release()
    start_error = _tell_start_problems(item, state, runs)
    leaks = outcome.leaks + [
        torch_check.leak(data) for data in outcome.frames_of(frames.TORCH_LEAK)
    ]
    verdict = judge(leaks, dict(state.settings.leaks), spec.allow_leaks)
    replay.replay_warnings(item.config, outcome.frames_of(frames.WARNING))
    verdict = replay.warn_leaks(item, verdict)
    replay.replay_junit(item.config, outcome.frames_of(frames.JUNIT))
    replay.warn_cuda_without_gpu(item, spec.gpus == 0, outcome.frames_of(frames.DRIVER))
    if outcome.finished and outcome.output:
        replay.echo(item.config, outcome.output)
    stop = outcome.frames_of(frames.EXIT) or start_error
    reports = item_reports(item, spec, outcome, verdict)
    payload: dict[str, Any] = {}
    for sent in outcome.frames_of(frames.PAYLOAD):  # one, unless a plugin misbehaved
        payload.update(sent)
        item.config.hook.pytest_gpuiso_parent_payload(item=item, payload=sent, reports=reports)
    peak = next((p.peak for p in probes if isinstance(p, GpuMemoryProbe)), None)
    stopped = stop[0] if stop else None
    number = port.port if port is not None else None
    return Ran(reports, spec, outcome, lease, verdict, stopped, payload, peak, number)


def _warm_while_waiting(job: ItemJob, state: State, runs: Supervisor) -> Started | None:
    """Start a test's process ahead of its lease, as prewarming does (seeing no GPU until
    its go); None when prewarming is off for the session."""
    if state.prewarmer is None or state.prewarmer.disabled is not None:
        return None
    try:
        return runs.start(job, dict(HIDDEN_GPUS), warm=True)
    except StartError:
        return None  # its run starts it again, and reports why it cannot


def supervisor(config: pytest.Config, state: State) -> Supervisor:
    """The session's supervisor, made on first use (with the prewarmer)."""
    if state.supervisor is None:
        s = state.settings
        reaper = set_child_subreaper()  # before the fork server starts: it relies on it
        state.supervisor = Supervisor(
            workdir.process_dir(),
            capture_output=config.getoption("capture") not in ("no", "tee-sys"),
            start=s.start,
            exec_env=preload_env() if s.leak_level("shm") != "off" else {},
            shm_cleanup=s.cleanup,
            server_boot=ServerBoot(
                parent_pid=os.getpid(),
                preload=s.preload,
                args=tuple(config.invocation_params.args),
                invocation_dir=str(config.invocation_params.dir),
                collect_all=s.precollect and s.mode == "all",  # the template collects the args
                learn=s.learn_imports,
                learnt=imports.remembered(state.cache) if s.learn_imports else (),
                template_wait=s.template_wait,
                options=child_options(config, state),
            ),
        )
        if s.start == "forkserver" and not reaper:
            state.supervisor.method = "spawn"
            state.supervisor.notices.append(
                "the fork server needs PR_SET_CHILD_SUBREAPER (Linux); "
                "isolated tests are started with spawn instead"
            )
        if s.prewarm:
            state.prewarmer = Prewarmer(state.supervisor, s.prewarm)
    return state.supervisor


def child_options(config: pytest.Config, state: State) -> tuple[tuple[str, Any], ...]:
    """What plugins want set in the tests' processes (``pytest_gpuiso_child_options``),
    asked once a session."""
    if state.child_options is None:
        merged: dict[str, Any] = {}
        for answer in config.hook.pytest_gpuiso_child_options(config=config):
            merged.update(answer or {})  # in call order: a later answer wins
        state.child_options = tuple(merged.items())
    return state.child_options


def close(state: State) -> None:
    """Discard prewarmed processes, stop the fork server, release a pinned worker's GPUs."""
    if state.supervisor is not None:
        if state.prewarmer is not None:
            state.prewarmer.close()
        server = state.supervisor.server
        if server is not None and state.settings.learn_imports:  # for the next session
            imports.remember(state.cache, server.learnt, server.unfit)
        state.supervisor.close()
    if state.leases is not None:
        for lease in state.pins:
            state.leases.release(lease)
    state.pins, state.pin = [], None


_SHM_LOGS = itertools.count(1)


def _probes(spec: IsolationSpec, state: State, lease: Lease | None) -> tuple[Probe, ...]:
    """The leak probes of one test, besides the process sweep (which always runs)."""
    s = state.settings
    probes: list[Probe] = []
    if s.leak_level("shm") != "off":
        cleanup = s.cleanup and "shm" not in spec.allow_leaks
        log = workdir.process_dir() / f"shm-{next(_SHM_LOGS)}.log"
        probes.append(ShmProbe(s.shm_ignore, cleanup=cleanup, log=log, alone=not state.parallel))
    if lease is not None and s.leak_level("gpu_memory") != "off" and state.nvml.available():
        shared = s.slots > 1 or spec.gpu_memory is not None  # other tests may share its GPUs
        probes.append(GpuMemoryProbe(state.nvml, lease.devices, s.gpu_tolerance_mib, shared=shared))
    return tuple(probes)


_LOOKAHEAD = 64  # items scanned past nextitem for the next isolated ones


def _prewarm(item: pytest.Item, nextitem: pytest.Item | None, state: State) -> None:
    """Have the processes of the next isolated tests started (see ``prewarm``)."""
    try:
        supervisor(item.config, state)
    except workdir.WorkdirError:
        return  # each test's own start says why
    prewarmer = state.prewarmer
    if prewarmer is None or prewarmer.disabled is not None:
        return
    candidates: list[pytest.Item] = []
    if nextitem is not None:
        candidates = [nextitem]
        items = item.session.items
        if not state.parallel:  # under xdist only nextitem is known
            if state.positions is None:
                state.positions = {id(it): i for i, it in enumerate(items)}
            at = state.positions.get(id(nextitem))
            if at is not None:
                candidates = items[at : at + _LOOKAHEAD]
    by_id = {c.nodeid: c for c in candidates if isolated(c)}
    prewarmer.refill(list(by_id), lambda nodeid: _prepare_warm(by_id[nodeid], state))


def _prepare_warm(item: pytest.Item, state: State) -> tuple[ItemJob, dict[str, str]] | None:
    """The job and start environment of a test's prewarmed process; None: it won't run one."""
    try:
        spec = spec_for_item(item, state.settings)
    except SpecError:
        return None
    n = gpus_wanted(spec, state)
    if state.devices.shortfall(n, spec.gpu_memory) is not None:
        return None
    env: dict[str, str] = {}
    if state.leases is not None:
        env = state.leases.child_env(None) if n == 0 else dict(HIDDEN_GPUS)
    return _item_job(item, state.settings), env


def _tell_start_problems(item: pytest.Item, state: State, runs: Supervisor) -> list[dict]:
    """Say once (as a warning of the session) that the fork server or prewarming is not
    used, and why. A filter that makes ``GpuIsoStartWarning`` an error ends the session
    after this test, as a usage error (returned as the stop of ``Ran``)."""
    messages = runs.notices[state.told :]
    state.told = len(runs.notices)
    prewarmer = state.prewarmer
    if runs.stale and prewarmer is not None and prewarmer.disabled is None:
        prewarmer.disable(runs.stale)  # runs.notices says why
    for text in messages:  # the session's, not this test's: no test location
        if not warn_session(item.config, GpuIsoStartWarning(f"gpu-isolate: {text}")):
            message = f"gpu-isolate: {text} (GpuIsoStartWarning is an error by -W/filterwarnings)"
            return [dict(interrupt=False, message=message, returncode=pytest.ExitCode.USAGE_ERROR)]
    return []


def _item_job(item: pytest.Item, settings: Settings) -> ItemJob:
    config = item.config
    factory = getattr(config, "_tmp_path_factory", None)
    parent = factory.getbasetemp() if factory is not None else Path(tempfile.gettempdir())
    xml = replay.junit_xml(config)
    return ItemJob(
        nodeid=item.nodeid,
        collect_arg=_collect_arg(item),
        args=tuple(config.invocation_params.args),
        invocation_dir=str(config.invocation_params.dir),
        basetemp=tempfile.mkdtemp(prefix="isolated-", dir=parent),
        junit_family=getattr(xml, "family", None),
        torch_check=settings.torch_check,
        options=child_options(config, config.stash[STATE]),
    )


def _collect_arg(item: pytest.Item) -> str:
    """Narrow the child's collection to the test function when its name allows it.

    Parameter ids may hold ``::``, ``[`` or spaces, so the ``[...]`` part is never
    passed; the child picks the exact node id among what it collected.
    """
    path = str(item.path)
    _, sep, rest = item.nodeid.partition("::")
    names = rest.split("[", 1)[0]
    if sep and names and all(part.isidentifier() for part in names.split("::")):
        return f"{path}::{names}"
    return path


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
