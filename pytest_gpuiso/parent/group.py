"""The processes of one test that runs as N (a distributed test's ranks), waited for as one.

``wait_group`` watches every process of the group at once until the first one ends,
reading what each sends meanwhile (no pipe fills while another process is watched; the
frames are given back to each one's watch), then gives the others ``linger`` seconds to
end by themselves. Past it, those still running are stopped together, as past a bound
of their own (``watch.stop``: where their threads wait and their stacks, then SIGTERM,
one ``grace``, SIGKILL, each step for all of them at once), and their ``End.expired`` is
``"group"``: ranks stuck in a collective after another failed hold nothing for long.
Each process's own bounds (start-up, timeout, exit) hold throughout: when one runs out
before any process ended, the group is stopped at once, that one for its bound. The
group's processes start together through the worker's door (``Worker.group``) and get
their go one by one (``Worker.go``); this module only waits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

from ..wire import frames
from .outcome import Outcome
from .supervisor import Running
from .watch import begin_stamp, stop


@dataclass(frozen=True)
class Ended:
    """One process of a group, waited for: its outcome, and when it was seen to end
    (``time.monotonic()``; None: it was stopped, or ended only once the others were)."""

    outcome: Outcome
    ended_at: float | None


@dataclass
class _Seen:
    """What the group's wait saw of one process before its own watch takes over."""

    running: Running
    sentinel: Any
    read: list[tuple[str, Any]] = field(default_factory=list)  # given back to its watch
    began: float | None = None  # when its test began (its BEGIN's stamp)
    done: float | None = None  # when its test's protocol ended (its END read)
    ended_at: float | None = None  # when its process was seen to end

    def bound(self) -> tuple[str, float | None]:
        """Its current bound (``watch``'s three) and when it runs out (None: never)."""
        if self.done is not None:
            stage, since = "exit", self.done
        elif self.began is not None:
            stage, since = "test", self.began
        else:
            stage, since = "startup", self.running.go_at
        seconds = self.running.bounds.limit(stage)
        return stage, None if seconds is None else since + seconds

    def deadline(self) -> float | None:
        return self.bound()[1]


def wait_group(runnings: list[Running], linger: float) -> list[Ended]:
    """Wait for every process of ``runnings`` (each given its go), in their order: until
    the first ends, then ``linger`` seconds more for the rest, then stop what still runs."""
    seen = [_Seen(r, r.started.sentinel) for r in runnings]
    _until(seen, None, first=True)
    if any(s.ended_at is not None for s in seen):  # else one ran past a bound of its own
        _until(seen, time.monotonic() + linger, first=False)
    now, stopped = time.monotonic(), []
    for s in seen:
        s.running.started.reader.put_back(s.read)
        if s.ended_at is None:
            watch = s.running.watch()
            stage, deadline = s.bound()
            past = deadline is not None and deadline <= now
            watch.expired, watch.cutoff = stage if past else "group", len(s.read)
            stopped.append(watch)
    if stopped:
        stop(stopped, max(w.bounds.grace for w in stopped))
    return [Ended(s.running.wait(), s.ended_at) for s in seen]


def _until(seen: list[_Seen], stop: float | None, *, first: bool) -> None:
    """Read every process's frames until the first of them (``first``) or all of them
    have ended, ``stop`` (``time.monotonic()``) passes, or a process's own bound runs out."""
    while True:
        live = [s for s in seen if s.ended_at is None]
        ends = [d for d in (s.deadline() for s in live) if d is not None]
        if stop is not None:
            ends.append(stop)
        limit = min(ends, default=None)
        remaining = None if limit is None else limit - time.monotonic()
        if not live or (remaining is not None and remaining <= 0):
            return
        readers = [s.running.started.reader for s in seen]
        ready = wait([*(r for r in readers if not r.eof), *(s.sentinel for s in live)], remaining)
        now = time.monotonic()
        for s in seen:
            reader = s.running.started.reader
            if reader in ready:
                reader.fill()
            while (frame := reader.next()) is not None:
                s.read.append(frame)
                if frame[0] == frames.BEGIN and s.began is None:
                    s.began = begin_stamp(frame[1][1], s.running.go_at, now)
                elif frame[0] == frames.END and s.done is None:
                    s.done = now
        for s in live:
            if s.sentinel in ready:
                s.ended_at = now
        if first and any(s.ended_at is not None for s in live):
            return
