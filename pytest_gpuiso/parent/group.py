"""The processes of one test that runs as N (a distributed test's ranks), waited for as one.

``wait_group`` watches every process of the group at once until the first one ends,
reading what each sends meanwhile (no pipe fills while another process is watched; the
frames are given back to each one's watch), then gives the others ``linger`` seconds to
end by themselves. Past it, those still in their test are stopped together, as past a
bound of their own (``watch.stop``: where their threads wait and their stacks, then
SIGTERM, one ``grace``, SIGKILL, each step for all of them at once), and their
``End.expired`` is ``"group"``: ranks stuck in a collective after another failed hold
nothing for long. One whose test already ended (its END read) is only exiting (a
process group's teardown, a plugin's session end): it keeps its own exit bound. Each
process's own bounds (start-up, timeout, exit) hold throughout: when one runs out before
any process ended, those in their test are stopped at once, that one for its bound. The
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
    given_back: bool = False  # what was read went back to its watch (``_give_back``)

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
    the first ends, then ``linger`` seconds more for the rest, then stop those still in
    their test. One whose test ended (its END read) is only exiting: its own exit bound
    holds, not ``linger``. Ctrl-C stops every one (stacks first), reaps and sweeps them,
    and goes on up: the session ends, as in-process."""
    seen = [_Seen(r, r.started.sentinel) for r in runnings]
    try:
        _until(seen, None, first=True)
        if any(s.ended_at is not None for s in seen):  # else one ran past a bound of its own
            _until(seen, time.monotonic() + linger, first=False)
        why = _why(seen, linger)
        _stop([s for s in seen if s.ended_at is None and s.done is None], why)
        exiting = [s for s in seen if s.ended_at is None and s.done is not None]
        if exiting:
            _until(exiting, None, first=False)
            _stop([s for s in exiting if s.ended_at is None], why)  # past their exit bound
    except KeyboardInterrupt:
        live = [s for s in seen if s.ended_at is None and not s.given_back]
        _stop(live, "the session was interrupted (Ctrl-C)", interrupted=True)
        for s in seen:
            _give_back(s)
            s.running.wait()
        raise
    for s in seen:
        _give_back(s)
    return [Ended(s.running.wait(), s.ended_at) for s in seen]


def _give_back(s: _Seen) -> None:
    """What the group's wait read of ``s`` goes back to its own watch (once)."""
    if not s.given_back:
        s.given_back = True
        s.running.started.reader.put_back(s.read)


_BOUNDS = {"startup": "start-up timeout", "test": "timeout", "exit": "exit timeout"}


def _why(seen: list[_Seen], linger: float) -> str:
    """Why the group is stopped now: the first running rank (index) past a bound of its
    own (the wait stopped for it, ``linger`` or not), else the first rank that ended,
    ``linger`` seconds ago."""
    now = time.monotonic()
    for rank, s in enumerate(seen):
        stage, deadline = s.bound()
        if s.ended_at is None and deadline is not None and deadline <= now:
            return f"rank {rank} ran past its {_BOUNDS[stage]}"
    ended = [(s.ended_at, rank) for rank, s in enumerate(seen) if s.ended_at is not None]
    if ended:
        return f"rank {min(ended)[1]} ended and this one still ran {linger:g} s later"
    return "another rank of its group ended"


def _stop(seen: list[_Seen], why: str, *, interrupted: bool = False) -> None:
    """Stop ``seen`` together: each past its own bound, else for its group (``"group"``,
    ``why``)."""
    if not seen:
        return
    now, watches = time.monotonic(), []
    for s in seen:
        _give_back(s)
        watch = s.running.watch()
        stage, deadline = s.bound()
        past = deadline is not None and deadline <= now and not interrupted
        watch.expired, watch.cutoff = stage if past else "group", len(s.read)
        watch.why = "" if past else why
        watches.append(watch)
    grace = max(w.bounds.grace for w in watches)
    stop(watches, min(grace, 1.0) if interrupted else grace)


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
