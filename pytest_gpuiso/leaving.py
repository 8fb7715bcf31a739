"""A test's process that says it is exiting: going on without waiting for its teardown.

A process's exit shows (pidfd, ``waitpid``) only once the kernel has torn its memory
down: ~4 ms for a process forked from a template that imported torch, on every test's
critical path. A test's process ends by closing its descriptors (not stdio, not the
pipe) and saying ``EXITING`` (``child.say_exiting``); the supervisor then goes on at
once (``Watch``'s ``leave``) when all of these hold, and else waits for the exit as before:

* the process ran a test (not a ``run_isolated`` call), was forked from the fork
  server, and no probe of the test needs its end: the GPU memory probe does (the
  driver frees the test's GPU memory as the process ends), and a process with a GPU
  device open does not say ``EXITING`` at all;
* it is past its exit: ``/proc/PID/stat`` has ``PF_EXITING`` and no memory any more
  (the kernel detaches it before tearing it down), and its exit status (field 52)
  is final (``exit_status``), seen within ``PATIENCE``; a test that sends the frame
  itself and goes on running is waited for as before;
* it left no process: nothing new among our descendants but itself. Being past its
  exit, neither it nor its threads can start one any more, so the sweep is complete.

Its probes then run at once: it maps nothing any more and holds no descriptor but its
stdio and the pipe, so /dev/shm's holder check sees it as the ended process it is. The
next test gets its go while the kernel finishes, and the process is reaped later
(``Ending``): before every listing of our descendants, and at the session's end.
"""

from __future__ import annotations

import os
import time

PF_EXITING = 0x4  # <linux/sched.h>: the task is in do_exit()
PATIENCE = 0.05  # seconds from EXITING until the process must be past its exit


def exit_status(pid: int) -> int | None:
    """The exit status of our child ``pid`` once it is past its exit and its memory is
    detached (``waitpid``'s value, as ``Process.exitcode``); None until then, or
    where ``/proc`` does not say (not Linux, a kernel before 3.5)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()
    # fields[0] is field 3 (state): flags is field 9, vsize 23, exit_code 52
    if len(fields) < 50 or not int(fields[6]) & PF_EXITING or int(fields[20]) != 0:
        return None
    return os.waitstatus_to_exitcode(int(fields[49]))


def ended(pid: int, patience: float = PATIENCE) -> int | None:
    """``exit_status`` of ``pid``, waiting up to ``patience`` seconds for it."""
    deadline = time.monotonic() + patience
    while (status := exit_status(pid)) is None and time.monotonic() < deadline:
        time.sleep(0.0002)
    return status


class Ending:
    """Our children past their exit, reaped when they are gone (their pids stay ours
    until then: no other process can have them)."""

    def __init__(self) -> None:
        self.pids: set[int] = set()

    def add(self, pid: int) -> None:
        self.pids.add(pid)

    def reap(self, block: bool = False) -> frozenset[int]:
        """Reap those that are gone (all, waiting: ``block``); returns those left."""
        for pid in list(self.pids):
            try:
                done = os.waitpid(pid, 0 if block else os.WNOHANG)[0] != 0
            except ChildProcessError:  # reaped by someone else (a test's os.wait())
                done = True
            if done:
                self.pids.discard(pid)
        return frozenset(self.pids)
