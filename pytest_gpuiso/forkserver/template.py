"""The template: a configured, collected pytest session that the tests' processes fork from.

The fork server forks the template once the isolated tests are known. It configures
pytest, starts the session and collects the isolated tests' modules, then waits in
its ``pytest_collection`` for fork requests; a test's process forked there returns
from that wait into the session and only runs its item (``TemplatePlugin``).

The template serves only if configuring and collecting left nothing outside its
memory that its forks would share (``left_outside``), and only while it has not
touched CUDA and has one thread (``fork.unsafe_to_fork``); otherwise it says why and
exits, and the server forks the tests from its parsed configuration, each of which
configures and collects itself. The processes it started go with it; the /dev/shm
entries it created (as the shim logged them, still the same inode and ours) are
deleted only under ``--gpu-isolate-cleanup``, and otherwise left and named in its reason.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any, Protocol

from .. import _compat
from ..child import cuda_state, relay
from ..leaks.shm_log import created_entries, remove_created
from ..proc._linux import (
    die_with_parent,
    huge_page_steps,
    outlive_parent,
    set_child_subreaper,
    wait_readable,
)
from ..wire.environment import LOG_ENV
from . import audit, pools
from .fork import (
    close_fds,
    close_quietly,
    fork_sibling,
    fork_test_process,
    one_line,
    receive_request,
    send_request,
    unsafe_to_fork,
)
from .template_session import Forked, run_session


class TemplateHost(Protocol):
    """What the template takes from the fork server that forks it (``server.Server``)."""

    boot: Any  # its ServerBoot
    sock: socket.socket
    conn: Connection
    config: Any  # the parsed configuration
    stdio: tuple[int, int]  # pytest's stdout and stderr
    template_note: str | None


# Seconds a fork request waits for the template's answer: a fork takes it milliseconds,
# so past this it is stuck (a stopped one is given up on at once: ``wait_readable``).
FORK_WAIT = 30.0


class TemplateHandle:
    """The server's handle on its template."""

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
    def start(
        cls,
        server: TemplateHost,
        modules: list[str] | None,
        initial: tuple[str, ...] | None = None,
    ) -> TemplateHandle | None:
        """Fork the template, collecting ``modules`` (None: the session's arguments);
        ``initial``: the paths pytest's session started from (``_compat.rewrite_for``).

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
                close_quietly(server.sock, server.conn)
                _template_main(server, theirs, modules, initial)
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
            send_request(self.sock, self.conn, ("fork", cboot, job), fds)
            # A fork takes it milliseconds; a stopped template would never answer
            why = wait_readable(self.conn, FORK_WAIT, self.pid)
            if why is None:
                answer = self.conn.recv()
            else:
                answer = ("failed", f"the template did not fork: {why}")
        except (EOFError, OSError) as exc:
            answer = ("failed", f"the template process is gone ({exc})")
        if answer[0] != "forked":
            self.unusable = str(answer[1])
            self.stop()
        return answer

    def fork_successor(
        self, names: list[tuple[str, str]], patience: float
    ) -> TemplateHandle | None:
        """Have it fork a successor that imports ``names`` (a test imported them) while it
        goes on serving: the successor's handle, which says ``learnt`` once it can take
        over (``Server.adopt``), or ``unfit``."""
        ours, theirs = socket.socketpair()
        try:
            send_request(self.sock, self.conn, ("import", names), [theirs.fileno()])
        except OSError:
            ours.close()
            return None
        finally:
            theirs.close()
        return TemplateHandle(0, ours, False, patience)  # its pid comes with "learnt"

    def stop(self, kill: bool = True) -> None:
        """Kill it (once: after our waitpid its pid may be anyone's); ``kill=False``: close
        its socket only, and it ends a successor that is still importing and exits."""
        if self.stopped:
            return
        self.stopped = True
        if kill and self.pid > 0:  # first: on the socket's end it would end its successors,
            with contextlib.suppress(OSError):  # among them the one taking over from it
                os.kill(self.pid, signal.SIGKILL)  # pytest's child: a zombie until pytest reaps it
        close_quietly(self.sock, self.conn)
        if self.pid > 0 and self.ours:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(self.pid, 0)


def _template_main(
    server: TemplateHost,
    sock: socket.socket,
    modules: list[str] | None,
    initial: tuple[str, ...] | None = None,
) -> None:
    """The template process: configure, collect, then fork tests from inside the session."""
    boot = server.boot
    conn = Connection(os.dup(sock.fileno()))
    config = server.config
    # Its own temporary directory: the session's --basetemp is pytest's to wipe, not ours.
    workdir = os.path.dirname(boot.log)
    config.option.basetemp = tempfile.mkdtemp(prefix="template-", dir=workdir)
    before = audit.snapshot()
    shm_log = None
    if LOG_ENV in os.environ or "LD_PRELOAD" in os.environ:  # the /dev/shm shim may be loaded
        shm_log = os.path.join(config.option.basetemp, "shm.log")
        os.close(os.open(shm_log, os.O_CREAT | os.O_WRONLY, 0o600))  # the shim only appends
        os.environ[LOG_ENV] = shm_log
    # Until it has collected, daemons its plugins start (double fork, setsid) become its
    # children too, so that left_outside sees them, instead of being re-parented to pytest.
    set_child_subreaper(True)

    def await_fork(items: list[str]) -> Forked:
        """Called by the session once collected; returns only in a test's process."""
        os.environ.pop(LOG_ENV, None)
        pools.step("collecting test modules")
        # what it started is killed with it; pytest's capture files each test's process keeps
        problem = audit.unfit(before, shm_log, _compat.global_capture_fds(config))
        set_child_subreaper(False)  # tests' orphans (with two forks: tests) go to pytest
        if problem is not None:  # what it made goes with it, not to a test's account
            if shm_log is not None:  # only what the shim saw it create, still that inode
                if boot.cleanup:
                    remove_created(shm_log)
                elif left := created_entries(shm_log):
                    entry, how = f"/dev/shm/{left[0]}", "--gpu-isolate-cleanup deletes it"
                    if entry in problem:
                        problem += f" (left in place: {how})"
                    else:
                        problem += f"; it created {entry} too, left in place ({how})"
            conn.send(("unusable", f"after configuring and collecting: {problem}"))
            os._exit(0)
        cuda_state.baseline()  # what its forks inherit: nothing runs between here and a test
        relay.freeze()
        conn.send(("collected", items))
        forked = _serve_forks(boot.parent_pid, sock, conn, server.stdio, items)
        if forked is None:
            os._exit(0)  # the server closed the socket
        return forked

    try:
        run_session(config, modules, await_fork, boot.options, initial)
    except BaseException as exc:  # noqa: BLE001 - the server then forks every test itself
        traceback.print_exc()
        with contextlib.suppress(OSError):
            conn.send(("unusable", f"the template failed: {one_line(exc)}"))


def _serve_forks(
    parent_pid: int,
    sock: socket.socket,
    conn: Connection,
    stdio: tuple[int, int],
    items: list[str],
) -> Forked | None:
    """Fork the tests' processes asked for, compacting memory while idle. Returns None
    once the server closes the socket, and the test's own in a test's process.

    Asked to import modules a test imported (``import``), it forks a successor that
    imports them while this process goes on serving; once the successor says it is
    ready the server asks only it and kills this one, and the successor, re-parented to
    pytest, goes on in this loop."""
    compact: Iterator[int] | None = huge_page_steps()
    successor = False  # this process took over from the template that forked it
    successors: list[int] = []  # those it forked, until they are reaped
    while True:
        successors = [pid for pid in successors if not _reaped(pid, os.WNOHANG)]
        if compact is not None and not conn.poll(0):  # idle: compact a little
            if next(compact, None) is None:
                compact = None
            continue
        request = receive_request(sock, conn)
        if request is None:  # the session is over: so is a successor still importing
            for pid in successors:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
                _reaped(pid, 0)
            return None
        fds, (kind, *payload) = request
        if kind == "import" and len(fds) != 1:  # never answered: the server waits for none
            close_fds(fds)
            continue
        if kind == "import":
            template = os.getpid()
            if (pid := os.fork()) != 0:
                successors.append(pid)
                close_fds(fds)
                continue
            close_quietly(sock, conn)
            sock, conn = _succeed(template, fds[0], payload[0], items)
            compact, successor, successors = huge_page_steps(), True, []
            continue
        if kind != "fork" or len(fds) != 2:
            close_fds(fds)
            conn.send(("refused", f"the template got a {kind!r} request with {len(fds)} fds"))
            continue
        if successor:  # its first fork: once it is pytest's child, like the tests
            successor = False
            _await_parent(parent_pid)
        cboot, job = payload
        # Its CUDA state was checked when it had collected or learnt: nothing ran since.
        answer = fork_test_process(parent_pid, [sock, conn], stdio, "the template", True)
        if answer is None:  # the test's process: back into the session, with its pipes
            return cboot, job, Connection(fds[0]), Connection(fds[1])
        close_fds(fds)
        conn.send(answer)


def _succeed(
    template: int, fd: int, names: list[tuple[str, str]], items: list[str]
) -> tuple[socket.socket, Connection]:
    """In a successor just forked from ``template``: import ``names``, say whether this
    process can take over (on ``fd``, its own socket to the server) and return that
    socket; or leave, unfit, or once the server gave up on it (running no hook). It dies
    with the template while it imports, and no longer once it is ready to take over (the
    server kills that one then)."""
    die_with_parent(template)
    sock, conn = socket.socket(fileno=fd), Connection(os.dup(fd))
    unfit = audit.import_audited(names)
    if unfit is None:
        cuda_state.baseline()  # the driver its imports mapped is no test's
        outlive_parent()
    try:
        conn.send(("unfit", *unfit) if unfit is not None else ("learnt", os.getpid(), items))
    except OSError:
        os._exit(0)
    if unfit is not None:
        os._exit(0)
    return sock, conn


def _reaped(pid: int, options: int) -> bool:
    """Whether our child ``pid`` is gone (reaped now, or before)."""
    try:
        return os.waitpid(pid, options)[0] != 0
    except ChildProcessError:
        return True


def _await_parent(parent_pid: int) -> None:
    """Wait (5 s at most) until the template that forked this one is gone and pytest is
    its parent, then die with pytest as that template did."""
    deadline = time.monotonic() + 30.0  # the old template's exit: a large process's
    while os.getppid() != parent_pid and time.monotonic() < deadline:
        time.sleep(0.0005)
    die_with_parent(parent_pid)
