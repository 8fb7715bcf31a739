"""The fork server's interpreter, started before pytest's conftests load.

Where a fork server will serve every test, ``start`` (at ``pytest_load_initial_conftests``)
has its interpreter started at once: it imports pytest and ours while pytest's process
configures and collects, which was ~0.3 s of a one-test session's 0.85 s. The server
(``forkserver.ForkServer``, at ``pytest_sessionstart``) takes it, giving it its boot, this
process's environment and ``sys.path`` as they are by then, unless a variable read at an
interpreter's start changed meanwhile (then a fresh one starts, as before). ``discard``
ends it where no server took it. Deciding costs only the options read so far: nothing of
the fork server is imported unless it starts.
"""

from __future__ import annotations

import os

import pytest

from .. import _compat, native
from ..settings import Settings, read_early
from ..wire.plugin_names import CHILD_PLUGIN, SERVER_PLUGIN

STARTED = pytest.StashKey[bool]()  # this config's process started one


def start(config: pytest.Config) -> None:
    """Start the server's interpreter now, where ``wanted``."""
    settings = wanted(config)
    if settings is not None:
        from . import serving

        config.stash[STARTED] = True
        serving.prestart(settings.leak_level("shm") != "off")


def discard(config: pytest.Config) -> None:
    """End the interpreter ``start`` started, if no server took it."""
    if config.stash.get(STARTED, False):
        from ..forkserver import discard_prestarted

        config.stash[STARTED] = False
        discard_prestarted()


def wanted(config: pytest.Config) -> Settings | None:
    """The settings, when this process will start a fork server at ``pytest_sessionstart``
    as far as the options known before the conftests load tell (when in doubt: None)."""
    plugins = config.pluginmanager
    if plugins.has_plugin(CHILD_PLUGIN) or plugins.has_plugin(SERVER_PLUGIN):
        return None
    known = _compat.known_args(config)
    if any(getattr(known, name, False) for name in ("collectonly", "usepdb", "trace")):
        return None
    if native.missing():
        return None
    if not hasattr(config, "workerinput") and (
        getattr(known, "numprocesses", None) or getattr(known, "dist", "no") != "no"
    ):
        return None  # an xdist controller runs no test
    # pytest-cov measures subprocesses: the multiprocessing helpers a spawn starts (its
    # resource tracker) must start once its adapter configured (pytest_sessionstart).
    if getattr(known, "cov_source", None) or any(
        name.startswith("COV_CORE_") or name == "COVERAGE_PROCESS_START" for name in os.environ
    ):
        return None
    settings = read_early(config, known)
    if settings is None or settings.mode != "all" or settings.start != "forkserver":
        return None
    return settings
