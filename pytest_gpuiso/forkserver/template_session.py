"""The template's pytest session, and a test's process taking it over after its fork.

``run_session`` runs pytest's main loop in the template with ``TemplatePlugin``: it
collects the isolated tests' modules, then waits in ``pytest_collection`` for a fork
(``template._serve_forks``). In a test's process forked there, the plugin takes its job,
its pipes and what is its own (capture files, basetemp, the random generators' states
collection left, faulthandler's file), and runs only its item from the collected session.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import random
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import pytest

from .. import _compat
from ..child import bootstrap as child
from ..child import exiting, overrides, relay
from ..wire import frames, jobs

# A test's process forked from the template: its bootstrap, job and pipe ends.
Forked = tuple[jobs.Bootstrap, Any, Connection, Connection]


class TemplatePlugin(relay.ChildPlugin):
    """The template's session: collect, then wait for forks; in a test's process forked
    there, take its job and what is its own, and run its item from the collected session."""

    def __init__(
        self,
        modules: list[str] | None,
        await_fork: Callable[[list[str]], Forked],
        initial: tuple[str, ...] | None = None,
    ):
        super().__init__(None, None)  # type: ignore[arg-type] - given to each fork
        self.modules = modules
        self.initial = initial  # pytest's session's initial paths, when ``modules`` differ
        self.await_fork = await_fork
        self.items: dict[str, Any] = {}
        self.seeded: list[Any] = [None, None, None]  # generator states the collection set

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection(self, session: Any) -> bool:
        # pytest's own pytest_collection does, ours replaces it (with pytest's initial paths)
        _compat.rewrite_for(session, self.initial)
        before = _random_states()
        session.perform_collect(self.modules)  # None: the session's arguments, as pytest
        # A module that seeded a global generator at import: each test's process starts
        # from that state, as if it had imported the module itself (a fork reseeds them).
        after = _random_states()
        self.seeded = [new if new != old else None for old, new in zip(before, after, strict=True)]
        self.items = {item.nodeid: item for item in session.items}
        self._take_over(*self.await_fork(list(self.items)))  # in a test's process
        self.channel.wait_go()
        return True

    def _take_over(self, boot: jobs.Bootstrap, job: Any, conn: Connection, go: Connection) -> None:
        """This process is now the test's: take its job and what is its own."""
        child.bootstrap(boot, conn)
        self.job = job
        self.channel = child.Channel(conn, boot.spill_prefix, go, boot.output, configured=True)
        # The template's CUDA state was checked, and its driver baseline taken, once.
        self.channel.send(frames.READY, os.getpid())
        config = self.config
        self._record_junit(config)
        with relay.named_capture_files(boot.capture_prefix):
            relay.restart_capture(config)  # the session's one, with files of its own
        overrides.override_options(config.option, job.basetemp, job.options)
        # The session's factory was made in the template: this test's basetemp instead.
        _compat.retarget_basetemp(config, job.basetemp)
        _restore_random_states(self.seeded)
        _repoint_faulthandler(config)

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list) -> None:
        """Keep everything: the template serves every test it collected."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: Any) -> bool:
        item = self.items.get(self.job.nodeid)
        session.items[:] = [item] if item is not None else []
        return super().pytest_runtestloop(session)


def run_session(
    config: Any,
    modules: list[str] | None,
    await_fork: Callable[[list[str]], Forked],
    options: tuple = (),
    initial: tuple[str, ...] | None = None,
) -> None:
    """The template's pytest session; in a test's process forked from it, the test's end."""
    plugin = TemplatePlugin(modules, await_fork, initial)
    config.pluginmanager.register(plugin, relay.CHILD_PLUGIN)
    relay.restart_capture(config)
    overrides.override_options(config.option, config.option.basetemp, options)
    try:
        status = relay.after_the_test(
            plugin, lambda: config.hook.pytest_cmdline_main(config=config)
        )
    except BaseException:
        if plugin.channel is None:  # the template itself failed: the server forks instead
            raise
        with contextlib.suppress(Exception):
            plugin.channel.send(frames.ERROR, child.internal_error())
        exiting.flush_and_exit(1)
    if plugin.channel is None:
        exiting.flush_and_exit(status)
    plugin.channel.send(frames.DONE, status)  # a test's process: its session is over
    exiting.flush_and_exit(0, plugin.channel.conn)


def _random_states() -> list[Any]:
    """The states of Python's, numpy's and torch's (CPU) global random generators (None:
    not imported)."""
    numpy = sys.modules.get("numpy")
    try:
        state = numpy.random.get_state() if numpy is not None else None
    except Exception:
        state = None
    return [random.getstate(), _comparable(state), _torch_state()]


def _torch_state() -> bytes | None:
    generator = getattr(sys.modules.get("torch"), "default_generator", None)
    try:
        return bytes(generator.get_state().tolist()) if generator is not None else None
    except Exception:
        return None


def _comparable(state: Any) -> Any:
    """numpy's state tuple holds an array; a tuple of plain values compares with ==."""
    if state is None:
        return None
    return tuple(x.tolist() if hasattr(x, "tolist") else x for x in state)


def _restore_random_states(seeded: list[Any]) -> None:
    python, numpy_state, torch_state = seeded
    if python is not None:
        random.setstate(python)
    numpy = sys.modules.get("numpy")
    if numpy_state is not None and numpy is not None:
        with contextlib.suppress(Exception):
            kind, keys, *rest = numpy_state
            numpy.random.set_state((kind, numpy.asarray(keys, dtype=numpy.uint32), *rest))
    torch = sys.modules.get("torch")
    if torch_state is not None and torch is not None:
        with contextlib.suppress(Exception):
            torch.default_generator.set_state(
                torch.frombuffer(bytearray(torch_state), dtype=torch.uint8)
            )


def _repoint_faulthandler(config: Any) -> None:
    """Crash dumps go to this process's stderr, as pytest's faulthandler plugin set it up.

    The plugin enabled faulthandler on a copy of stderr made at configure time, in the
    template; here the copy is pointed at this process's stderr (while capture is
    suspended, so the real one), and faulthandler at the copy, which fd capture of
    fd 2 during the test does not redirect.
    """
    with contextlib.suppress(Exception):
        fd = config.stash.get(_compat.fault_handler_stderr_fd_key, None)
        if fd is not None:
            os.dup2(2, fd)
            faulthandler.enable(file=fd, all_threads=True)
