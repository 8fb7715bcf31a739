"""How the test's process ends: its exit hooks, then saying it is exiting.

Runs in the test's process, last. ``flush_and_exit`` runs the exit hooks a process of
multiprocessing runs and those the test's own code registered (``mark_exit_handlers``),
then ``say_exiting`` closes every descriptor but stdio and the pipe and sends
``EXITING``; pytest's side (``parent.leaving``) then goes on without waiting for the
kernel to tear the process's memory down, when it is safe to.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import signal
import socket
import struct
import sys
import traceback
import weakref
from multiprocessing.connection import Connection
from typing import NoReturn

from ..proc import workdir
from ..wire import frames
from . import cuda_state, tracker


def flush_and_exit(status: int, conn: Connection | None = None) -> NoReturn:
    """Leave as multiprocessing's own processes leave, then at once (``os._exit``).

    threading's exit hooks run (concurrent.futures shuts its executors down there), then
    multiprocessing's finalizers (the semaphores of a pool left open are unlinked, its
    workers ended), as at the end of a ``multiprocessing.Process``; the parent bounds
    them with the exit bound. Between them, as at an interpreter's exit: the ``atexit``
    handlers and ``weakref.finalize`` entries registered since the test's go
    (``mark_exit_handlers``), i.e. by the test's own code, not those of the imports,
    plugins and conftests before it (torch's alone cost ~23 ms in a forked process; in-
    process they run once, in pytest's). Not run: the joining of non-daemon threads still
    running (they would keep the process alive; in-process they would keep pytest alive)
    and the interpreter's teardown of every module.

    Then the shared memory segments the test left registered with multiprocessing's
    resource tracker go to its leak check (``tracker.hand_over``), not to the tracker,
    which would warn of them on pytest's terminal when pytest exits.

    ``conn``: the pipe to the parent, which is told ``EXITING`` last (``say_exiting``)."""
    _flush()
    run_exit_hooks()
    _flush()
    with contextlib.suppress(Exception):
        tracker.hand_over()
    with contextlib.suppress(Exception):  # os._exit() runs no atexit handler: ours now
        workdir.remove_process_dir()
    if conn is not None and status == 0:
        with contextlib.suppress(Exception):
            say_exiting(conn)
    os._exit(status)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


class _ExitMark:
    """Where the exit handlers of the test's own code begin (None: not marked)."""

    finalizers: int | None = None  # the first ``weakref.finalize`` index after the go


def mark_exit_handlers() -> None:
    """At the test's go (again at a later one, after ``go_first``): what imports, plugins,
    conftests, the template registered for exit is not the test's and is dropped (never
    run: ``os._exit``); what is registered from now on runs at exit (``run_exit_hooks``)."""
    with contextlib.suppress(Exception):
        atexit._clear()
        _ExitMark.finalizers = next(weakref.finalize._index_iter)
    with contextlib.suppress(Exception):
        tracker.watch()  # likewise, the segments it registers with the resource tracker


def _run_finalizers_since(first: int) -> None:
    """The ``weakref.finalize`` entries made since ``first`` that run at exit, newest
    first, as ``weakref.finalize._exitfunc`` runs them (an open TemporaryDirectory's
    cleanup); a failing one is printed as Python prints it."""
    with contextlib.suppress(Exception):
        pending = sorted(
            (info.index, entry)
            for entry, info in list(weakref.finalize._registry.items())
            if info.index >= first and info.atexit
        )
        for _, entry in reversed(pending):
            try:
                entry()
            except Exception:  # noqa: BLE001 - as Python's own exit: print, go on
                traceback.print_exc()


def run_exit_hooks() -> None:
    """threading's exit hooks, the test's own ``atexit`` handlers and ``weakref.finalize``
    entries (``mark_exit_handlers``), then multiprocessing's finalizers (when it was
    imported); a failing one is printed (to the test's output) as Python prints it."""
    import threading

    hooks = getattr(threading, "_threading_atexits", [])  # CPython's, Python >= 3.9
    for hook in reversed(list(hooks)):
        try:
            hook()
        except Exception:  # noqa: BLE001 - as Python's own exit: print, go on
            traceback.print_exc()
    hooks.clear()
    if _ExitMark.finalizers is not None:
        atexit._run_exitfuncs()  # what the test registered; a failing one is printed
        _run_finalizers_since(_ExitMark.finalizers)
    util = sys.modules.get("multiprocessing.util")
    if util is not None:
        try:
            util._exit_function()
        except Exception:  # noqa: BLE001
            traceback.print_exc()


GPU_DEVICES = (cuda_state.DEVICES, "/dev/kfd", "/dev/dri/")  # CUDA's and ROCm's device files


def say_exiting(conn: Connection) -> None:
    """Close every descriptor but stdio and ``conn``, send ``EXITING`` and close ``conn``:
    nothing but ``os._exit`` comes after. Only as the process's one thread (another
    could be using a descriptor closed under it), with no GPU device open (its driver
    frees the test's GPU memory as the process ends, which the parent then waits for)
    and no socket that lingers on close (an exit never waits for one to flush). No
    signal handler or finalizer runs meanwhile (one could start a thread)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    gc.disable()
    if len(os.listdir("/proc/self/task")) != 1:
        return
    keep = conn.fileno()
    fds = []
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # gone: the listing's own descriptor
        if target.startswith(GPU_DEVICES) or (target.startswith("socket:") and _lingers(fd)):
            return
        if fd > 2 and fd != keep:
            fds.append(fd)
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    frames.send_frame(conn, frames.EXITING, None, "")
    conn.close()


def _lingers(fd: int) -> bool:
    """Whether the socket ``fd`` would wait on close for its data to be sent (or cannot
    tell). The socket object is made without a timeout: one would make the socket, which
    other processes may share, non-blocking."""
    socket.setdefaulttimeout(None)
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return True
    try:
        linger = sock.getsockopt(socket.SOL_SOCKET, socket.SO_LINGER, 8)
    except OSError:
        return True
    finally:
        sock.detach()
    on, seconds = struct.unpack("ii", linger)
    return bool(on) and seconds > 0
