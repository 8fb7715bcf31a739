"""Leftover processes: descendants of the test's process that outlived it.

The pytest process is a child subreaper (``PR_SET_CHILD_SUBREAPER``), so a
double-forked daemon or a ``setsid`` child of the test is re-parented to it
instead of init, and ``psutil`` finds it among our descendants. The test's
process is one too until its go: a daemon a plugin starts there before the test's
turn (while the test before it runs) stays in its tree, which that test's sweep
spares. Whatever is new since the snapshot and still running once the test's
process is reaped is reported with its pid and command line, then killed (TERM,
grace, KILL) and reaped; what the leftovers started meanwhile is stopped, listed
until nothing new appears, and killed (see ``sweep``). Descendants that exit on
their own within ``SETTLE`` seconds (a pool worker that notices its parent is
gone) are not reported.

A call (``run_isolated``) runs while its caller goes on: what the caller starts
meanwhile (a helper server, from a thread) and the session's own processes are
not the call's. Its process is started with a ``Mark`` in its environment, which
its descendants inherit (``/proc/PID/environ``: the block a process was exec'd
with, shared by its forks), and in its own process group; the sweep then takes
only the descendants that carry the mark or are in that group, and leaves the
rest alone (not signalled, not reaped).

A leftover of a distributed test's rank is named by its rank where the environment it
was exec'd with says so (``RANK`` beside ``PYTEST_GPUISO_RENDEZVOUS``: a command a rank
ran); one forked without an exec carries its interpreter's start-up environment, which
says nothing of a rank.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import psutil

from ..proc.proctree import REAP_WAIT, STOP_ROUNDS, alive, cmdline, descendant_keys, environ
from ..wire.environment import MARK_ENV, RENDEZVOUS_ENV
from . import Leak, Probe, RunInfo

SETTLE = 1.0  # seconds a new descendant gets to exit by itself before it counts (on a
# loaded machine a pool worker takes a while to notice its parent is gone); the wait ends
# as soon as they are gone, so only a test with leftovers pays it: once for them, once
# for what they start while they are ended
KILL_ROUNDS = 10  # stop-and-kill rounds, for what a kill woke (SIGCONT to an orphaned group)


@dataclass(frozen=True)
class Mark:
    """What sets one call's processes apart: ``MARK_ENV=token`` in their environment,
    or the call's process group (``group``: its process's pid, once known)."""

    token: str
    group: int | None = None

    @property
    def env(self) -> dict[str, str]:
        return {MARK_ENV: self.token}

    def carried_by(self, pid: int) -> bool:
        if self.group is not None:
            with contextlib.suppress(OSError):
                if os.getpgid(pid) == self.group:
                    return True
        # gone, or not ours to read: not known to be the call's
        return f"{MARK_ENV}={self.token}".encode() in environ(pid)


def _marked(keys: set[tuple[int, float]], mark: Mark | None) -> set[tuple[int, float]]:
    return keys if mark is None else {key for key in keys if mark.carried_by(key[0])}


def sweep(
    before: set[tuple[int, float]],
    grace: float,
    spare: frozenset[int] = frozenset(),
    mark: Mark | None = None,
) -> list[dict[str, Any]]:
    """Kill (TERM, grace, KILL) and reap descendants that appeared since ``before``.

    ``spare``: our own processes (the fork server, prewarmed children), whose
    subtrees are not the test's. ``mark``: only processes that carry it are taken
    (a call's; see the module's docstring). Returns the ones that were still running, as
    ``{"pid", "cmdline"}``, with ``"not_killed"`` (why) for one that survived.

    A leftover may start processes while it is being killed (a pool refilling itself,
    a daemon in the middle of its double fork, a process that forks whenever it is
    signalled): they were not in the listing. The descendants are listed again; the
    new ones get ``SETTLE`` once to exit by themselves, then each new listing stops
    them (SIGSTOP, which nothing can ignore, and a stopped process cannot fork) until
    one finds nothing new; they are then all killed without a grace, and it starts
    over (killing a stopped process can wake its group with SIGCONT) until a listing
    after the kills finds nothing new.
    """
    new_keys = _marked(descendant_keys(spare) - before, mark)
    if not new_keys:
        return []
    escaped = _end_leftovers(new_keys, grace)
    seen = before | new_keys
    for round_ in range(KILL_ROUNDS):
        late, found, seen = _stop_late(seen, spare, settle=round_ == 0, mark=mark)
        for p in late:
            with contextlib.suppress(psutil.Error):
                p.kill()
        _, survivors = psutil.wait_procs(late, timeout=REAP_WAIT)  # zombies reaped too
        escaped += _mark_survivors(found, survivors)  # the unsignalled are not in ``late``
        if not late:
            break
    return escaped


def _end_leftovers(new_keys: set[tuple[int, float]], grace: float) -> list[dict[str, Any]]:
    """The processes in ``new_keys`` still running after SETTLE: TERM, grace, KILL."""
    new = []
    for pid, _ in new_keys:
        with contextlib.suppress(psutil.Error):
            new.append(psutil.Process(pid))
    _, running = psutil.wait_procs([p for p in new if alive(p)], timeout=SETTLE)
    escaped = []
    for p in running:
        if not alive(p):
            continue
        escaped.append(_entry(p))
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, stubborn = psutil.wait_procs(new, timeout=grace if escaped else 0)
    for p in stubborn:
        with contextlib.suppress(psutil.Error):
            p.kill()
    _, survivors = psutil.wait_procs(stubborn, timeout=REAP_WAIT)  # reaps zombies too
    return _mark_survivors(escaped, survivors)


def _stop_late(
    seen: set[tuple[int, float]], spare: frozenset[int], *, settle: bool, mark: Mark | None = None
) -> tuple[list[psutil.Process], list[dict[str, Any]], set[tuple[int, float]]]:
    """Stop every descendant not in ``seen``, listing again until none is new.

    ``settle``: the first new ones get SETTLE to exit by themselves first (a helper a
    leftover ran on its way out), like the leftovers themselves. Returns them all
    (exited ones too, to be reaped), the running ones as leaks, and ``seen`` grown.
    """
    late: list[psutil.Process] = []
    found: list[dict[str, Any]] = []
    for _ in range(STOP_ROUNDS):
        keys = _marked(descendant_keys(spare) - seen, mark)
        if not keys:
            break
        seen = seen | keys
        procs = []
        for pid, _ in keys:
            with contextlib.suppress(psutil.Error):
                procs.append(psutil.Process(pid))
        if settle:  # those that exit meanwhile are reaped here (our children) or below
            _, procs = psutil.wait_procs(procs, timeout=SETTLE)
            settle = False
        for p in procs:
            if not alive(p):
                late.append(p)  # a zombie: reaped with the others
                continue
            entry = _entry(p)
            try:
                p.suspend()
            except psutil.NoSuchProcess:
                late.append(p)
                continue
            except psutil.Error:  # not ours to signal: reported, neither killed nor waited for
                entry["not_killed"] = "not allowed to signal it"
                found.append(entry)
                continue
            late.append(p)
            found.append(entry)
    return late, found, seen


def _entry(p: psutil.Process) -> dict[str, Any]:
    """A leftover's entry: its pid, its command line, and its rank where it has one."""
    entry: dict[str, Any] = {"pid": p.pid, "cmdline": cmdline(p)}
    env = dict(e.split(b"=", 1) for e in environ(p.pid) if b"=" in e)
    rank = env.get(b"RANK", b"") if RENDEZVOUS_ENV.encode() in env else b""
    if rank.isdigit():
        entry["rank"] = int(rank)
    return entry


def _mark_survivors(
    entries: list[dict[str, Any]], survivors: list[psutil.Process]
) -> list[dict[str, Any]]:
    """Add ``not_killed`` to the entries of processes still running after SIGKILL."""
    left = {p.pid for p in survivors if alive(p)}
    for entry in entries:
        if entry["pid"] in left:
            entry["not_killed"] = "it survived SIGKILL (another user's process?)"
    return entries


class ProcessProbe(Probe):
    """Reports (and kills) the test's descendants that outlived it."""

    kind = "process"

    def __init__(self, spare: frozenset[int] = frozenset(), mark: Mark | None = None) -> None:
        self.spare = spare  # our processes beside the test's: never its leftovers
        self.mark = mark  # a call's: only what carries it is taken

    def snapshot(self) -> set[tuple[int, float]]:
        return descendant_keys(self.spare)

    def check(self, before: set[tuple[int, float]], run: RunInfo) -> list[Leak]:
        return [
            Leak(
                "process",
                f"process {e['pid']} still running after the test ended "
                f"({'not killed: ' + e['not_killed'] if 'not_killed' in e else 'killed'}): "
                f"{e['cmdline']}",
                {k: e[k] for k in ("pid", "cmdline", "rank") if k in e},
            )
            for e in sweep(before, run.grace, self.spare, self._mark(run))
        ]

    def _mark(self, run: RunInfo) -> Mark | None:
        """The mark, with the call's process group (its own: ``child.bootstrap``)."""
        if self.mark is None:
            return None
        return Mark(self.mark.token, run.pid)
