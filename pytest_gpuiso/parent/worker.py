"""What one pytest process isolates tests with, made together once (``make_worker``).

The ``Worker`` holds the process door (``Launcher``: spawn or the fork server, each
process until its run), its ``Prewarmer`` (always there: depth 0 is prewarming off) and
the GPUs' ``Health`` (there where this session has GPUs to lease). It is made when
isolating first needs it: at the session's start where every test is isolated (the fork
server starts then), when collection found isolated tests, or at the first isolated
test; never in a process that isolates nothing (xdist's controller, a session whose
tests all run in-process). What it is made from is known before: the settings and the
GPUs, their lease table and pins (``session.prepare``, at configure where pins are
taken before collection).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pytest

from ..child import imports
from ..forkserver import ServerBoot
from ..gpu.health import Health
from ..leaks.shm_log import preload_env, preloadable
from ..proc import workdir
from ..proc._linux import set_child_subreaper
from .launcher import Launcher
from .prewarm import Prewarmer

PREWARM_OFF = "prewarming is off (--gpu-isolate-prewarm=0)"


@dataclass
class Worker:
    """The means of isolating tests in one pytest process, every part present."""

    launcher: Launcher  # the door: every test's process starts and ends its run here
    prewarmer: Prewarmer  # the next tests' processes, started while one runs
    health: Health | None  # the leased GPUs' health (None: no GPUs to lease here)

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
