"""What one pytest process isolates tests with, made together once (``make_worker``),
and the one door its tests' processes go through.

The ``Worker`` holds the process door (``Launcher``: spawn or the fork server, each
process until its run), its ``Prewarmer`` (always there: depth 0 is prewarming off) and
the GPUs' ``Health`` (there where this session has GPUs to lease). It is made when
isolating first needs it: at the session's start where every test is isolated (the fork
server starts then), when collection found isolated tests, or at the first isolated
test; never in a process that isolates nothing (xdist's controller, a session whose
tests all run in-process). What it is made from is known before: the settings and the
GPUs, their lease table and pins (``session.prepare``, at configure where pins are
taken before collection).

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

from ..child import imports
from ..forkserver import ServerBoot
from ..gpu.health import Health
from ..leaks import Probe
from ..leaks.shm_log import preload_env, preloadable
from ..proc import workdir
from ..proc._linux import set_child_subreaper
from . import supervisor
from .launcher import Launcher
from .prewarm import Prewarmer, WarmJob
from .started import Started
from .supervisor import Running
from .watch import Bounds

if TYPE_CHECKING:
    from ..wire.payloads import Stale

PREWARM_OFF = "prewarming is off (--gpu-isolate-prewarm=0)"


@dataclass
class Worker:
    """The means of isolating tests in one pytest process, every part present."""

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

    def group(self, job: Any, envs: list[dict[str, str]]) -> list[Started]:
        """One process for each of ``envs`` (a distributed test's ranks), all running
        ``job``, started in parallel: every start is asked for (the fork server gets
        every request) before any is waited for. All or none: when one cannot start, the
        others are discarded and ``launcher.StartError`` says why."""
        started: list[Started] = []
        try:
            for env in envs:
                started.append(self.launcher.start(job, dict(env), warm=True))
            for i, env in enumerate(envs):
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

    def precollect(self, directories: list[str], modules: list[str]) -> None:
        """Have the fork server load the conftests of ``directories`` and its template
        collect ``modules``, when there is a server."""
        self.launcher.serving.collect(directories, modules)

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


def make_worker(config: pytest.Config, state: Any, options: tuple[tuple[str, Any], ...]) -> Worker:
    """The worker of ``state`` (``session.State``). Raises ``workdir.WorkdirError`` when
    this process's work directory cannot be made: each isolated test then says why.

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
    health = None
    if state.leases is not None:
        health = Health(state.leases, state.nvml, s.health, s.reprobe)
    return Worker(launcher, prewarmer, health)
