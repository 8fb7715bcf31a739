"""The fork server: one process per pytest worker that forks the isolated tests' processes.

Starting an interpreter and importing pytest, its plugins and torch costs seconds;
forking a process that already did costs milliseconds. The server is spawned
(a fresh interpreter, never a fork of pytest), imports the ``--gpu-isolate-preload``
modules, parses the session's configuration the way a child does (which imports
every plugin and the initial conftests) and loads the conftests of the test
directories it is told about. It never configures pytest and never runs a test.

The clean-CUDA guarantee is checked before every fork (``cuda_state``): a server
that has loaded the CUDA driver, or has more than one thread (a thread holding a
lock at fork time deadlocks the child), refuses, and the caller falls back to
``spawn``. Each child checks again when it starts.

A test's process must be pytest's own child (its exit status, its pdeathsig, the
process sweep), so the server forks twice: the intermediate process forks the
test's process and exits at once, and the orphan is re-parented to pytest, a
child subreaper. The test's process waits until that has happened before it
sets its parent-death signal.

Protocol over one socket pair: a request is one byte carrying the file
descriptors (``socket.send_fds``) followed by a pickled message; the answers
are pickled messages.
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from . import cuda_state
from ._linux import die_with_parent

REPARENT_WAIT = 5.0  # seconds the test's process waits to become pytest's child


class Unavailable(RuntimeError):
    """The fork server cannot serve (failed start-up, refused fork); the message says why."""


@dataclass(frozen=True)
class ServerBoot:
    parent_pid: int
    log: str
    preload: tuple[str, ...]
    args: tuple[str, ...]
    invocation_dir: str


class ForkServer:
    """pytest's handle on its fork server."""

    def __init__(
        self,
        ctx: Any,
        log: Path,
        preload: tuple[str, ...],
        args: tuple[str, ...],
        invocation_dir: str,
    ) -> None:
        self.log = log
        self.conn, theirs = ctx.Pipe(duplex=True)  # a Unix socket pair
        boot = ServerBoot(os.getpid(), str(log), tuple(preload), tuple(args), invocation_dir)
        self.proc = ctx.Process(target=serve, args=(boot, theirs), daemon=False)
        self.proc.start()
        unlist(self.proc)
        # Its exit, seen even while forked tests hold its sentinel pipe (they inherit it).
        self.pidfd = os.pidfd_open(self.proc.pid)
        theirs.close()
        self.sock = socket.socket(fileno=os.dup(self.conn.fileno()))
        self.ready = False

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
        request = pickle.dumps(("fork", boot, job))  # before the first byte goes out
        try:
            socket.send_fds(self.sock, [b"F"], fds)
            self.conn.send_bytes(request)
        except OSError as exc:
            raise Unavailable(f"the fork server is gone ({exc}){self._log_tail()}") from None

    def answer(self, timeout: float) -> tuple[str, Any]:
        """The next answer to a fork request: ("forked", pid) or ("refused"/"failed", why)."""
        return self._answer(timeout, "fork")

    def load_conftests(self, directories: list[str]) -> None:
        """Ask the server to import the conftests of these test directories (best effort)."""
        with contextlib.suppress(OSError):
            socket.send_fds(self.sock, [b"C"], [])
            self.conn.send(("conftests", directories))

    def _answer(self, timeout: float, what: str) -> tuple[str, Any]:
        try:
            if not self.conn.poll(timeout):
                return "failed", f"the fork server did not answer ({what}) within {timeout:g} s"
            return self.conn.recv()
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
        for closer in (self.sock.close, self.conn.close):
            with contextlib.suppress(OSError):
                closer()
        if not wait([self.pidfd], 1.0):
            with contextlib.suppress(OSError):
                self.proc.kill()
            wait([self.pidfd], 5.0)
        self.proc.join(0)
        os.close(self.pidfd)
        with contextlib.suppress(OSError):
            self.log.unlink()


# --------------------------------------------------------------------------- server side


_state: dict[str, Any] = {}  # the server's parsed config and saved descriptors


def serve(boot: ServerBoot, conn: Connection) -> None:
    """Entry point of the fork server process."""
    die_with_parent(boot.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is pytest's; it closes us
    # The tests' processes get pytest's stdout/stderr back (for -s); the server's own
    # output (import noise) goes to its log.
    _state["stdio"] = (os.dup(1), os.dup(2))
    log = os.open(boot.log, os.O_WRONLY | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        _prepare(boot)
    except BaseException as exc:  # noqa: BLE001 - any failure means: no fork server
        traceback.print_exc()
        conn.send(("failed", f"the fork server could not start: {_one_line(exc)}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, 1, 4)
        except OSError:
            break
        if not data:
            break  # pytest closed its end: the session is over
        try:
            kind, *payload = conn.recv()
        except (EOFError, OSError):
            break
        if kind == "conftests":
            _load_conftests(payload[0])
            _freeze()
        elif kind == "fork":
            conn.send(_fork(boot, sock, conn, fds, *payload))
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
    os._exit(0)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, Unavailable) or text == type(exc).__name__:
        return text  # our own message says what failed
    return f"{type(exc).__name__}: {text}"


def _prepare(boot: ServerBoot) -> None:
    """Import the preload modules, then everything parsing the configuration imports."""
    from importlib import import_module

    os.chdir(boot.invocation_dir)
    for name in boot.preload:
        try:
            import_module(name)
        except BaseException as exc:
            raise Unavailable(f"--gpu-isolate-preload: importing {name} failed: {exc!r}") from None
    import pytest  # noqa: F401 - the point is to have it imported
    from _pytest.config import _prepareconfig

    config = _prepareconfig(list(boot.args))
    if config.pluginmanager.has_plugin("_cov"):
        raise Unavailable(
            "pytest-cov is active: its coverage would be measured in the fork server, "
            "not in the tests' processes"
        )
    # Parsing starts pytest's global capture into temporary files; children forked
    # from here must not share them, so each child's own configuration makes its own.
    capman = config.pluginmanager.get_plugin("capturemanager")
    if capman is not None:
        capman.stop_global_capturing()
    _state["config"] = config
    _freeze()


def _freeze() -> None:
    """Move everything imported so far out of the garbage collector's sight.

    Forked children then neither traverse (pytest collects several times at exit;
    ~80 ms each with torch imported) nor copy-on-write touch those objects.
    """
    import gc

    gc.collect()
    gc.freeze()


def _load_conftests(directories: list[str]) -> None:
    """Import the conftests pytest would load when collecting these directories."""
    config = _state.get("config")
    if config is None:
        return
    for directory in directories:
        try:
            config.pluginmanager._loadconftestmodules(
                Path(directory),
                config.getoption("importmode"),
                rootpath=config.rootpath,
                consider_namespace_packages=config.getini("consider_namespace_packages"),
            )
        except KeyboardInterrupt:
            raise
        except BaseException:  # noqa: BLE001 - even pytest.skip() at import: the test meets it
            continue


def unlist(proc: Any) -> None:
    """Keep one of our processes out of ``multiprocessing.active_children()``.

    A test (run in-process) that cleans up the children it sees there must not
    terminate the fork server or a prewarmed process. We wait for and reap them
    ourselves (pidfd, ``join``).
    """
    with contextlib.suppress(AttributeError, KeyError):
        multiprocessing.process._children.discard(proc)  # type: ignore[attr-defined]


def unsafe_to_fork() -> str | None:
    """Why forking this process would not give a clean child, or None."""
    reason = cuda_state.touched()
    if reason is not None:
        return reason
    try:
        threads = len(os.listdir("/proc/self/task"))
    except OSError:
        threads = threading.active_count()
    if threads > 1:
        names = ", ".join(t.name for t in threading.enumerate() if t is not threading.main_thread())
        started = f" ({names})" if names else " (native threads)"
        return f"the fork server has {threads} threads{started}; a fork could deadlock"
    return None


def _fork(
    boot: ServerBoot, sock: socket.socket, conn: Connection, fds: list[int], cboot: Any, job: Any
) -> tuple[str, Any]:
    problem = unsafe_to_fork()
    if problem is not None:
        return "refused", f"the fork server refused to fork: {problem}"
    if len(fds) != 2:
        return "refused", f"the fork server got {len(fds)} descriptors for a fork, expected 2"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the intermediate: fork the test's process, then orphan it
        try:
            os.close(r)
            grandchild = os.fork()
            if grandchild == 0:
                os.close(w)
                _become_test_process(boot, sock, conn, fds, cboot, job)
            os.write(w, grandchild.to_bytes(8, "little"))
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 8 - len(data)):
        data += chunk
        if len(data) == 8:
            break
    os.close(r)
    os.waitpid(pid, 0)
    if len(data) != 8:
        return "refused", "the fork server could not fork"
    return "forked", int.from_bytes(data, "little")


def _become_test_process(
    boot: ServerBoot, sock: socket.socket, conn: Connection, fds: list[int], cboot: Any, job: Any
) -> None:
    from . import child

    status = 72
    try:
        sock.close()
        conn.close()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        out, err = _state.pop("stdio")
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.close(out)
        os.close(err)
        deadline = time.monotonic() + REPARENT_WAIT
        while os.getppid() != boot.parent_pid:  # until the intermediate is gone
            if time.monotonic() > deadline:
                status = 71
                return
            time.sleep(0.0002)
        _forget_server()
        child.main(cboot, job, Connection(fds[0]), Connection(fds[1]))
    finally:
        os._exit(status)


def _forget_server() -> None:
    """Hand the parsed configuration on; undo what the test's process must not inherit."""
    from . import child

    child.prepared = _state.pop("config", None)
    _state.clear()
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # every fork would otherwise draw the same "random" numbers
        with contextlib.suppress(Exception):
            numpy.random.seed()
