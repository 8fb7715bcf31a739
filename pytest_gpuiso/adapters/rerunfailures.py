"""pytest-rerunfailures and isolated tests: every attempt in a fresh process.

pytest (or an xdist worker) runs an isolated test's attempts itself: our
``pytest_runtest_protocol`` comes first and asks ``pytest_gpuiso_rerun`` after each
attempt, so rerunfailures' own loop never runs for isolated tests there, and each
rerun gets a new process (a fresh CUDA context). This adapter answers that hook as
rerunfailures' loop would decide: the test's reruns (``--reruns``, the ``flaky``
marker, ``--rerun-except-path``...), ``--max-suite-reruns``, the delay and its backoff.
A crash or a timeout (no complete reports) is rerun like a failure.

In the test's process the test runs once (rerunfailures' loop would rerun it in the
same process): its reports are made as rerunfailures makes them, and what only that
process knows (``--only-rerun``, ``--rerun-except``, a ``condition`` need the
exception) comes back in the payload. There rerunfailures' ``pytest_configure`` would
start its status server (a socket and a thread) whenever xdist is installed: the
thread would make the fork server's template refuse to fork. Nothing there uses it,
so the test's processes get the no-op db.

rerunfailures' private names are checked once; without them isolated tests run once
and a ``GpuIsoStartWarning`` says so.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import pytest

from .. import _compat
from ..warning_types import GpuIsoStartWarning, warn_session
from ..wire.plugin_names import CHILD_PLUGIN  # not child.relay's module: kept cheap
from . import plugin_version

PLUGIN = "rerunfailures"  # pytest-rerunfailures' entry point name
KEY = "pytest-rerunfailures"  # our key in the payload
# What the parent's decision needs; the rest is optional (older releases lack it).
NEEDED = ("get_reruns_count", "get_reruns_delay", "get_reruns_condition")
# From 14.0 its makereport keeps what rules a rerun out (item._terminal_errors).
LOWEST = (14, 0)


def _module(config: Any) -> Any:
    """pytest_rerunfailures when it is loaded in this process, else None."""
    if not config.pluginmanager.has_plugin(PLUGIN):
        return None
    import pytest_rerunfailures

    return pytest_rerunfailures


def _in_test_process(config: Any) -> bool:
    return config.pluginmanager.has_plugin(CHILD_PLUGIN)


class RerunAdapter:
    def __init__(self) -> None:
        self.unsupported: str | None = None  # why reruns of isolated tests are off
        self.warned = False

    # ---------------------------------------------------------------- test's process

    @pytest.hookimpl(tryfirst=True)
    def pytest_configure(self, config: Any) -> None:
        """Before rerunfailures' configure: its status server is never started here.
        This process is a test's own (or the template's): nothing else configures in it."""
        rf = _module(config) if _in_test_process(config) else None
        noop = getattr(rf, "StatusDB", None)
        if noop is not None and hasattr(rf, "ServerStatusDB"):
            rf.ServerStatusDB = noop
        if rf is not None:
            # Its release read here, in the template, once: not by each test's process
            # forked from it (reading a distribution's metadata takes milliseconds).
            _version()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: Any, nextitem: Any) -> bool | None:
        """One attempt only: pytest decides whether another process runs it again."""
        if not _in_test_process(item.config) or _module(item.config) is None:
            return None
        ihook = item.ihook
        ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        _compat.runtestprotocol(item, nextitem=nextitem)
        ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True

    def pytest_gpuiso_child_payload(self, item: Any, payload: dict[str, Any]) -> None:
        rf = _module(item.config)
        if rf is None or not _in_test_process(item.config) or _missing(rf):
            return
        if rf.get_reruns_count(item) is not None:
            payload[KEY] = {"rerun": _may_rerun(rf, item)}

    # ---------------------------------------------------------------- pytest's process

    def pytest_gpuiso_rerun(
        self, item: Any, attempt: int, reports: list, payload: dict[str, Any], complete: bool
    ) -> bool | None:
        config = item.config
        rf = _module(config)
        if rf is None:
            return None
        _stand_in_state(item)
        if self._unsupported(config, rf):
            return None
        reruns = rf.get_reruns_count(item)
        excluded = getattr(rf, "_is_rerun_path_excluded", None)
        if reruns is None or (excluded is not None and excluded(item)):
            return None
        item.execution_count = attempt  # what its --fail-on-flaky reads
        if attempt > reruns or not any(r.failed for r in reports):
            return False
        if any(hasattr(r, "wasxfail") for r in reports):
            return False
        if complete:  # else a crash or a timeout: rerun like a failure
            # No payload: its test never ran there (a collection error), or a plugin's
            # payload hook failed (a warning of the test says so).
            decided = payload.get(KEY, {"rerun": False})["rerun"]
            if decided is None:  # a release whose makereport keeps no _terminal_errors
                self._warn(config, f"{item.nodeid} not rerun: its process could not tell")
            if not decided:
                return False
        if not _suite_rerun_left(config):
            return False
        factor = getattr(rf, "get_reruns_delay_backoff_factor", lambda item: 1.0)(item)
        time.sleep(rf.get_reruns_delay(item) * factor ** (attempt - 1))
        return True

    def _unsupported(self, config: Any, rf: Any) -> bool:
        """True when reruns of isolated tests are off; said once, the first time."""
        if self.unsupported is None:
            missing = _missing(rf)
            self.unsupported = ", ".join(missing)
            if missing:
                self._warn(
                    config,
                    "reruns of isolated tests are not supported with this version "
                    f"({self.unsupported}): they run once",
                )
        return bool(self.unsupported)

    def _warn(self, config: Any, text: str) -> None:
        """One warning a session."""
        if not self.warned:
            self.warned = True
            text = f"gpu-isolate: pytest-rerunfailures {_version()}: {text}"
            warn_session(config, GpuIsoStartWarning(text))


def _stand_in_state(item: Any) -> None:
    """What rerunfailures' makereport wrapper expects from its setup phase, which ran in
    the test's process: the parent's teardown of the fixtures earlier tests left up
    (runner._teardown_parent_stack) makes a report of this item here."""
    for name in ("_terminal_errors", "_test_xfailed", "_rerun_condition_excinfos"):
        if not hasattr(item, name):
            setattr(item, name, {})


def _missing(rf: Any) -> list[str]:
    """What this release lacks of what the adapter needs ([]: nothing)."""
    missing = [f"no {name}" for name in NEEDED if not hasattr(rf, name)]
    try:
        release = tuple(int(n) for n in _version().split(".")[:2])
    except ValueError:
        release = LOWEST  # unknown: its names decide
    if release < LOWEST:
        missing.append(f"older than {'.'.join(map(str, LOWEST))}")
    return missing


def _may_rerun(rf: Any, item: Any) -> bool | None:
    """Whether a failure of this attempt may be rerun, as rerunfailures judges it: no
    error ruled out by --only-rerun / --rerun-except, no xfail, the condition holds.
    None: this version keeps none of it where we look."""
    terminal = getattr(item, "_terminal_errors", None)
    if terminal is None:
        return None
    xfailed = getattr(item, "_test_xfailed", {})  # (16.1 has none: pytest checks wasxfail)
    if any(terminal.values()) or any(xfailed.values()):
        return False
    failures = getattr(rf, "_get_reruns_condition_failures", None)
    if failures is not None:
        return bool(rf.get_reruns_condition(item, failures(item)))
    return bool(rf.get_reruns_condition(item))


def _suite_rerun_left(config: Any) -> bool:
    """--max-suite-reruns (16.5): take one of the session's reruns (shared under xdist)."""
    cap = getattr(config.option, "max_suite_reruns", None)
    return cap is None or bool(config.failures_db.try_increment_suite_reruns(cap))


@functools.lru_cache(maxsize=1)
def _version() -> str:
    return plugin_version("pytest-rerunfailures")


def register(pluginmanager: Any) -> None:
    pluginmanager.register(RerunAdapter(), "gpuiso-adapter-rerunfailures")
