"""The fork server: one process per pytest worker that forks the isolated tests' processes.

Starting an interpreter and importing pytest, its plugins and torch costs seconds;
forking a process that already did costs milliseconds. The server is spawned
(a fresh interpreter, never a fork of pytest), imports the ``--gpu-isolate-preload``
modules, parses the session's configuration the way a child does (which imports
every plugin and the initial conftests) and loads the conftests of the test
directories it is told about. It never configures pytest and never runs a test.

Pre-collection: the server also forks a *template* (``_TemplateHandle``), which
configures pytest, starts the session and collects the isolated tests' modules
once, then serves fork requests from inside its ``pytest_collection``; a test's
process forked there only runs its item. The template serves only if configuring
and collecting left nothing outside its memory that its forks would share
(``_left_outside``); otherwise it gives up and says why, and the server forks the
tests from its parsed configuration, each of which configures and collects itself.

The clean-CUDA guarantee is checked before every fork (``cuda_state``): a server
that has loaded the CUDA driver, or has more than one thread (a thread holding a
lock at fork time deadlocks the child), refuses, and the caller falls back to
``spawn``. Each child checks again when it starts.

A test's process must be pytest's own child (its exit status, its pdeathsig, the
process sweep). ``fork_sibling`` (native/gpuiso_fork.c, ``clone(CLONE_PARENT)``)
makes it so in one fork, the server and the template being pytest's children
themselves. Where that is unavailable the server forks twice: the intermediate
process forks the test's process and exits at once, and the orphan is re-parented
to pytest, a child subreaper; the test's process waits until that has happened
before it sets its parent-death signal.

Protocol over one socket pair: a request is one byte carrying the file
descriptors (``socket.send_fds``) followed by a pickled message; the answers
are pickled messages. The server talks to its template the same way.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing.process
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NoReturn

from . import cuda_state
from ._linux import die_with_parent, huge_page_steps, set_child_subreaper
from .leaks.shm import LOG_ENV, created_entries, remove_created
from .proctree import live_descendants, reap, reap_pid
from .settings import TEMPLATE_WAIT_DEFAULT

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
    collect_all: bool = False  # every test is isolated: the template collects the args at once
    template_wait: float = TEMPLATE_WAIT_DEFAULT  # seconds a fork request waits for it


class ForkServer:
    """pytest's handle on its fork server."""

    def __init__(
        self,
        ctx: Any,
        log: Path,
        preload: tuple[str, ...],
        args: tuple[str, ...],
        invocation_dir: str,
        collect_all: bool = False,
        template_wait: float = TEMPLATE_WAIT_DEFAULT,
    ) -> None:
        self.log = log
        self.conn, theirs = ctx.Pipe(duplex=True)  # a Unix socket pair
        boot = ServerBoot(
            os.getpid(),
            str(log),
            tuple(preload),
            tuple(args),
            invocation_dir,
            collect_all,
            template_wait,
        )
        self.proc = ctx.Process(target=serve, args=(boot, theirs), daemon=False)
        with main_not_rerun():
            self.proc.start()
        unlist(self.proc)
        # Its exit, seen even while forked tests hold its sentinel pipe (they inherit it).
        self.pidfd = os.pidfd_open(self.proc.pid)
        theirs.close()
        self.sock = socket.socket(fileno=os.dup(self.conn.fileno()))
        self.ready = False
        self.template_pid: int | None = None  # the server's template, when it is our child

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
            _send_request(self.sock, self.conn, ("fork", boot, job), fds)
        except OSError as exc:
            raise Unavailable(f"the fork server is gone ({exc}){self._log_tail()}") from None

    def answer(self, timeout: float) -> tuple[str, Any]:
        """The next answer to a fork request: ("refused"/"failed", why) or ("forked", (pid,
        source, note)): forked from the collected ``"template"`` or the parsed ``"server"``;
        ``note``: why the template could not serve, once it has given up. Each answer
        also names the template, which ``template_pid`` keeps (pytest's child, like the
        tests', where it can be: spared by the sweep and reaped by ``close``)."""
        return self._answer(timeout, "fork")

    def collect(self, directories: list[str], modules: list[str]) -> None:
        """Tell the server the isolated tests' directories and modules (best effort).

        It imports the directories' conftests and starts a template that collects
        the modules, so that most tests' processes only have to run their item.
        """
        with contextlib.suppress(OSError):
            _send_request(self.sock, self.conn, ("collect", directories, modules))

    def _answer(self, timeout: float, what: str) -> tuple[str, Any]:
        try:
            if not self.conn.poll(timeout):
                return "failed", f"the fork server did not answer ({what}) within {timeout:g} s"
            kind, payload, *template = self.conn.recv()
            if template and template[0] is not None:
                self.template_pid = template[0]
            return kind, payload
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
        _close_quietly(self.sock, self.conn)
        if not reap(self.proc, self.pidfd, 1.0):
            with contextlib.suppress(OSError):
                self.proc.kill()
            reap(self.proc, self.pidfd, 5.0)
        os.close(self.pidfd)
        if self.template_pid is not None:  # the server killed it on its way out
            reap_pid(self.template_pid)
            self.template_pid = None
        with contextlib.suppress(OSError):
            self.log.unlink()


# --------------------------------------------------------------------------- server side


_state: dict[str, Any] = {}  # the server's parsed config and saved descriptors


def serve(boot: ServerBoot, conn: Connection) -> None:
    """Entry point of the fork server process."""
    die_with_parent(boot.parent_pid)
    # Nothing imported here is ever garbage: no collection may dirty (and so copy into
    # every fork) the pages of long-lived objects. Tests' processes turn it back on.
    gc.disable()
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
    server = _Server(boot, sock, conn)
    if boot.collect_all:  # what pytest collects is what the template collects: start now
        server.template = _TemplateHandle.start(server, None)
    try:
        server.loop()
    finally:
        server.stop_template()
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

    from ._compat import prepare_config

    config = prepare_config(list(boot.args))
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
    gc.freeze()


def _send_request(
    sock: socket.socket, conn: Connection, message: Any, fds: list[int] | None = None
) -> None:
    """One request: a byte carrying ``fds``, then the pickled message (``_receive``'s other end).

    The message is pickled before the byte goes out: a pickling error must not leave
    the other end waiting for a message after the byte.
    """
    data = pickle.dumps(message)
    socket.send_fds(sock, [b"R"], fds or [])
    conn.send_bytes(data)


def _receive(sock: socket.socket, conn: Connection) -> tuple[list[int], Any] | None:
    """One request: the descriptors that came with its first byte, and the message."""
    try:
        data, fds, _, _ = socket.recv_fds(sock, 1, 4)
    except OSError:
        return None
    if not data:
        return None  # the other end closed
    try:
        return fds, conn.recv()
    except (EOFError, OSError):
        _close_all(fds)
        return None


def _close_quietly(*ends: socket.socket | Connection) -> None:
    for end in ends:
        with contextlib.suppress(OSError):
            end.close()


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class _Server:
    """The server's request loop; forks from the template when it can, else itself."""

    def __init__(self, boot: ServerBoot, sock: socket.socket, conn: Connection) -> None:
        self.boot = boot
        self.sock = sock
        self.conn = conn
        self.template: _TemplateHandle | None = None
        self.template_note: str | None = None  # why there is no template, if it was refused

    def loop(self) -> None:
        while (request := _receive(self.sock, self.conn)) is not None:
            fds, (kind, *payload) = request
            try:
                if kind == "collect":
                    self.collect(*payload)
                elif kind == "fork":
                    # Every answer names the template, pytest's child to spare and reap.
                    template = self.template.reaper_pid if self.template is not None else None
                    self.conn.send((*self.fork(fds, *payload), template))
            finally:
                _close_all(fds)

    def collect(self, directories: list[str], modules: list[str]) -> None:
        """Import the test directories' conftests; start a template that collects ``modules``
        (unless one started with the server, collecting the session's arguments)."""
        _load_conftests(directories)
        gc.freeze()
        if modules and self.template is None:
            self.template = _TemplateHandle.start(self, modules)

    def fork(self, fds: list[int], cboot: Any, job: Any) -> tuple[str, Any]:
        """("forked", (pid, source, note)) as ``ForkServer.answer`` describes, or
        ("refused", why)."""
        if len(fds) != 2:
            return "refused", f"the fork server got {len(fds)} descriptors for a fork, expected 2"
        template = self.template
        if template is not None and template.serves(job):
            kind, payload = template.fork(fds, cboot, job)
            if kind == "forked":
                return kind, (payload, "template", None)
        ours = [self.sock, self.conn]
        if template is not None:
            ours += [template.sock, template.conn]
        kind, payload = _fork(self.boot, ours, _run_job(cboot, job, fds))
        if kind != "forked":
            return kind, payload
        note = template.unusable if template else self.template_note
        if template is not None and note is None and template.items is None:
            note = f"the template was still collecting after {self.boot.template_wait:g} s"
        return kind, (payload, "server", note)

    def stop_template(self) -> None:
        if self.template is not None:
            self.template.stop()
            self.template = None


class _TemplateHandle:
    """The server's handle on its template: a configured, collected pytest session.

    The template is forked from the server once the isolated tests are known. It
    configures pytest, starts the session and collects the isolated tests' modules,
    then waits in ``pytest_collection`` for fork requests; a test's process forked
    there only has to run its item. A template that initialised CUDA or started a
    thread while collecting (a test module calling ``torch.cuda.is_available()``
    at import) must not fork: it says why and exits, and the server forks tests
    itself, from its parsed-only configuration.
    """

    def __init__(self, pid: int, sock: socket.socket, ours: bool, patience: float) -> None:
        self.pid = pid
        self.sock = sock
        self.conn = Connection(os.dup(sock.fileno()))
        self.ours = ours  # the server's child (else pytest's, reaped there)
        self.items: frozenset[str] | None = None  # node ids it collected, once it says so
        self.unusable: str | None = None
        self.stopped = False
        self.deadline = time.monotonic() + patience  # fork requests wait until then

    @classmethod
    def start(cls, server: _Server, modules: list[str] | None) -> _TemplateHandle | None:
        """Fork the template, collecting ``modules`` (None: the session's arguments).

        It is pytest's child where ``fork_sibling`` works, like the tests' processes.
        """
        problem = unsafe_to_fork()
        if problem is not None:  # a fork now could deadlock, or carry CUDA into the template
            server.template_note = f"the fork server did not fork a template: {problem}"
            return None
        ours, theirs = socket.socketpair()
        parent = server.boot.parent_pid
        try:
            pid = fork_sibling()
            if pid is None:
                parent = os.getpid()
                pid = os.fork()
        except OSError:
            ours.close()
            theirs.close()
            return None
        if pid == 0:  # the template
            try:
                die_with_parent(parent)
                ours.close()
                server.sock.close()
                server.conn.close()
                _run_template(server.boot, theirs, modules)
            finally:
                os._exit(73)
        theirs.close()
        return cls(pid, ours, parent != server.boot.parent_pid, server.boot.template_wait)

    @property
    def reaper_pid(self) -> int | None:
        """Its pid for pytest to spare and reap, when it is pytest's child."""
        return None if self.ours else self.pid

    def serves(self, job: Any) -> bool:
        """Whether this job's process can be forked from the template (it has its item)."""
        if self.unusable is not None:
            return False
        if self.items is None:
            try:
                if not self.conn.poll(max(0.0, self.deadline - time.monotonic())):
                    return False  # still collecting: the server forks this one
                kind, payload = self.conn.recv()
            except (EOFError, OSError):
                kind, payload = "unusable", "the template process exited"
            if kind != "collected":
                self.unusable = str(payload)
                self.stop()
                return False
            self.items = frozenset(payload)
        return job.nodeid in self.items

    def fork(self, fds: list[int], cboot: Any, job: Any) -> tuple[str, Any]:
        try:
            _send_request(self.sock, self.conn, ("fork", cboot, job), fds)
            answer = self.conn.recv()
        except (EOFError, OSError) as exc:
            answer = ("failed", f"the template process is gone ({exc})")
        if answer[0] != "forked":
            self.unusable = str(answer[1])
            self.stop()
        return answer

    def stop(self) -> None:
        """Kill it (once: after our waitpid its pid may be anyone's)."""
        if self.stopped:
            return
        self.stopped = True
        _close_quietly(self.sock, self.conn)
        with contextlib.suppress(ChildProcessError, OSError):
            os.kill(self.pid, signal.SIGKILL)  # pytest's child: a zombie until pytest reaps it
            if self.ours:
                os.waitpid(self.pid, 0)


def _run_template(boot: ServerBoot, sock: socket.socket, modules: list[str] | None) -> None:
    """The template process: configure, collect, then fork tests from inside the session."""
    from . import child

    conn = Connection(os.dup(sock.fileno()))
    config = _state["config"]
    # Its own temporary directory: the session's --basetemp is pytest's to wipe, not ours.
    workdir = os.path.dirname(boot.log)
    config.option.basetemp = tempfile.mkdtemp(prefix="template-", dir=workdir)
    before = _descriptors(), _shared_mappings()
    shm_log = None
    if LOG_ENV in os.environ or "LD_PRELOAD" in os.environ:  # the /dev/shm shim may be loaded
        shm_log = os.path.join(config.option.basetemp, "shm.log")
        os.close(os.open(shm_log, os.O_CREAT | os.O_WRONLY, 0o600))  # the shim only appends
        os.environ[LOG_ENV] = shm_log
    # Until it has collected, daemons its plugins start (double fork, setsid) become its
    # children too, so that _left_outside sees them, instead of being re-parented to pytest.
    set_child_subreaper(True)

    def serve(items: list[str]) -> None:
        """Called by the template's session once collected; returns only in a test's process."""
        os.environ.pop(LOG_ENV, None)
        problem = unsafe_to_fork("the template") or _left_outside(before, shm_log)
        set_child_subreaper(False)  # tests' orphans (with two forks: tests) go to pytest
        if problem is not None:  # what it made goes with it, not to a test's account
            _kill_children()
            if shm_log is not None:
                remove_created(shm_log)
            conn.send(("unusable", f"after configuring and collecting: {problem}"))
            os._exit(0)
        gc.freeze()
        conn.send(("collected", items))
        compact: Iterator[int] | None = huge_page_steps()
        while True:
            if compact is not None and not conn.poll(0):  # idle: compact a little
                if next(compact, None) is None:
                    compact = None
                continue
            request = _receive(sock, conn)
            if request is None:
                break
            fds, (kind, *payload) = request
            if kind != "fork":
                _close_all(fds)
                continue
            cboot, job = payload
            # In the test's process, Become unwinds out of here, into its session.
            conn.send(_fork(boot, [sock, conn], _become(cboot, job, fds), "the template"))
            _close_all(fds)
        os._exit(0)

    try:
        child.run_template(config, modules, serve)
    except BaseException as exc:  # noqa: BLE001 - the server then forks every test itself
        traceback.print_exc()
        with contextlib.suppress(OSError):
            conn.send(("unusable", f"the template failed: {_one_line(exc)}"))


def _descriptors() -> dict[int, str]:
    """This process's open descriptors and what they point to."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            found[int(name)] = os.readlink(f"/proc/self/fd/{name}")
    return found


def _write_only(fd: int) -> bool:
    """Whether ``fd`` was opened for writing only (its offset then only ever grows)."""
    try:
        with open(f"/proc/self/fdinfo/{fd}") as info:
            for line in info:
                if line.startswith("flags:"):
                    return int(line.split()[1], 8) & os.O_ACCMODE == os.O_WRONLY
    except (OSError, ValueError):
        pass
    return False


def _shared_mappings() -> set[str]:
    """This process's shared memory mappings (lines of /proc/self/maps with an "s")."""
    try:
        with open("/proc/self/maps") as maps:
            return {line for line in maps.read().splitlines() if line.split()[1][3:4] == "s"}
    except OSError:
        return set()


def _left_outside(before: tuple[dict[int, str], set[str]], shm_log: str | None) -> str | None:
    """What configuring and collecting made outside this process's memory, or None.

    Forked tests' processes would share it: one test would see what another wrote into
    a shared mapping (``mmap``, a multiprocessing lock) or read from a file (the
    offset is shared), and each one's ``pytest_unconfigure`` would tear down what the
    next one still needs (a helper process, a connection). A regular file opened for
    writing only is fine (a log file: each test's process appends to it).
    """
    fds, mappings = before
    kids = live_descendants()
    if kids:
        return f"it started process {kids[0]}" + (f" and {len(kids) - 1} more" if kids[1:] else "")
    for fd, target in _descriptors().items():
        if fds.get(fd) == target:
            continue
        regular = target.startswith("/") and not target.startswith(("/dev/", "/proc/"))
        if regular and not _write_only(fd):
            return f"it opened {target} for reading (descriptor {fd})"
        if not (regular or target in ("/dev/null", "/dev/urandom")):
            return f"it opened {target} (descriptor {fd})"
    for mapping in sorted(_shared_mappings() - mappings):
        fields = mapping.split(maxsplit=5)
        what = fields[5] if len(fields) > 5 else ""
        if not what or what.startswith("/dev/zero"):
            what = "anonymous memory"
        return f"it made a shared mapping of {what} ({fields[0]})"
    created = created_entries(shm_log) if shm_log else []
    if created:
        return f"it created /dev/shm/{created[0]}"
    return None


def _kill_children() -> None:
    """The template gives up: what it started goes with it, not to a test's account."""
    for pid in live_descendants():
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


class Become(BaseException):  # noqa: N818 - not an error: a control transfer
    """Raised in a test's process forked by the template: (boot, job, conn, go).

    It unwinds out of the template's request loop, back into its pytest session,
    which then runs the job's item as that process's one test.
    """


def _become(cboot: Any, job: Any, fds: list[int]) -> Callable[[], NoReturn]:
    def become() -> NoReturn:
        raise Become(cboot, job, Connection(fds[0]), Connection(fds[1]))

    return become


def _run_job(cboot: Any, job: Any, fds: list[int]) -> Callable[[], NoReturn]:
    """A test's process forked from the server: run the job from the parsed configuration."""

    def run() -> NoReturn:
        from . import child

        child.prepared = _state.pop("config", None)
        child.main(cboot, job, Connection(fds[0]), Connection(fds[1]))
        os._exit(72)  # main() never returns

    return run


def _load_conftests(directories: list[str]) -> None:
    """Import the conftests pytest would load when collecting these directories."""
    config = _state.get("config")
    if config is None:
        return
    from ._compat import load_conftests

    for directory in directories:
        try:
            load_conftests(config, Path(directory))
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


@contextlib.contextmanager
def main_not_rerun() -> Iterator[None]:
    """While starting a spawned process: it must not re-run this process's ``__main__``.

    multiprocessing re-runs the parent's main script in every spawned child (as
    ``__mp_main__``) so that functions defined there unpickle. pytest's processes need
    nothing from it, and re-running it is harmful: a ``run_tests.py`` calling
    ``pytest.main()`` without a ``__name__`` guard would start pytest again in every
    test's process, and a script read from stdin (``python -``) cannot be re-run at all.
    The preparation data is taken inside ``start()``, so a bare ``__main__`` is in
    place only for that call.
    """
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def unsafe_to_fork(who: str = "the fork server") -> str | None:
    """Why forking this process (``who``) would not give a clean child, or None."""
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
        return f"{who} has {threads} threads{started}; a fork could deadlock"
    return None


def _fork(
    boot: ServerBoot,
    close: list[Any],
    run: Callable[[], NoReturn],
    who: str = "the fork server",
) -> tuple[str, Any]:
    """Fork a test's process that ``run``s as pytest's child; ("forked", pid) or why not.

    One fork whose child is pytest's (``fork_sibling``, this process being pytest's
    child too), else two: the intermediate forks the test's process and exits, and
    the orphan is re-parented to pytest. ``close``: this process's own connections,
    which the test's process must not hold. ``who``: this process, for the messages.
    """
    problem = unsafe_to_fork(who)
    if problem is not None:
        return "refused", f"{who} refused to fork: {problem}"
    pid = fork_sibling()
    if pid is None:
        return _fork_twice(boot, close, run, who)
    if pid == 0:
        _run_test_process(boot, close, run)
    return "forked", pid


# Set to 1 to fork twice (re-parenting) instead of fork_sibling(): an escape hatch, and
# how the test suite covers the fallback that seccomp filters blocking clone3 force.
FORK_TWICE_ENV = "PYTEST_GPUISO_FORK_TWICE"
_siblings = os.environ.get(FORK_TWICE_ENV, "") in ("", "0")  # until it fails once


def fork_sibling() -> int | None:
    """``os.fork()`` whose child is this process's parent's child; None where unavailable.

    See native/gpuiso_fork.c. Unavailable without the extension, before Linux 5.3
    (clone3), or where a seccomp filter refuses clone3 (some container runtimes).
    """
    global _siblings
    if _siblings:
        try:
            from ._fork import fork_sibling as fork

            return fork()
        except (ImportError, OSError):
            _siblings = False
    return None


def _fork_twice(
    boot: ServerBoot, close: list[Any], run: Callable[[], NoReturn], who: str
) -> tuple[str, Any]:
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError as exc:
        os.close(r)
        os.close(w)
        return "refused", f"{who} could not fork: {exc}"
    if pid == 0:  # the intermediate: fork the test's process, then orphan it
        grandchild = -1
        try:
            os.close(r)
            grandchild = os.fork()
            if grandchild != 0:
                os.write(w, grandchild.to_bytes(8, "little"))
        finally:
            if grandchild != 0:
                os._exit(0)
        os.close(w)
        _run_test_process(boot, close, run)
    os.close(w)
    data = b""
    while chunk := os.read(r, 8 - len(data)):
        data += chunk
        if len(data) == 8:
            break
    os.close(r)
    os.waitpid(pid, 0)
    if len(data) != 8:
        return "refused", f"{who} could not fork"
    return "forked", int.from_bytes(data, "little")


def _run_test_process(boot: ServerBoot, close: list[Any], run: Callable[[], NoReturn]) -> NoReturn:
    try:
        _become_test_process(boot, close)
    except BaseException:
        os._exit(71)
    run()  # returns only by raising Become (a template's test process)
    os._exit(72)


def _become_test_process(boot: ServerBoot, close: list[Any]) -> None:
    """Undo in a freshly forked test's process what it must not inherit from the server."""
    for closer in close:
        closer.close()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    out, err = _state.pop("stdio")
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.close(out)
    os.close(err)
    deadline = time.monotonic() + REPARENT_WAIT
    while os.getppid() != boot.parent_pid:  # until the intermediate is gone
        if time.monotonic() > deadline:
            os._exit(71)
        time.sleep(0.0002)
    gc.enable()
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # every fork would otherwise draw the same "random" numbers
        with contextlib.suppress(Exception):
            numpy.random.seed()
