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
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NoReturn

from .._compat import load_conftests, prepare_config
from ..child import bootstrap as child
from ..child.relay import freeze
from ..proc._linux import die_with_parent
from ..values import TEMPLATE_WAIT_DEFAULT
from ..wire import wire
from ..wire.plugin_names import SERVER_PLUGIN
from . import pools
from .fork import close_fds, fork_test_process, one_line, receive_request
from .template import TemplateHandle

UNFIT_MAX = 3  # successor templates that could not take over before learning stops
SUCCESSOR_WAIT = 30.0  # seconds a successor may import before it counts as stuck
# Modules tests imported (with what those import) before a successor imports them: a
# successor costs a fork, a garbage collection and an audit (~50 ms of CPU), which a few
# small modules do not repay; torch.distributed.tensor alone brings ~520.
LEARN_WEIGHT = 64
# A fork for a test of the module whose test taught the successor what it imports waits
# for it (one module's tests import alike: each of a parametrized test's cases reaches
# torch.distributed.tensor through assert_close, ~0.7 s a process), but no longer than
# twice what the teaching test's process took, import included, plus this (seconds):
# past that, importing it again would have been cheaper.
AWAIT_SLACK = 0.5


def module_of(nodeid: str) -> str:
    """A test's module, as its node id names it (its path)."""
    return nodeid.split("::", 1)[0]


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
    learn: bool = True  # the template imports what tests imported (--gpu-isolate-learn-imports)
    learnt: tuple[tuple[str, str], ...] = ()  # earlier sessions' (imports.remembered)
    template_wait: float = TEMPLATE_WAIT_DEFAULT  # seconds a fork request waits for it
    cleanup: bool = False  # --gpu-isolate-cleanup: what an unfit template created is deleted
    log: str = ""  # the server's log file (the supervisor makes it)
    options: tuple[tuple[str, Any], ...] = ()  # pytest_gpuiso_child_options, for the template


class ServerMark:
    """Registered before the server parses the configuration: it says to plugins that
    look (the pytest-cov adapter parks pytest-cov) that this process runs no session of
    its own, as a test's process runs just its test."""

    __name__ = SERVER_PLUGIN  # pluggy registers the plugin under this name


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


def prestarted(parent_pid: int, conn: Connection) -> None:
    """Entry point of a fork server started before pytest's conftests load
    (``forkserver.Prestart``): unpickling this call imported pytest and ours while pytest's
    process configured and collected. It waits for its boot, with pytest's environment and
    ``sys.path`` as they are by then (a conftest may have changed them), and serves as
    ``main`` does; closed unused, it exits."""
    die_with_parent(parent_pid)
    try:
        boot, environ, path = conn.recv()
    except (EOFError, OSError):
        os._exit(0)
    os.environ.clear()
    os.environ.update(environ)
    sys.path[:] = path
    main(boot, conn)


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
    # Parsing started pytest's global capture (conftests took its streams): each process
    # forked from here keeps it, with files of its own (``restart_capture``).
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
        self.successor: TemplateHandle | None = None  # importing what tests imported
        self.learning: list[tuple[str, str]] = []  # what it imports: (name, origin)
        # what the next successor imports: first what earlier sessions' tests imported
        self.to_learn: list[tuple[str, str]] = list(boot.learnt) if boot.learn else []
        self.weight = LEARN_WEIGHT if self.to_learn else 0  # modules tests imported with them
        self.unfit = 0  # successors that could not take over
        self.unfit_names: list[str] = []  # the modules that left them unfit (told to pytest)
        # the modules (paths) of the tests that taught what the next successor imports,
        # each with how long its teacher's process took; then those of the importing one,
        # and when its wait ends (``await_successor``)
        self.teachers: dict[str, float] = {}
        self.awaited: dict[str, float] = {}

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
                elif kind == "learn":
                    answer = self.queue_imports(*payload)
                else:
                    raise ValueError(f"unknown request {kind!r}")
            except BaseException:
                close_fds(fds)
                raise
            if callable(answer):  # this is the test's process now: the fds are its pipes
                return answer
            close_fds(fds)
            if answer is not None:
                # Every answer names the template, pytest's child to spare and reap, and the
                # modules that could not be learnt (not to be remembered).
                template = self.template.reaper_pid if self.template is not None else None
                answer = (*answer, template, self.unfit_names)
                self.conn.send_bytes(wire.encode(answer))  # plain data for pytest
        return None

    def collect(
        self, directories: list[str], modules: list[str], initial: list[str] | None = None
    ) -> None:
        """Import the test directories' conftests; start a template that collects ``modules``
        (unless one started with the server, collecting the session's arguments);
        ``initial``: the paths pytest's session started from."""
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
            self.template = TemplateHandle.start(self, modules, tuple(initial) if initial else None)

    def queue_imports(
        self, names: list[tuple[str, str]], modules: int, teacher: str = "", took: float = 0.0
    ) -> None:
        """Modules a test imported while it ran ((name, origin); ``modules`` with what they
        import): the tests forked after it get them from a successor of the template that
        imported them (as pytest in-process keeps them), once they are worth a
        successor's fork and audit (``LEARN_WEIGHT``). Not the server's own forks: they
        configure and collect for themselves. A successor is started here, never taken
        over: only a fork's answer tells pytest the new template's pid (``adopt``).
        ``teacher``: the test's module, whose next tests wait for the successor
        (``await_successor``); ``took``: seconds its process ran."""
        if self.boot.learn:
            self.to_learn += names
            self.weight += modules
            if teacher:
                self.teachers[teacher] = max(self.teachers.get(teacher, 0.0), float(took))
            self.adopt(take_over=False)

    def adopt(self, take_over: bool = True) -> None:
        """Make the successor the template once it has imported what it learnt (the old
        one is killed; pytest reaps it once this fork's answer names the new one), or
        drop it; then start the next one, if due."""
        successor = self.successor
        if successor is not None and take_over and successor.conn.poll(0):
            self.successor = None
            try:
                kind, *payload = successor.conn.recv()
            except (EOFError, OSError, ValueError):
                kind, payload = "exited", []
            if kind == "learnt" and self.template is not None:
                successor.pid, successor.items = payload[0], frozenset(payload[1])
                self.template.stop()
                self.template = successor
            else:
                successor.stop()
                if kind != "learnt":
                    self._unfit(kind, payload)
        elif successor is not None and time.monotonic() > successor.deadline:  # stuck
            successor.stop()
            self.successor = None
            self._unfit("exited", [])
        template = self.template
        ready = template is not None and template.items is not None and not template.unusable
        due = self.to_learn and self.weight >= LEARN_WEIGHT and self.unfit < UNFIT_MAX
        if ready and self.successor is None and due:
            self.learning, self.to_learn, self.weight = self.to_learn, [], 0
            self.successor = template.fork_successor(self.learning, SUCCESSOR_WAIT)
            now = time.monotonic()
            teachers = self.teachers.items()
            self.awaited = {path: now + 2 * took + AWAIT_SLACK for path, took in teachers}
            self.teachers = {}

    def await_successor(self, job: Any) -> None:
        """Hold a fork for a test of a module whose test taught the importing successor
        until it can take over (``AWAIT_SLACK``): that test would most likely import
        the same again. Other tests are forked at once, from the template serving now."""
        successor = self.successor
        until = self.awaited.get(module_of(str(getattr(job, "nodeid", ""))))
        if successor is None or until is None:
            return
        wait = min(until, successor.deadline) - time.monotonic()
        if successor.conn.poll(max(0.0, wait)):
            self.adopt()

    def _unfit(self, kind: str, payload: list[Any]) -> None:
        """A successor could not take over: the template serves on. Unfit after importing a
        module (payload: the module, why): the others are tried again without it. Gone or
        stuck (a crash or a hang while importing): none of what it imported is learnt."""
        self.unfit += 1
        if kind == "unfit" and len(payload) == 2:
            module, why = str(payload[0]), str(payload[1])
            rest = [pair for pair in self.learning if pair[0] != module]
            if rest:  # worth a successor before: still worth one
                self.to_learn, self.weight = rest + self.to_learn, self.weight + LEARN_WEIGHT
            culprits = [module]
        else:
            why = "it exited or did not answer while importing"
            culprits = [name for name, _ in self.learning]
        self.unfit_names += [name for name in culprits if name not in self.unfit_names]
        print(f"gpu-isolate: a successor template could not take over: {why}")

    def fork(self, fds: list[int], cboot: Any, job: Any) -> Any:
        """("forked", (pid, source, note)) as ``ForkServer.answer`` describes, or
        ("refused", why); in the test's process forked here, its run."""
        if len(fds) != 2:
            return "refused", f"the fork server got {len(fds)} descriptors for a fork, expected 2"
        self.adopt()
        self.await_successor(job)
        template = self.template
        if template is not None and template.serves(job):
            kind, payload = template.fork(fds, cboot, job)
            self.adopt()  # the first fork: the template has said what it collected
            if kind == "forked":
                return kind, (payload, "template", None)
        ours: list[Any] = [self.sock, self.conn]
        for handle in (template, self.successor):
            if handle is not None:
                ours += [handle.sock, handle.conn]
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
        """At the session's end. With a successor still importing, the template is let go
        (its socket closed) so that it ends and reaps that successor before it exits (a
        successor dies with it anyway, but unreaped); otherwise it is killed at once."""
        importing = self.successor is not None
        for handle in (self.successor, self.template):
            if handle is not None:
                handle.stop(kill=not importing)
        self.template = self.successor = None
