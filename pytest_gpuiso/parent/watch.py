"""Watching one running test process: its three bounds, and the escalation past one.

A test's process has three bounds, one after the other (``Watch.run``):

1. ``startup``, from its go until it says its test begins (``frames.BEGIN``):
   the interpreter, plugins, conftests and the test module's import;
2. the test's ``timeout``, until it says its test's protocol ended (``frames.END``):
   setup, call and teardown, as pytest-timeout counts them;
3. ``startup`` again, until the process has exited (or, with ``may_leave``, until
   it says it is exiting, and its supervisor decides to go on: ``leaving``).

Past a bound, in order (``stop``):

1. note where each of its threads waits in the kernel (``/proc/PID/task/*/wchan``) and
   ask the child for a stack dump (faulthandler registered on ``STACK_SIGNAL`` dumps
   every thread's Python stack, also one stuck in C code);
2. SIGTERM to the child's process group;
3. wait ``grace`` seconds, still draining the pipe;
4. SIGKILL to the group (and to every descendant seen before step 2).

``stop`` takes several processes at once (a distributed test's ranks stopped as a
group, ``group``): each step is taken for all of them before the next, so that N stuck
processes cost one stack wait and one grace, not N.
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

from ..proc.proctree import REAP_WAIT, alive, dump_stacks, kernel_waits, signal_group
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
    ) -> None:
        """``go_at``: ``time.monotonic()`` of its go; ``may_leave``: ``run`` returns when
        the process says ``EXITING`` (its caller decides whether to ``leave``)."""
        self.proc = proc
        self.reader = reader
        self.sentinel = sentinel
        self.stack_file = stack_file
        self.bounds = bounds
        self.may_leave = may_leave
        self.received = Received()
        # "startup", "test" or "exit": the bound that ran out ("group": stopped because
        # another process of its group ended, ``group``)
        self.expired: str | None = None
        self.why = ""  # "group": why its group was stopped (``group``'s words)
        self.began: float | None = None  # time.monotonic() when its test began
        self.cutoff: int | None = None  # frames that had arrived when the bound ran out
        self.stack = ""
        self.left = False  # gone on once it said it was exiting (``leave``)
        self.go_at = go_at
        self._stage, self._since = "startup", go_at

    def run(self) -> bool:
        """Read the frames until the process exits, or stop it past a bound (False); True
        when it says it is exiting (``may_leave``): then ``leave``, or ``run`` again to
        wait for its exit within the same bound. A process already stopped (``stop``, by
        its group) is only read to its end."""
        b = self.bounds
        marks = {"startup": frames.BEGIN, "test": frames.END}
        while self.expired is None:
            seconds = b.limit(self._stage)
            until = marks.get(self._stage, frames.EXITING if self.may_leave else None)
            deadline = None if seconds is None else self._since + seconds
            status = pump(self.reader, self.sentinel, self.received, deadline, until)
            if status == EXITED:
                break
            if status == EXPIRED:
                self.expired, self.cutoff = self._stage, len(self.received)
                stop([self], b.grace)
                break
            if status == frames.EXITING:
                self.may_leave = False  # asked once
                return True
            if status == frames.BEGIN:
                self._stage = "test"
                self._since = self.began = self._begin_stamp()
            else:
                self._stage, self._since = "exit", time.monotonic()
        else:  # stopped with its group: what it sent is in the pipe, or put back in it
            pump(self.reader, self.sentinel, self.received, time.monotonic() + _DRAIN)
        if self.began is None and any(k == frames.BEGIN for k, _ in self.received[: self.cutoff]):
            self.began = self._begin_stamp()  # read with the rest once it had ended
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
        _end([self], grace)


def stop(watches: list[Watch], grace: float) -> None:
    """Stop every process of ``watches`` (each past a bound: its ``expired`` and ``cutoff``
    set), all at once: where its threads wait, its stack (once bootstrapped: before, it
    has no handler and the signal would kill it), then ``_end`` with ``grace`` between
    SIGTERM and SIGKILL; each one's ``stack``."""
    waits = [kernel_waits(w.proc.pid) for w in watches]  # before the signal moves them
    dumped = [w for w in watches if frames.READY in w.received.kinds or _ready(w.reader)]
    stacks = dict(
        zip(
            map(id, dumped),
            dump_stacks([(w.proc.pid, w.stack_file) for w in dumped], STACK_SIGNAL),
            strict=True,
        )
    )
    _end(watches, grace)
    for w, wait_ in zip(watches, waits, strict=True):
        stack = stacks.get(id(w), "")
        if stack:  # read once it stopped growing; complete only once the process is gone
            with contextlib.suppress(OSError):
                final = w.stack_file.read_text(errors="replace").strip()
                stack = final if len(final) > len(stack) else stack
        w.stack = "\n\n".join(part for part in (stack, wait_) if part)


def _ready(reader: frames.Reader) -> bool:
    """Whether frames given back to ``reader`` (by a group's wait) include ``READY``."""
    return any(kind == frames.READY for kind, _ in reader.unread)


def _end(watches: list[Watch], grace: float) -> None:
    """SIGTERM each process's tree, wait ``grace`` for them all (draining their pipes),
    then SIGKILL what is left of any."""
    trees = []
    for w in watches:
        try:
            trees.append(psutil.Process(w.proc.pid).children(recursive=True))
        except psutil.Error:
            trees.append([])
        signal_group(w.proc.pid, signal.SIGTERM, trees[-1])
    deadline = time.monotonic() + grace
    for w, tree in zip(watches, trees, strict=True):
        if pump(w.reader, w.sentinel, w.received, deadline) == EXITED:
            rest = max(0.0, deadline - time.monotonic())
            _, running = psutil.wait_procs([p for p in tree if alive(p)], timeout=rest)
            if not running:
                continue
        signal_group(w.proc.pid, signal.SIGKILL, tree)
    for w in watches:
        wait([w.sentinel], REAP_WAIT)


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
