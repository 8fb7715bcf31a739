"""The session's side of isolation, in one pytest process.

Two records live in the config's stash. ``State``, in every pytest process that may run
an isolated test (a worker under xdist, or the one process without it): the settings,
the lease table and GPUs, the session's ``Launcher`` and its ``Prewarmer`` (made on
first use); ``close`` gives it all back at the session's end. ``Controller``, in the
process that writes the reports (xdist's controller, or the one process without it):
where the reports go, the records they are made of, and which worker holds which
pinned GPUs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ..child import imports
from ..forkserver import ServerBoot
from ..gpu import ports
from ..gpu.devices import Devices
from ..gpu.health import Health
from ..gpu.leases import Lease, Leases
from ..gpu.nvml import NvmlReader
from ..leaks.shm_log import preload_env
from ..proc import workdir
from ..proc._linux import set_child_subreaper
from ..reports.baseline import Baseline
from ..settings import IsolationSpec, Settings, wants_isolation
from .launcher import Launcher
from .prewarm import Prewarmer


@dataclass
class State:
    """The session's side of isolation, in one pytest process (a worker under xdist)."""

    settings: Settings
    baseline: Baseline | None = None  # the known leaks (--gpu-isolate-leak-baseline)
    launcher: Launcher | None = None  # made on first use (``launcher``)
    devices: Devices = Devices((), "none")
    leases: Leases | None = None  # None: no GPUs, nothing to lease
    health: Health | None = None  # with the leases, made on first use (``health``)
    nvml: NvmlReader = field(default_factory=NvmlReader)
    parallel: bool = False  # an xdist worker: other isolated tests run at the same time
    prewarmer: Prewarmer | None = None
    child_options: tuple[tuple[str, Any], ...] | None = None  # pytest_gpuiso_child_options
    master_port: bool = field(default_factory=ports.wanted)  # lease each test a MASTER_PORT
    pin: Lease | None = None  # the GPUs this process has for life (--gpu-isolate-pin-workers)
    pins: list[Lease] = field(default_factory=list)  # pinning leases this process took
    cache: Any = None  # pytest's cache (config.cache; none with -p no:cacheprovider)
    warned: set[tuple[Any, ...]] = field(default_factory=set)  # warnings replayed (``replay``)


@dataclass
class Controller:
    """The reports' side of the session, in the process that writes them (xdist's
    controller, or the one process without xdist)."""

    report_path: Path | None = None
    summary_path: Path | None = None
    code_quality_path: Path | None = None  # GitLab's Code Quality report of the findings
    records: list[dict[str, Any]] = field(default_factory=list)  # every worker's
    pinned_to: dict[str, Lease] = field(default_factory=dict)  # worker -> its pinned GPUs


STATE = pytest.StashKey[State]()
CONTROLLER = pytest.StashKey[Controller]()


def isolated(item: pytest.Item) -> bool:
    state = item.config.stash.get(STATE, None)
    return state is not None and wants_isolation(item, state.settings)


def settle(config: pytest.Config) -> None:
    """Before test code runs in pytest's own process (a test, a fixture's teardown): reap
    the isolated tests' processes the kernel still tears down (``leaving``), which its
    own ``os.wait()`` could take."""
    state = config.stash.get(STATE, None)
    if state is not None and state.launcher is not None:
        state.launcher.reap_ending()


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


def launcher(config: pytest.Config, state: State) -> Launcher:
    """The session's launcher, made on first use (with its prewarmer)."""
    if state.launcher is None:
        s = state.settings
        reaper = set_child_subreaper()  # before the fork server starts: it relies on it
        state.launcher = Launcher(
            workdir.process_dir(),
            capture_output=config.getoption("capture") not in ("no", "tee-sys"),
            start=s.start,
            subreaper=reaper,
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
                cleanup=s.cleanup,
                options=child_options(config, state),
            ),
        )
        if s.prewarm:
            state.prewarmer = Prewarmer(state.launcher, s.prewarm)
    return state.launcher


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
    if state.launcher is not None:
        if state.prewarmer is not None:
            state.prewarmer.close()
        server = state.launcher.serving.server
        if server is not None and state.settings.learn_imports:  # for the next session
            imports.remember(state.cache, server.learnt, server.unfit)
        state.launcher.close()
    if state.leases is not None:
        for lease in state.pins:
            state.leases.release(lease)
    state.pins, state.pin = [], None


def start_server(config: pytest.Config, state: State) -> Launcher | None:
    """Start the fork server; None when the work directory or a resource it needs is
    missing (each isolated test then says why, as the failure of its own start)."""
    try:
        started = launcher(config, state)
        started.serving.start_server()
    except (workdir.WorkdirError, OSError):
        return None
    return started


def health(state: State) -> Health | None:
    """The session's GPU health (None: no GPUs to lease), made on first use."""
    if state.health is None and state.leases is not None:
        s = state.settings
        state.health = Health(state.leases, state.nvml, s.health, s.reprobe)
    return state.health
