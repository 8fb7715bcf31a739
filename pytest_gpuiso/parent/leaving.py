"""A test's process that says it is exiting: going on without waiting for its teardown.

A process's exit shows (pidfd, ``waitpid``) only once the kernel has torn its memory
down: ~4 ms for a process forked from a template that imported torch, on every test's
critical path. A test's process ends by closing its descriptors (not stdio, not the
pipe) and saying ``EXITING`` (``child.exiting``); the supervisor then goes on at
once (``Watch``'s ``leave``) when all of these hold, and else waits for the exit as before:

* the process ran a test (not a ``run_isolated`` call), was forked from the fork
  server, and no probe of the test needs its end: the GPU memory probe does (the
  driver frees the test's GPU memory as the process ends), and a process with a GPU
  device open does not say ``EXITING`` at all;
* it is past its exit, with no thread left but the one exiting: ``/proc/PID/stat`` has
  ``PF_EXITING``, one thread and no memory any more (the kernel detaches it before
  tearing it down), and its exit status (field 52) is final (``exit_status``), seen
  within ``PATIENCE``. A test's process says ``EXITING`` only when it is its only
  thread (no other thread can be using a descriptor it closes, or start anything);
  one that sends the frame itself and goes on running is waited for as before;
* it left no process: it has no child (read first: an exiting process's children go
  to pytest, where the listing that follows finds them), and nothing is new among
  our descendants but itself. Past its exit it can start none, so the sweep is complete.

Its probes then run at once: it maps nothing any more and holds no descriptor but its
stdio and the pipe, so /dev/shm's holder check sees it as the ended process it is. The
next test gets its go while the kernel finishes, and the process is reaped later
through its pidfd (``Reaper``): before every listing of our descendants, before a test
that runs in pytest's own process, and at the session's end.
"""

from __future__ import annotations

import os
import time
from multiprocessing.connection import wait

from ..proc.proctree import stat_fields

PF_EXITING = 0x4  # <linux/sched.h>: the task is in do_exit()
PATIENCE = 0.05  # seconds from EXITING until the process must be past its exit


def exit_status(pid: int) -> int | None:
    """The exit status of our child ``pid`` once it is past its exit and its memory is
    detached (``waitpid``'s value, as ``Process.exitcode``); None until then, or
    where ``/proc`` does not say (not Linux, a kernel before 3.5)."""
    fields = stat_fields(pid)
    # flags is field 9, num_threads 20, vsize 23, exit_code 52
    if fields is None or len(fields) < 50 or not int(fields[6]) & PF_EXITING:
        return None
    if int(fields[17]) != 1 or int(fields[20]) != 0:
        return None
    try:
        return os.waitstatus_to_exitcode(int(fields[49]))
    except ValueError:  # not a status waitpid would give
        return None


def ended(pid: int, patience: float = PATIENCE) -> int | None:
    """``exit_status`` of ``pid``, waiting up to ``patience`` seconds for it."""
    deadline = time.monotonic() + patience
    while (status := exit_status(pid)) is None and time.monotonic() < deadline:
        time.sleep(0.0002)
    return status


class Reaper:
    """Our children past their exit, each with its pidfd, reaped once they are gone (a
    pidfd names its process: no later one with the same pid is ever waited for)."""

    def __init__(self) -> None:
        self.fds: dict[int, int] = {}  # pid -> pidfd
        self.stuck: set[int] = set()  # outlasted a wait once: polled only, from then on

    def add(self, pid: int, fd: int) -> None:
        self.fds[pid] = fd

    def reap(self, patience: float = 0.0) -> frozenset[int]:
        """Reap those that are gone, waiting up to ``patience`` seconds in all for the
        others; returns the pids still unreaped. (A signal would change nothing: they
        are past their exit.)"""
        deadline = time.monotonic() + patience
        for pid, fd in list(self.fds.items()):
            wait_for = 0.0 if pid in self.stuck else max(0.0, deadline - time.monotonic())
            if _reaped(pid, fd, wait_for):
                del self.fds[pid]
                self.stuck.discard(pid)
                os.close(fd)
            elif patience > 0:
                self.stuck.add(pid)
        return frozenset(self.fds)


def _reaped(pid: int, fd: int, patience: float) -> bool:
    if patience > 0:
        wait([fd], patience)
    try:
        return os.waitid(os.P_PIDFD, fd, os.WEXITED | os.WNOHANG) is not None
    except ChildProcessError:  # reaped by other code of this process (os.wait())
        return True
    except OSError:  # waitid(P_PIDFD) needs Linux 5.4: the pid is still ours until reaped
        try:
            return os.waitpid(pid, os.WNOHANG)[0] != 0
        except ChildProcessError:
            return True
