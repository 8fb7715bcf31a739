"""The session's side of isolation, in one pytest process: settings and flags, cheap.

``State`` lives in the config's stash of every pytest process that may run an isolated
test (a worker under xdist, or the one process without it): the settings, the flags of
the session, its GPUs (``gpu.pool.GpuPool``, found by ``worker.prepare``) and the
``Worker`` that isolates its tests, made once when isolating first needs it
(``worker.start_worker``); ``close`` gives them back at the session's end. Nothing here
imports what isolating runs: ``worker`` is the one module behind which it all loads.
The reports' side (``reports.controller``) lives in the process that writes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest

from ..gpu import ports
from ..gpu.pool import GpuPool
from ..settings import Settings, wants_isolation
from ..warning_types import GpuIsoStartWarning, warn_session

if TYPE_CHECKING:  # what isolating needs is imported when a test is first isolated
    from ..reports.baseline import Baseline
    from .start_failures import StartFailure


@dataclass
class State:
    """The session's side of isolation, in one pytest process (a worker under xdist)."""

    settings: Settings
    baseline: Baseline | None = None  # the known leaks (--gpu-isolate-leak-baseline)
    gpus: GpuPool = field(default_factory=GpuPool)  # found once (``worker.prepare``)
    # the ``worker.Worker``, made once isolating needs it (``worker.start_worker``); not
    # named by its type here: ``worker`` imports this module, never the other way round
    worker: Any = None
    no_worker: str = ""  # why it could not be made (each isolated test fails with it)
    parallel: bool = False  # an xdist worker: other isolated tests run at the same time
    master_port: bool = field(default_factory=ports.wanted)  # lease each test a MASTER_PORT
    cache: Any = None  # pytest's cache (config.cache; none with -p no:cacheprovider)
    unavailable: str = ""  # why isolation cannot work here (``native.missing``): it is off
    debugger: str = ""  # --pdb or --trace: isolation is off so that it reaches the tests
    debugger_said: bool = False  # and said so at configure (every test was to be isolated)
    prepared: bool = False  # ``worker.prepare`` ran: the GPUs are known, stale sessions ended
    warned: set[tuple[Any, ...]] = field(default_factory=set)  # warnings replayed (``replay``)
    began: bool = False  # a test's process began its test in this session
    start_failed: StartFailure | None = None  # the last test's process could not start
    # the same start failure twice in a row: the tests after fail at once with it
    cannot_start: StartFailure | None = None


STATE = pytest.StashKey[State]()


def isolated(item: pytest.Item) -> bool:
    state = item.config.stash.get(STATE, None)
    return state is not None and wants_isolation(item, state.settings)


def warn_start(config: pytest.Config, text: str, notice: bool = False) -> None:
    """Say ``text`` once, as a warning of the session; a usage error where a filter makes
    ``GpuIsoStartWarning`` an error, unless it is a ``notice`` (``warn_session``)."""
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


def close(state: State) -> None:
    """Discard prewarmed processes, stop the fork server, release a pinned worker's GPUs."""
    if state.worker is not None:
        state.worker.close(state.cache, remember=state.settings.learn_imports)
    state.gpus.release_pins()
