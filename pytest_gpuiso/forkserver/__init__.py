"""The fork server: one process per pytest worker that forks the isolated tests' processes.

Starting an interpreter and importing pytest, its plugins and torch costs seconds;
forking a process that already did costs milliseconds. ``ForkServer`` is pytest's
handle on it (its interpreter may have been started early, ``prestart``, while pytest's
process configured and collected); the server process is ``server``, its pre-collected session (the
template) ``template``, and the fork mechanics and request wire ``fork``.

Also here: ``audit`` (whether the template is fit to be forked), ``pools`` (threads
native libraries start, made safe to fork) and ``template_session`` (the template's
pytest session, and a test's process taking it over).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from pathlib import Path
from typing import Any

from ..child import imports
from ..proc._linux import wait_readable
from ..proc.proctree import exec_environment, main_not_rerun, reap_or_kill, reap_pid, unlist
from ..wire import wire
from .fork import close_quietly, send_request
from .server import LEARN_WEIGHT, ServerBoot, Unavailable, main, module_of, prestarted

__all__ = [
    "LEARN_WEIGHT",
    "ForkServer",
    "ServerBoot",
    "Unavailable",
    "discard_prestarted",
    "module_of",
    "prestart",
]

_ANSWER_BYTES = 1 << 16  # an answer of the server is a pid and a line or two

# What an interpreter reads as it starts (itself, the dynamic linker, glibc, the .pth
# files of site-packages: coverage's and pytest-cov's process hooks among them): a server
# started before one of these changed is not the server pytest's process would start now.
STARTUP_PREFIXES = ("PYTHON", "LD_", "COV_CORE_", "COVERAGE_", "MALLOC_", "GLIBC_", "LC_")
STARTUP_NAMES = frozenset({"HOME", "PATH", "LANG", "SETUPTOOLS_USE_DISTUTILS"})


def startup_environment(names: Any = ()) -> dict[str, str | None]:
    """This process's variables that a new interpreter reads at its start, and ``names``."""
    found: dict[str, str | None] = {name: os.environ.get(name) for name in names}
    for name, value in os.environ.items():
        if name.startswith(STARTUP_PREFIXES) or name in STARTUP_NAMES:
            found[name] = value
    return found


class Prestart:
    """A fork server's interpreter started before pytest's conftests load, importing pytest
    and ours while pytest's process configures and collects; it waits for its boot
    (``ForkServer`` takes it when its start-up environment is still this process's)."""

    def __init__(self, ctx: Any, env: dict[str, str]) -> None:
        self.env = env
        with exec_environment(env):
            self.conn, self.proc = _spawn(ctx, prestarted, os.getpid())
            self.startup = startup_environment(env)

    def fits(self) -> bool:
        """Whether it was exec'd as a server started now would be (asked within that
        server's exec environment)."""
        return startup_environment(self.env) == self.startup

    def close(self) -> None:
        """Discard it unused: it exits when its pipe closes; reaped (killed if it lingers)."""
        close_quietly(self.conn)
        reap_or_kill(self.proc, self.proc.sentinel, 1.0)  # no child of its own holds it


def _spawn(ctx: Any, target: Any, arg: Any) -> tuple[Any, Any]:
    """A server's process, spawned to run ``target(arg, conn)`` (``conn``: its end of a
    Unix socket pair); our end and the process."""
    ours, theirs = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=target, args=(arg, theirs), daemon=False)
    with main_not_rerun():
        proc.start()
    unlist(proc)
    theirs.close()
    return ours, proc


_prestarted: dict[int, Prestart] = {}  # by the pid of the pytest process that started it


def prestart(ctx: Any, env: dict[str, str]) -> None:
    """Start this process's fork server's interpreter now, with ``env`` at its exec (the
    shim's ``LD_PRELOAD``); ``ForkServer`` takes it, or ``discard_prestarted`` ends it."""
    if os.getpid() not in _prestarted:
        _prestarted[os.getpid()] = Prestart(ctx, env)


def discard_prestarted() -> None:
    """End this process's early interpreter if no ``ForkServer`` took it."""
    early = _prestarted.pop(os.getpid(), None)
    if early is not None:
        early.close()


def _take_prestarted() -> Prestart | None:
    """This process's early interpreter, if its start-up environment is still this
    process's (else it is discarded: a fresh one sees what changed)."""
    early = _prestarted.pop(os.getpid(), None)
    if early is not None and not early.fits():
        early.close()
        return None
    return early


class ForkServer:
    """pytest's handle on its fork server."""

    def __init__(self, ctx: Any, boot: ServerBoot) -> None:
        self.log = Path(boot.log)
        early = _take_prestarted()
        if early is not None:
            try:  # what a fresh spawn would see now: this process's environment and path
                early.conn.send((boot, dict(os.environ), list(sys.path)))
            except OSError:  # it died waiting: start one now
                early.close()
                early = None
        if early is not None:
            self.conn, self.proc = early.conn, early.proc
        else:
            self.conn, self.proc = _spawn(ctx, main, boot)
        # Its exit, seen even while forked tests hold its sentinel pipe (they inherit it).
        self.pidfd = os.pidfd_open(self.proc.pid)
        self.sock = socket.socket(fileno=os.dup(self.conn.fileno()))
        self.ready = False
        self.template_pid: int | None = None  # the server's template, when it is our child
        self.learning = boot.learn  # --gpu-isolate-learn-imports: else nothing is sent
        self.learnt: dict[str, str] = {}  # modules the template was told to import: origins
        self.unfit: set[str] = set()  # modules that left a successor template unfit to fork

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float) -> None:
        """Return once the server is ready; ``Unavailable`` if it never is."""
        if not self.ready:
            kind, payload = self._answer(timeout, "start")
            if kind != "ready":
                raise Unavailable(payload)
            self.ready = True

    def request_fork(self, boot: Any, job: Any, fds: list[int], timeout: float) -> None:
        """Ask the server to fork a test's process; ``answer()`` later gives its pid.

        Answers come in the order of the requests. ``fds`` (the child's ends of its
        pipes) travel with the request; the caller may close its copies at once.
        """
        self.wait_ready(timeout)
        try:
            send_request(self.sock, self.conn, ("fork", boot, job), fds)
        except OSError as exc:
            raise Unavailable(f"the fork server is gone ({exc}){self._log_tail()}") from None

    def answer(self, timeout: float) -> tuple[str, Any]:
        """The next answer to a fork request: ("refused"/"failed", why) or ("forked", (pid,
        source, note)): forked from the collected ``"template"`` or the parsed ``"server"``;
        ``note``: why the template could not serve, once it has given up. Each answer
        also names the template, which ``template_pid`` keeps (pytest's child, like the
        tests', where it can be: spared by the sweep and reaped by ``close``)."""
        return self._answer(timeout, "fork")

    def collect(
        self, directories: list[str], modules: list[str], initial: tuple[str, ...] = ()
    ) -> None:
        """Tell the server the isolated tests' directories and modules (best effort).

        It imports the directories' conftests and starts a template that collects
        the modules, so that most tests' processes only have to run their item.
        ``initial``: the paths pytest's session started from (``_compat.initial_paths``).
        """
        request = ("collect", directories, modules, list(initial))
        with contextlib.suppress(OSError):
            send_request(self.sock, self.conn, request)

    def send_imports(
        self, names: list[Any], modules: int, nodeid: str = "", took: float = 0.0
    ) -> bool:
        """Tell the server what a test's process imported while its test ran (``names``:
        (name, origin) pairs, ``modules`` in all: ``imports.learnable``; best effort): its
        template imports them for later tests. ``nodeid`` and ``took``: the test, and
        how long its process ran (the imports' cost, at most): the server holds the next
        forks of its module's tests until the successor has them (``Server.queue_imports``).
        Whether they were sent."""
        new = {p[0]: p[1] for p in names if imports.is_learnt(p) and p[0] not in self.learnt}
        if not new or not self.ready or not self.learning:
            return False
        self.learnt.update(new)
        request = ("learn", list(new.items()), max(0, modules), module_of(nodeid), took)
        try:
            send_request(self.sock, self.conn, request)
        except OSError:
            return False
        return True

    def _answer(self, timeout: float, what: str) -> tuple[str, Any]:
        try:
            why = wait_readable(self.conn, timeout, self.proc.pid)
            if why is not None:  # stopped, it would never answer: spawn instead, at once
                return "failed", f"the fork server did not answer ({what}): {why}"
            answer = wire.decode(self.conn.recv_bytes(_ANSWER_BYTES))
            kind, payload, *rest = answer
            if rest and type(rest[0]) is int:
                if self.template_pid not in (None, rest[0]):  # a successor took over
                    reap_pid(self.template_pid)  # the server killed the old one
                self.template_pid = rest[0]
            if len(rest) > 1 and isinstance(rest[1], list):
                self.unfit.update(name for name in rest[1] if isinstance(name, str))
            return kind, payload
        except (wire.WireError, ValueError, TypeError) as exc:  # not an answer of ours
            return "failed", f"the fork server sent an answer that is not one: {exc}"
        except (EOFError, OSError):
            code = self.proc.exitcode
            how = f" (exit code {code})" if code is not None else ""
            return "failed", f"the fork server exited{how}{self._log_tail()}"

    def _log_tail(self) -> str:
        try:
            lines = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return f"; its last output: {lines[-1].strip()}" if lines else ""

    def close(self) -> None:
        """Stop the server (it exits when its socket closes) and remove its log."""
        close_quietly(self.sock, self.conn)
        reap_or_kill(self.proc, self.pidfd, 1.0)
        os.close(self.pidfd)
        if self.template_pid is not None:  # the server killed it on its way out
            reap_pid(self.template_pid)
            self.template_pid = None
        with contextlib.suppress(OSError):
            self.log.unlink()
