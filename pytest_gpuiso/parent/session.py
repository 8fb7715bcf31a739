"""The session's side of isolation, in one pytest process.

``State`` lives in the config's stash of every pytest process that may run an isolated
test (a worker under xdist, or the one process without it): the settings, the lease
table and GPUs (``prepare``), and the ``Worker`` that isolates tests, made once when
isolating first needs it (``start_worker``); ``close`` gives it all back at the session's
end. The reports' side (``reports.controller``) lives in the process that writes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest

from ..gpu import ports
from ..gpu.devices import Devices
from ..gpu.nvml import NvmlReader
from ..settings import IsolationSpec, Settings, wants_isolation
from ..values import SpecError

if TYPE_CHECKING:  # what isolating needs is imported when a test is first isolated
    from ..gpu.leases import Lease, Leases
    from ..reports.baseline import Baseline
    from .start_failures import StartFailure
    from .worker import Worker


@dataclass
class State:
    """The session's side of isolation, in one pytest process (a worker under xdist)."""

    settings: Settings
    baseline: Baseline | None = None  # the known leaks (--gpu-isolate-leak-baseline)
    worker: Worker | None = None  # made once isolating needs it (``start_worker``)
    devices: Devices = Devices((), "none")
    leases: Leases | None = None  # None: no GPUs, nothing to lease
    nvml: NvmlReader = field(default_factory=NvmlReader)
    parallel: bool = False  # an xdist worker: other isolated tests run at the same time
    child_options: tuple[tuple[str, Any], ...] | None = None  # pytest_gpuiso_child_options
    master_port: bool = field(default_factory=ports.wanted)  # lease each test a MASTER_PORT
    pin: Lease | None = None  # the GPUs this process has for life (--gpu-isolate-pin-workers)
    pins: list[Lease] = field(default_factory=list)  # pinning leases this process took
    cache: Any = None  # pytest's cache (config.cache; none with -p no:cacheprovider)
    unavailable: str = ""  # why isolation cannot work here (``native.missing``): it is off
    debugger: str = ""  # --pdb or --trace: isolation is off so that it reaches the tests
    debugger_said: bool = False  # and said so at configure (every test was to be isolated)
    prepared: bool = False  # ``prepare`` ran: the GPUs are known, stale sessions ended
    warned: set[tuple[Any, ...]] = field(default_factory=set)  # warnings replayed (``replay``)
    began: bool = False  # a test's process began its test in this session
    start_failed: StartFailure | None = None  # the last test's process could not start
    # the same start failure twice in a row: the tests after fail at once with it
    cannot_start: StartFailure | None = None


STATE = pytest.StashKey[State]()


def isolated(item: pytest.Item) -> bool:
    state = item.config.stash.get(STATE, None)
    return state is not None and wants_isolation(item, state.settings)


def prepare(config: pytest.Config, state: State) -> None:
    """What isolating needs before its first test, done once: the work directory,
    what dead sessions' tests left running, the GPUs and their lease table, pinned
    workers' GPUs. At configure when every test is isolated or workers are pinned;
    otherwise when the first isolated test (or ``gpu_isolated_run``) shows up, so that a
    session that isolates nothing does no NVML or ``/dev/shm`` work at all."""
    if state.prepared or state.settings.mode == "off":
        return
    state.prepared = True
    from .._lease import RegionError
    from ..gpu import pinning
    from ..gpu.devices import discover
    from ..gpu.leases import Leases
    from ..leaks.shm import DeadSessionShm
    from ..proc import dead_sessions, workdir

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
    try:
        sizes = dict(settings.device_sizes)
        state.devices = discover(settings.devices, settings.devices_source, sizes, state.nvml)
        if state.devices.names:
            state.leases = Leases(state.devices, settings.slots)
    except (RegionError, SpecError) as exc:  # a bad device list, a table not ours
        raise pytest.UsageError(f"gpu-isolate: {exc}") from None
    died = state.leases.died_text() if state.leases is not None and not state.parallel else ""
    if died:  # what the lease table says of a session killed with a test on its GPUs
        warn_start(config, died)
    problem = pinning.problem(config, settings, state.devices)
    if problem is not None:
        raise pytest.UsageError(f"gpu-isolate: {problem}")
    # before any test module is collected; the controller's, before it starts workers
    state.pins = pinning.pin(config, settings, state.leases)
    state.pin = pinning.own(config, settings, state.pins, state.leases)


def warn_start(config: pytest.Config, text: str, notice: bool = False) -> None:
    """Say ``text`` once, as a warning of the session; a usage error where a filter makes
    ``GpuIsoStartWarning`` an error, unless it is a ``notice`` (``warn_session``)."""
    from ..warning_types import GpuIsoStartWarning, warn_session

    text = f"gpu-isolate: {text}"
    if not warn_session(config, GpuIsoStartWarning(text), notice=notice, stacklevel=2):
        raise pytest.UsageError(f"{text} (GpuIsoStartWarning is an error by -W/filterwarnings)")


def settle(config: pytest.Config) -> None:
    """Before test code runs in pytest's own process (a test, a fixture's teardown): reap
    the isolated tests' processes the kernel still tears down (``leaving``), which its
    own ``os.wait()`` could take."""
    state = config.stash.get(STATE, None)
    if state is not None and state.worker is not None:
        state.worker.settle()


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


def start_worker(config: pytest.Config, state: State) -> Worker:
    """The session's worker, made the first time isolating needs it (``worker``).
    Raises ``workdir.WorkdirError`` when this process's work directory cannot be made."""
    if state.worker is None:
        from .worker import make_worker

        state.worker = make_worker(config, state, child_options(config, state))
    return state.worker


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
    if state.worker is not None:
        state.worker.close(state.cache, remember=state.settings.learn_imports)
    if state.leases is not None:
        for lease in state.pins:
            state.leases.release(lease)
    state.pins, state.pin = [], None


def start_server(config: pytest.Config, state: State) -> Worker | None:
    """Start the fork server; None when the work directory or a resource it needs is
    missing (each isolated test then says why, as the failure of its own start)."""
    from ..proc import workdir

    try:
        worker = start_worker(config, state)
        worker.start_server()
    except (workdir.WorkdirError, OSError):
        return None
    return worker
