"""Watching one running test process: its three bounds, and the escalation past one.

A test's process has three bounds, one after the other (``Watch.run``):

1. ``startup``, from its go until it says its test begins (``frames.BEGIN``):
   the interpreter, plugins, conftests and the test module's import;
2. the test's ``timeout``, until it says its test's protocol ended (``frames.END``):
   setup, call and teardown, as pytest-timeout counts them;
3. ``startup`` again, until the process has exited (or, with ``leave``, until it
   says it is exiting and ``leave()`` agrees to go on: ``leaving``).

Past a bound, in order:

1. ask the child for a stack dump (faulthandler registered on ``STACK_SIGNAL``
   dumps every thread even when the test is stuck in C code);
2. SIGTERM to the child's process group;
3. wait ``grace`` seconds, still draining the pipe;
4. SIGKILL to the group (and to every descendant seen before step 2).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import psutil

from . import frames
from .proctree import REAP_WAIT, alive, dump_stack, signal_group

STACK_SIGNAL = int(signal.SIGRTMIN) + 2  # unlikely to collide with a test's own handlers


class Watch:
    """What was seen of one process: its frames, which bound ran out, when its test began."""

    def __init__(self, proc: Any, reader: frames.Reader, sentinel: Any, stack_file: Path) -> None:
        self.proc = proc
        self.reader = reader
        self.sentinel = sentinel
        self.stack_file = stack_file
        self.received: list[tuple[str, Any]] = []
        self.expired: str | None = None  # "startup", "test" or "exit": the bound that ran out
        self.began: float | None = None  # time.monotonic() when its test began
        self.cutoff: int | None = None  # frames that had arrived when the bound ran out
        self.stack = ""
        self.left = False  # gone on once it said it was exiting (``leave``)

    def run(
        self,
        go_at: float,
        timeout: float | None,
        startup: float,
        grace: float,
        leave: Callable[[], bool] | None = None,
    ) -> None:
        """Read the frames until the process exits, or stop it past a bound.

        ``leave``: asked once the process says ``EXITING``; True returns at once."""
        bounds = {"startup": (startup, frames.BEGIN), "test": (timeout, frames.END)}
        stage, since = "startup", go_at
        while True:
            seconds, until = bounds.get(stage, (startup, frames.EXITING if leave else None))
            deadline = None if seconds is None else since + seconds
            status = frames.pump(self.reader, self.sentinel, self.received, deadline, until)
            if status == frames.EXITED:
                if self.began is None and any(k == frames.BEGIN for k, _ in self.received):
                    self.began = time.monotonic()  # read with the rest once it had exited
                return
            if status == frames.EXPIRED:
                break
            if status == frames.EXITING:
                if leave is not None and leave():
                    self.left = True
                    frames.drain(self.reader, self.received)  # what a test sent after it
                    return
                leave = None  # wait for the exit, within the same bound
                continue
            since = time.monotonic()
            if status == frames.BEGIN:
                stage, self.began = "test", since
            else:
                stage = "exit"
        self.expired, self.cutoff = stage, len(self.received)
        # Before its bootstrap the child has no handler and the signal would kill it.
        if any(kind == frames.READY for kind, _ in self.received):
            self.stack = dump_stack(self.proc.pid, STACK_SIGNAL, self.stack_file)
        self.escalate(grace)

    def escalate(self, grace: float) -> None:
        """SIGTERM the tree, wait ``grace`` (draining the pipe), then SIGKILL what is left."""
        pid, sentinel = self.proc.pid, self.sentinel
        try:
            tree = psutil.Process(pid).children(recursive=True)
        except psutil.Error:
            tree = []
        signal_group(pid, signal.SIGTERM, tree)
        deadline = time.monotonic() + grace
        if frames.pump(self.reader, sentinel, self.received, deadline) == frames.EXITED:
            rest = max(0.0, deadline - time.monotonic())
            _, running = psutil.wait_procs([p for p in tree if alive(p)], timeout=rest)
            if not running:
                return
        signal_group(pid, signal.SIGKILL, tree)
        wait([sentinel], REAP_WAIT)
