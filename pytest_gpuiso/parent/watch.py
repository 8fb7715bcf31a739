"""Watching one running test process: its three bounds, and the escalation past one.

A test's process has three bounds, one after the other (``Watch.run``):

1. ``startup``, from its go until it says its test begins (``frames.BEGIN``):
   the interpreter, plugins, conftests and the test module's import;
2. the test's ``timeout``, until it says its test's protocol ended (``frames.END``):
   setup, call and teardown, as pytest-timeout counts them;
3. ``startup`` again, until the process has exited (or, with ``may_leave``, until
   it says it is exiting, and its supervisor decides to go on: ``leaving``).

Past a bound, in order:

1. ask the child for a stack dump (faulthandler registered on ``STACK_SIGNAL``
   dumps every thread even when the test is stuck in C code);
2. SIGTERM to the child's process group;
3. wait ``grace`` seconds, still draining the pipe;
4. SIGKILL to the group (and to every descendant seen before step 2).
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import psutil

from ..proc.proctree import REAP_WAIT, alive, dump_stack, signal_group
from ..wire import frames

STACK_SIGNAL = int(signal.SIGRTMIN) + 2  # unlikely to collide with a test's own handlers


@dataclass(frozen=True)
class Bounds:
    """One run's bounds, in seconds: the test's ``timeout`` (None: none), the
    ``startup`` bound (before the test begins, and on its exit after it), and the
    ``grace`` between SIGTERM and SIGKILL past one."""

    timeout: float | None
    startup: float
    grace: float

    def limit(self, stage: str) -> float | None:
        """The seconds of the bound of ``stage`` ("startup", "test" or "exit"), from when
        it began; None: none (a test without a timeout)."""
        return self.timeout if stage == "test" else self.startup


class Watch:
    """What was seen of one process: its frames, which bound ran out, when its test began."""

    def __init__(
        self,
        proc: Any,
        reader: frames.Reader,
        sentinel: Any,
        stack_file: Path,
        go_at: float,
        bounds: Bounds,
        *,
        may_leave: bool = False,
        stop_at: float | None = None,
    ) -> None:
        """``go_at``: ``time.monotonic()`` of its go; ``may_leave``: ``run`` returns when
        the process says ``EXITING`` (its caller decides whether to ``leave``);
        ``stop_at``: ``time.monotonic()`` past which it is stopped whatever its bounds say
        (another process of its group ended: ``group``)."""
        self.proc = proc
        self.reader = reader
        self.sentinel = sentinel
        self.stack_file = stack_file
        self.bounds = bounds
        self.may_leave = may_leave
        self.stop_at = stop_at
        self.received = Received()
        # "startup", "test" or "exit": the bound that ran out ("group": ``stop_at``)
        self.expired: str | None = None
        self.began: float | None = None  # time.monotonic() when its test began
        self.cutoff: int | None = None  # frames that had arrived when the bound ran out
        self.stack = ""
        self.left = False  # gone on once it said it was exiting (``leave``)
        self.go_at = go_at
        self._stage, self._since = "startup", go_at

    def run(self) -> bool:
        """Read the frames until the process exits, or stop it past a bound (False); True
        when it says it is exiting (``may_leave``): then ``leave``, or ``run`` again to
        wait for its exit within the same bound."""
        b = self.bounds
        marks = {"startup": frames.BEGIN, "test": frames.END}
        while True:
            seconds = b.limit(self._stage)
            until = marks.get(self._stage, frames.EXITING if self.may_leave else None)
            deadline = None if seconds is None else self._since + seconds
            cut = self.stop_at is not None and (deadline is None or self.stop_at < deadline)
            if cut:
                deadline = self.stop_at
            status = pump(self.reader, self.sentinel, self.received, deadline, until)
            if status == EXITED:
                if self.began is None and frames.BEGIN in self.received.kinds:
                    self.began = self._begin_stamp()  # read with the rest once it had exited
                return False
            if status == EXPIRED:
                break
            if status == frames.EXITING:
                self.may_leave = False  # asked once
                return True
            if status == frames.BEGIN:
                self._stage = "test"
                self._since = self.began = self._begin_stamp()
            else:
                self._stage, self._since = "exit", time.monotonic()
        self.expired, self.cutoff = "group" if cut else self._stage, len(self.received)
        # Before its bootstrap the child has no handler and the signal would kill it.
        if frames.READY in self.received.kinds:
            self.stack = dump_stack(self.proc.pid, STACK_SIGNAL, self.stack_file)
        self.escalate(b.grace)
        if self.stack:  # read once it stopped growing; complete only once the process is gone
            with contextlib.suppress(OSError):
                final = self.stack_file.read_text(errors="replace").strip()
                if len(final) > len(self.stack):
                    self.stack = final
        return False

    def _begin_stamp(self) -> float:
        """When the test began, by the child's clock (``time.monotonic()`` is one clock for
        every process): a reader busy elsewhere (a prewarm) reads BEGIN late, and neither
        the start-up nor the test's time may count that. Taken only between the go and
        now, so that a test cannot give itself more time than its bound."""
        stamp = next(data[1] for kind, data in reversed(self.received) if kind == frames.BEGIN)
        return begin_stamp(stamp, self.go_at, time.monotonic())

    def leave(self) -> None:
        """Go on without waiting for the exit of a process past it (``leaving``)."""
        self.left = True
        self.received.extend(self.reader.drain(_DRAIN))  # what a test sent after it

    def escalate(self, grace: float) -> None:
        """SIGTERM the tree, wait ``grace`` (draining the pipe), then SIGKILL what is left."""
        pid, sentinel = self.proc.pid, self.sentinel
        try:
            tree = psutil.Process(pid).children(recursive=True)
        except psutil.Error:
            tree = []
        signal_group(pid, signal.SIGTERM, tree)
        deadline = time.monotonic() + grace
        if pump(self.reader, sentinel, self.received, deadline) == EXITED:
            rest = max(0.0, deadline - time.monotonic())
            _, running = psutil.wait_procs([p for p in tree if alive(p)], timeout=rest)
            if not running:
                return
        signal_group(pid, signal.SIGKILL, tree)
        wait([sentinel], REAP_WAIT)


def begin_stamp(stamp: float, go_at: float, now: float) -> float:
    """When a test began: its BEGIN's ``stamp`` (the child's ``time.monotonic()``), taken
    only between its go (``go_at``) and ``now``; ``now`` where the stamp is no number."""
    return min(max(stamp, go_at), now) if math.isfinite(stamp) else now


class Received(list):
    """The frames read from one process, in order, and the kinds seen among them."""

    def __init__(self) -> None:
        super().__init__()
        self.kinds: set[str] = set()

    def append(self, frame: tuple[str, Any]) -> None:
        super().append(frame)
        self.kinds.add(frame[0])

    def extend(self, frames: Iterable[tuple[str, Any]]) -> None:
        for frame in frames:
            self.append(frame)


EXITED = "exited"  # pump: the sender exited (all it sent is read)
EXPIRED = "expired"  # pump: the deadline passed
_DRAIN = 2.0  # seconds the frames still in the pipe get to be read once the sender exited


def pump(
    reader: frames.Reader,
    sentinel: Any,
    received: Received,
    deadline: float | None,
    until: str | None = None,
) -> str:
    """Collect frames into ``received`` until the sender exits (``EXITED``), the
    ``deadline`` (``time.monotonic()``) passes (``EXPIRED``) or a frame of kind
    ``until`` arrives (that kind; the frames after it are kept for the next call).

    ``sentinel`` becomes readable when the sending process has exited; the frames
    it sent before are all read then (a descendant that holds the pipe open and keeps
    writing gets ``_DRAIN`` seconds). Once the deadline has passed, what is in the pipe
    already is read once more (a reader that comes late, busy with a prewarm, does not
    take a frame sent in time for one that never came); then it is ``EXPIRED``, however
    much more the sender writes.
    """
    last_look = False
    while True:
        while (frame := reader.next()) is not None:
            received.append(frame)
            if until is not None and frame[0] == until:
                return until
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            if last_look:
                return EXPIRED
            last_look, remaining = True, 0.0
        ready = wait([sentinel] if reader.eof else [reader, sentinel], remaining)
        if reader in ready:
            reader.fill()
        if sentinel in ready:
            received.extend(reader.drain(_DRAIN))
            return EXITED
