"""Forking a test's process that is pytest's own child, and the wire that asks for one.

The clean-CUDA guarantee is checked before every fork (``unsafe_to_fork``): a
process that has initialised the CUDA driver or touched the GPUs otherwise
(``cuda_state``), or has more than one thread (a thread
holding a lock at fork time deadlocks the child) once OpenBLAS's pool is stopped
(``pools``), refuses, and pytest falls back to ``spawn``. Each test's process forked
from the server checks again when it starts. The template's CUDA state is checked
once it has collected and after each import it learns (``audit``), the only times
code other than ours runs in it, not again before each fork (reading
/proc/self/maps costs ~0.5 ms with torch loaded); its threads are.

A test's process must be pytest's own child (its exit status, its pdeathsig, the
process sweep). ``fork_sibling`` (native/gpuiso_fork.c, ``clone(CLONE_PARENT)``)
makes it so in one fork, the server and the template being pytest's children
themselves. Where that is unavailable the process forks twice: the intermediate
forks the test's process and exits at once, and the orphan is re-parented to
pytest, a child subreaper; the test's process waits until that has happened
before it sets its parent-death signal.

The request wire, over one socket pair: a request is one byte carrying file
descriptors (``socket.send_fds``) followed by a pickled message; answers are
pickled messages.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import signal
import socket
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

from ..child import cuda_state
from ..wire.environment import FORK_TWICE_ENV
from . import pools

REPARENT_WAIT = 5.0  # seconds the test's process waits to become pytest's child
# Set to 1 to fork twice (re-parenting) instead of fork_sibling(): an escape hatch, and
# how the test suite covers the fallback that seccomp filters blocking clone3 force.
_siblings = os.environ.get(FORK_TWICE_ENV, "") in ("", "0")  # until it fails once


def unsafe_to_fork(who: str = "the fork server", cuda_checked: bool = False) -> str | None:
    """Why forking this process (``who``) would not give a clean child, or None.

    ``cuda_checked``: its CUDA state was checked since anything but ours last ran."""
    reason = None if cuda_checked else cuda_state.touched()
    if reason is not None:
        return reason
    count = pools.quiesce()  # OpenBLAS's workers (numpy's, started at import) stop until used
    if count > 1:
        return pools.why_threads(who, count)
    return None


def fork_sibling() -> int | None:
    """``os.fork()`` whose child is this process's parent's child; None where unavailable.

    See native/gpuiso_fork.c. Unavailable without the extension, before Linux 5.3
    (clone3), or where a seccomp filter refuses clone3 (some container runtimes).
    """
    global _siblings
    if _siblings:
        try:
            from .._fork import fork_sibling as fork

            return fork()
        except (ImportError, OSError):
            _siblings = False
    return None


def fork_test_process(
    parent_pid: int,
    close: list[Any],
    stdio: tuple[int, int],
    who: str = "the fork server",
    cuda_checked: bool = False,
) -> tuple[str, Any] | None:
    """Fork a test's process that is pytest's (``parent_pid``'s) child.

    Like ``os.fork()``, it returns twice: here ("forked", pid) or ("refused", why),
    and None in the test's process, which has closed ``close`` (this process's own
    connections), has ``stdio`` (pytest's stdout and stderr) as its fds 1 and 2, and
    is pytest's child. ``who``: this process, for the messages; ``cuda_checked``: as
    ``unsafe_to_fork``'s.
    """
    problem = unsafe_to_fork(who, cuda_checked)
    if problem is not None:
        return "refused", f"{who} refused to fork: {problem}"
    pid = fork_sibling()
    if pid is None:
        return _fork_twice(parent_pid, close, stdio, who)
    if pid == 0:
        _become_test_process(parent_pid, close, stdio)
        return None
    return "forked", pid


def _fork_twice(
    parent_pid: int, close: list[Any], stdio: tuple[int, int], who: str
) -> tuple[str, Any] | None:
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
        _become_test_process(parent_pid, close, stdio)
        return None
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


def _become_test_process(parent_pid: int, close: list[Any], stdio: tuple[int, int]) -> None:
    """Undo in a freshly forked test's process what it must not inherit (exits on failure)."""
    try:
        for closer in close:
            closer.close()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        out, err = stdio
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.close(out)
        os.close(err)
        deadline = time.monotonic() + REPARENT_WAIT
        while os.getppid() != parent_pid:  # until the intermediate is gone
            if time.monotonic() > deadline:
                os._exit(71)
            time.sleep(0.0002)
        gc.enable()
        _forget_multiprocessing_children()
        reseed()
    except BaseException:
        os._exit(71)


def reseed() -> None:
    """Fresh seeds for numpy's and torch's global generators (Python's ``random`` reseeds
    itself after a fork): every fork would otherwise draw the same "random" numbers, where
    a spawned process seeds them from the OS. torch's CPU generator only: CUDA is never
    initialised before the fork, and its generators are made (and seeded) when it is."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        with contextlib.suppress(Exception):
            numpy.random.seed()
    torch = sys.modules.get("torch")
    generator = getattr(torch, "default_generator", None)
    if generator is not None:
        with contextlib.suppress(Exception):
            generator.seed()


def _forget_multiprocessing_children() -> None:
    """As in a process multiprocessing forks: the finalizers and child processes of the
    process it was forked from are not its own (its exit would run and join them)."""
    util = sys.modules.get("multiprocessing.util")
    if util is not None:
        util._finalizer_registry.clear()
    process = sys.modules.get("multiprocessing.process")
    if process is not None:
        process._children = set()


def send_request(
    sock: socket.socket, conn: Connection, message: Any, fds: list[int] | None = None
) -> None:
    """One request: a byte carrying ``fds``, then the pickled message.

    The message is pickled before the byte goes out: a pickling error must not leave
    the other end waiting for a message after the byte.
    """
    data = pickle.dumps(message)
    socket.send_fds(sock, [b"R"], fds or [])
    conn.send_bytes(data)


def receive_request(sock: socket.socket, conn: Connection) -> tuple[list[int], Any] | None:
    """One request: the descriptors that came with its first byte, and the message;
    None once the other end has closed."""
    try:
        data, fds, _, _ = socket.recv_fds(sock, 1, 4)
    except OSError:
        return None
    if not data:
        return None
    try:
        return fds, conn.recv()
    except (EOFError, OSError):
        close_fds(fds)
        return None


def one_line(exc: BaseException) -> str:
    """An exception in one line: its type and its text."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def close_quietly(*ends: socket.socket | Connection) -> None:
    for end in ends:
        with contextlib.suppress(OSError):
            end.close()


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
