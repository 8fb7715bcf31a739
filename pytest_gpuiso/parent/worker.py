"""What one pytest process isolates tests with, made together once, and the one door its
tests' processes go through. Imported when isolating is first needed: the lazy boundary.

``prepare`` finds the session's GPUs once (``gpu.pool.GpuPool``: the devices, the lease
table, NVML, pinned workers' GPUs), ends what dead sessions left, at configure where
workers are pinned (their GPUs are taken before collection), else when the first
isolated test shows up (xdist's controller prepares for its pins, and makes no worker).
``start_worker`` makes the session's ``Worker`` once, every part present: the settings,
the GPUs, what plugins want set in the tests' processes (``child_options``), the process
door (``Launcher``: spawn or the fork server, each process until its run), its
``Prewarmer`` (always there: depth 0 is prewarming off) and the GPUs' ``Health`` (there
where this session has GPUs to lease). It is made at the session's start where every
test is isolated (the fork server starts then), when collection found isolated tests,
or by the hook that runs the first isolated test, which hands it to the runner; never in
a process that isolates nothing (xdist's controller, a session whose tests all run
in-process).

The runner asks the worker, never its parts, in a few verbs: for a test's plan, its
process (``take`` the prewarmed one, ``waiting`` while its lease is awaited, ``ready``
at its turn, ``again`` when it must be replaced; a ``group`` of them, started in
parallel, for a test of N processes), its ``go``; while a test runs, the
next tests' processes (``prepare_next``); after it, what changed (``changed``: what the
tests taught the fork server, prewarming turned off, notices to say); ``discard`` and
``notice`` at any time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

from .._lease import RegionError
from ..child import imports
from ..forkserver import ServerBoot
from ..gpu import pinning
from ..gpu.devices import discover
from ..gpu.health import Health
from ..gpu.leases import Leases
from ..gpu.pool import GpuPool
from ..leaks import Probe
from ..leaks.shm import DeadSessionShm
from ..leaks.shm_log import preload_env, preloadable
from ..proc import dead_sessions, workdir
from ..proc._linux import set_child_subreaper
from ..settings import Settings
from ..values import SpecError
from . import supervisor
from .launcher import Launcher
from .prewarm import Prewarmer, WarmJob
from .session import State, warn_start
from .started import Started
from .supervisor import Running
from .watch import Bounds

if TYPE_CHECKING:
    from ..wire.payloads import Stale

PREWARM_OFF = "prewarming is off (--gpu-isolate-prewarm=0)"


@dataclass
class Worker:
    """The means of isolating tests in one pytest process, every part present."""

    settings: Settings
    gpus: GpuPool  # the session's GPUs: what its tests lease, from which table, NVML, pins
    options: tuple[tuple[str, Any], ...]  # what plugins want set in the tests' processes
    launcher: Launcher  # the door: every test's process starts and ends its run here
    prewarmer: Prewarmer  # the next tests' processes, started while one runs
    health: Health | None  # the leased GPUs' health (None: no GPUs to lease here)

    # ------------------------------------------------ a test's process, for its plan

    def take(self, nodeid: str) -> Started | None:
        """The process started ahead for the test ``nodeid``, if there is one."""
        return self.prewarmer.take(nodeid)

    def waiting(self, job: Any) -> Started | None:
        """Start ``job``'s process while its test waits for its lease (it sees no GPU
        until its go); None when prewarming is off or it cannot start (its turn says why)."""
        return self.prewarmer.start_waiting(job)

    def ready(self, started: Started | None, job: Any, env: dict[str, str]) -> Started:
        """The process that runs ``job`` at its turn: ``started`` if it still waits, else
        a fresh one (``launcher.StartError`` when none can start)."""
        return self.launcher.ready(started, job, env)

    def group(self, jobs: list[Any], envs: list[dict[str, str]]) -> list[Started]:
        """One process for each of ``jobs`` with its ``envs`` (a distributed test's
        ranks), started in parallel: every start is asked for (the fork server gets
        every request) before any is waited for. All or none: when one cannot start, the
        others are discarded and ``launcher.StartError`` says why."""
        started: list[Started] = []
        try:
            for job, env in zip(jobs, envs, strict=True):
                started.append(self.launcher.start(job, dict(env), warm=True))
            for i, (job, env) in enumerate(zip(jobs, envs, strict=True)):
                started[i] = self.launcher.ready(started[i], job, dict(env))
        except BaseException:
            for process in started:
                self.discard(process)
            raise
        return started

    def again(self, job: Any, env: dict[str, str], stale: Stale | None) -> Started:
        """A fresh process for ``job``: its process could not take its GPUs (``stale``:
        what it said; the prewarmer's policy learns from it) or died before its go."""
        if stale is not None:
            self.prewarmer.replaced(stale)
        return self.launcher.start(job, env)

    def go(
        self,
        started: Started,
        env: dict[str, str],
        probes: tuple[Probe, ...],
        bounds: Bounds,
    ) -> Running:
        """Give ``started`` its go (see ``supervisor.go``): from now on it is its run's."""
        return supervisor.go(self.launcher, started, env, probes, bounds)

    def discard(self, started: Started) -> None:
        """Kill and tidy up a process that will not run (or whose run was abandoned)."""
        self.launcher.discard(started)

    def notice(self, text: str) -> None:
        """Say ``text`` once, with the next test (a warning of the session)."""
        self.launcher.serving.notice(text)

    # ------------------------------------------------ the session's side

    def start_server(self) -> None:
        """Start the fork server now (it loads while pytest collects), if the session forks."""
        self.launcher.serving.start_server()

    def precollect(
        self, directories: list[str], modules: list[str], initial: tuple[str, ...] = ()
    ) -> None:
        """Have the fork server load the conftests of ``directories`` and its template
        collect ``modules``, when there is a server; ``initial``: the paths pytest's
        session started from (what its rewrite hook takes for the command line's)."""
        self.launcher.serving.collect(directories, modules, initial)

    def settle(self) -> None:
        """Reap the tests' processes the kernel still tears down, before test code runs
        in pytest's own process (its ``os.wait()`` could take them)."""
        self.launcher.reap_ending()

    # ------------------------------------------------ while a test runs, and after

    def upcoming(self, items: list[Any], nextitem: Any, parallel: bool) -> list[Any]:
        """The items whose processes may start now (none while prewarming is off)."""
        if self.prewarmer.disabled is not None:
            return []
        return self.prewarmer.following(items, nextitem, parallel)

    @property
    def ahead(self) -> int:
        """How many of the next tests' processes start ahead (0: prewarming is off)."""
        return self.prewarmer.depth

    def prepare_next(self, jobs: list[WarmJob]) -> None:
        """Have the next tests' processes started (the first ``ahead`` of ``jobs``)."""
        self.prewarmer.refill(jobs)

    def changed(self) -> list[str]:
        """After a test: the waiting processes of a module that taught the fork server
        started again from its successor, prewarming turned off if a prewarmed process
        could not take its GPUs; returns the notices to say (once each)."""
        taught = self.launcher.serving.taught()
        if taught is not None:
            self.prewarmer.restart(taught)
        prewarmer = self.prewarmer
        if prewarmer.stale and prewarmer.disabled is None:
            prewarmer.disable(prewarmer.stale)  # the notices say why
        return self.launcher.serving.news()

    def close(self, cache: Any, remember: bool) -> None:
        """Discard prewarmed processes and stop the fork server; ``remember``: keep what
        the tests taught it for the next session (in pytest's ``cache``)."""
        self.prewarmer.close()
        server = self.launcher.serving.server
        if server is not None and remember:
            imports.remember(cache, server.learnt, server.unfit)
        self.launcher.close()


def prepare(config: pytest.Config, state: State) -> None:
    """What isolating needs before its first test, done once: the work directory,
    what dead sessions' tests left running, the GPUs and their lease table, pinned
    workers' GPUs (``state.gpus``). At configure when every test is isolated or workers
    are pinned; otherwise when the first isolated test (or ``gpu_isolated_run``) shows
    up, so that a session that isolates nothing does no NVML or ``/dev/shm`` work."""
    if state.prepared or state.settings.mode == "off":
        return
    state.prepared = True
    settings = state.settings
    if settings.mode == "all":  # every test needs it: a taken name is the session's error
        try:
            workdir.root()
        except workdir.WorkdirError as exc:
            raise pytest.UsageError(f"gpu-isolate: {exc}") from None
    # and what the tests of dead sessions left running, and in /dev/shm
    dead_shm = DeadSessionShm(settings.shm_ignore, settings.cleanup)
    ended = workdir.clean_stale(on_dead=dead_shm.take)
    if ended:
        warn_start(config, dead_sessions.describe(ended))
    left = dead_shm.dispose()
    if left:
        warn_start(config, left)
    gpus = state.gpus
    try:
        sizes = dict(settings.device_sizes)
        gpus.devices = discover(settings.devices, settings.devices_source, sizes, gpus.nvml)
        if gpus.devices.names:
            gpus.leases = Leases(gpus.devices, settings.slots)
    except (RegionError, SpecError) as exc:  # a bad device list, a table not ours
        raise pytest.UsageError(f"gpu-isolate: {exc}") from None
    died = gpus.leases.died_text() if gpus.leases is not None and not state.parallel else ""
    if died:  # what the lease table says of a session killed with a test on its GPUs
        warn_start(config, died)
    problem = pinning.problem(config, settings, gpus.devices)
    if problem is not None:
        raise pytest.UsageError(f"gpu-isolate: {problem}")
    # before any test module is collected; the controller's, before it starts workers
    gpus.pins = pinning.pin(config, settings, gpus.leases)
    gpus.pin = pinning.own(config, settings, gpus.pins, gpus.leases)


def start_worker(config: pytest.Config, state: State) -> Worker | None:
    """The session's worker, made once (``prepare`` first); None when this process's
    work directory cannot be made (``state.no_worker`` says why: each isolated test
    then fails with it; the next one tries again)."""
    if state.worker is None:
        prepare(config, state)
        try:
            state.worker = make_worker(config, state, child_options(config))
        except workdir.WorkdirError as exc:
            state.no_worker = str(exc)
    return state.worker


def start_server(config: pytest.Config, state: State) -> Worker | None:
    """Make the worker and start the fork server; None when the work directory or a
    resource it needs is missing (each isolated test then says why, as the failure of
    its own start)."""
    worker = start_worker(config, state)
    if worker is None:
        return None
    try:
        worker.start_server()
    except OSError:
        return None
    return worker


def child_options(config: pytest.Config) -> tuple[tuple[str, Any], ...]:
    """What plugins want set in the tests' processes (``pytest_gpuiso_child_options``),
    asked once a session, when its worker is made."""
    merged: dict[str, Any] = {}
    for answer in config.hook.pytest_gpuiso_child_options(config=config):
        merged.update(answer or {})  # in call order: a later answer wins
    return tuple(merged.items())


def make_worker(
    config: pytest.Config, state: State, options: tuple[tuple[str, Any], ...]
) -> Worker:
    """The worker of ``state``. Raises ``workdir.WorkdirError`` when this process's
    work directory cannot be made.

    ``options``: what plugins want set in the tests' processes."""
    s = state.settings
    directory = workdir.process_dir()
    reaper = set_child_subreaper()  # before the fork server starts: it relies on it
    shm = s.leak_level("shm") != "off"
    launcher = Launcher(
        directory,
        capture_output=config.getoption("capture") not in ("no", "tee-sys"),
        start=s.start,
        subreaper=reaper,
        exec_env=preload_env() if shm else {},
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
            cleanup=s.cleanup,
            options=options,
        ),
    )
    prewarmer = Prewarmer(launcher, s.prewarm)
    if not s.prewarm:
        prewarmer.disabled = PREWARM_OFF
    unloadable = preloadable()[1]
    if unloadable and shm:  # said once, with the first test
        launcher.serving.notice(
            f"the /dev/shm shim cannot be preloaded ({unloadable}): a leaked /dev/shm "
            "entry is told by what /dev/shm held before and after the test alone"
        )
    gpus = state.gpus
    health = None
    if gpus.leases is not None:
        health = Health(gpus.leases, gpus.nvml, s.health, s.reprobe)
    return Worker(s, gpus, options, launcher, prewarmer, health)
