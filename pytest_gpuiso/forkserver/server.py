"""The fork server process: preload, parse the configuration, load conftests, fork tests.

Spawned (a fresh interpreter, never a fork of pytest), it imports the
``--gpu-isolate-preload`` modules, parses the session's configuration the way a
test's process does (which imports every plugin and the initial conftests) and
loads the conftests of the test directories it is told about. It never configures
pytest and never runs a test. It forks each test's process from its template
(``template``) when that has the test, else from itself, from its parsed
configuration.
"""

from __future__ import annotations

import gc
import os
import signal
import socket
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NoReturn

from .. import child, wire
from .._compat import load_conftests, prepare_config
from .._linux import die_with_parent
from ..child_plugin import freeze
from ..settings import TEMPLATE_WAIT_DEFAULT
from . import pools
from .fork import close_fds, fork_test_process, one_line, receive_request
from .template import TemplateHandle


class Unavailable(RuntimeError):
    """The fork server cannot serve (failed start-up, refused fork); the message says why."""


@dataclass(frozen=True)
class ServerBoot:
    """What the server is started with: the one carrier from pytest's settings to it."""

    parent_pid: int
    preload: tuple[str, ...]  # imported by the server (and by prewarmed spawned processes)
    args: tuple[str, ...]  # pytest's command line
    invocation_dir: str
    collect_all: bool = False  # every test is isolated: the template collects the args at once
    template_wait: float = TEMPLATE_WAIT_DEFAULT  # seconds a fork request waits for it
    log: str = ""  # the server's log file (the supervisor makes it)
    options: tuple[tuple[str, Any], ...] = ()  # pytest_gpuiso_child_options, for the template


class ServerMark:
    """Registered before the server parses the configuration: it says to plugins that
    look (the pytest-cov adapter parks pytest-cov) that this process runs no session of
    its own, as a test's process runs just its test."""

    __name__ = "gpuiso-forkserver"  # pluggy registers the plugin under this name


def main(boot: ServerBoot, conn: Connection) -> None:
    """Entry point of the fork server process; in a test's process forked here, its run."""
    die_with_parent(boot.parent_pid)
    # Nothing imported here is ever garbage: no collection may dirty (and so copy into
    # every fork) the pages of long-lived objects. Tests' processes turn it back on.
    gc.disable()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is pytest's; it closes us
    # The tests' processes get pytest's stdout/stderr back (for -s); the server's own
    # output (import noise) goes to its log.
    stdio = (os.dup(1), os.dup(2))
    log = os.open(boot.log, os.O_WRONLY | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        config = _prepare(boot)
    except BaseException as exc:  # noqa: BLE001 - any failure means: no fork server
        traceback.print_exc()
        why = str(exc) if isinstance(exc, Unavailable) else one_line(exc)
        conn.send_bytes(wire.encode(("failed", f"the fork server could not start: {why}")))
        return
    conn.send_bytes(wire.encode(("ready", None)))
    server = Server(boot, sock, conn, config, stdio)
    if boot.collect_all:  # what pytest collects is what the template collects: start now
        server.template = TemplateHandle.start(server, None)
    try:
        test = server.loop()
    except BaseException:
        server.stop_template()
        raise
    if test is None:  # pytest closed the socket: the session is over
        server.stop_template()
        os._exit(0)
    test()


def _prepare(boot: ServerBoot) -> Any:
    """Import the preload modules, then everything parsing the configuration imports."""
    from importlib import import_module

    os.chdir(boot.invocation_dir)
    for name in boot.preload:
        try:
            import_module(name)
        except BaseException as exc:
            raise Unavailable(f"--gpu-isolate-preload: importing {name} failed: {exc!r}") from None
        pools.step(f"importing {name}")
    config = prepare_config(list(boot.args), plugins=[ServerMark()])
    pools.step("configuring pytest (plugins)")
    # Parsing starts pytest's global capture into temporary files; children forked
    # from here must not share them, so each child's own configuration makes its own.
    capman = config.pluginmanager.get_plugin("capturemanager")
    if capman is not None:
        capman.stop_global_capturing()
    freeze()
    return config


class Server:
    """The server's request loop; forks from the template when it can, else itself."""

    def __init__(
        self,
        boot: ServerBoot,
        sock: socket.socket,
        conn: Connection,
        config: Any,
        stdio: tuple[int, int],
    ) -> None:
        self.boot = boot
        self.sock = sock
        self.conn = conn
        self.config = config  # parsed, never configured: what its own forks start from
        self.stdio = stdio  # pytest's stdout and stderr, for the tests' processes
        self.template: TemplateHandle | None = None
        self.template_note: str | None = None  # why there is no template, if it was refused

    def loop(self) -> Any:
        """Serve requests until pytest closes the socket (None); in a test's process
        forked from here, return its run (a callable that never returns)."""
        while (request := receive_request(self.sock, self.conn)) is not None:
            fds, (kind, *payload) = request
            try:
                if kind == "fork":
                    answer = self.fork(fds, *payload)
                elif kind == "collect":
                    answer = self.collect(*payload)
                else:
                    raise ValueError(f"unknown request {kind!r}")
            except BaseException:
                close_fds(fds)
                raise
            if callable(answer):  # this is the test's process now: the fds are its pipes
                return answer
            close_fds(fds)
            if answer is not None:
                # Every answer names the template, pytest's child to spare and reap.
                template = self.template.reaper_pid if self.template is not None else None
                self.conn.send_bytes(wire.encode((*answer, template)))  # plain data for pytest
        return None

    def collect(self, directories: list[str], modules: list[str]) -> None:
        """Import the test directories' conftests; start a template that collects ``modules``
        (unless one started with the server, collecting the session's arguments)."""
        for directory in directories:
            try:
                load_conftests(self.config, Path(directory))
            except KeyboardInterrupt:
                raise
            except BaseException:  # noqa: BLE001 - even pytest.skip() at import: the test meets it
                continue
        pools.step("importing conftests")
        freeze()
        if modules and self.template is None:
            self.template = TemplateHandle.start(self, modules)

    def fork(self, fds: list[int], cboot: Any, job: Any) -> Any:
        """("forked", (pid, source, note)) as ``ForkServer.answer`` describes, or
        ("refused", why); in the test's process forked here, its run."""
        if len(fds) != 2:
            return "refused", f"the fork server got {len(fds)} descriptors for a fork, expected 2"
        template = self.template
        if template is not None and template.serves(job):
            kind, payload = template.fork(fds, cboot, job)
            if kind == "forked":
                return kind, (payload, "template", None)
        ours: list[Any] = [self.sock, self.conn]
        if template is not None:
            ours += [template.sock, template.conn]
        answer = fork_test_process(self.boot.parent_pid, ours, self.stdio)
        if answer is None:  # the test's process: it runs its job from the parsed config
            return lambda: self._run_job(cboot, job, fds)
        kind, payload = answer
        if kind != "forked":
            return kind, payload
        note = template.unusable if template else self.template_note
        if template is not None and note is None and template.items is None:
            note = f"the template was still collecting after {self.boot.template_wait:g} s"
        return kind, (payload, "server", note)

    def _run_job(self, cboot: Any, job: Any, fds: list[int]) -> NoReturn:
        child.main(cboot, job, Connection(fds[0]), Connection(fds[1]), config=self.config)
        os._exit(72)  # main() never returns

    def stop_template(self) -> None:
        if self.template is not None:
            self.template.stop()
            self.template = None
