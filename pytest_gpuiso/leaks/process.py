"""Leftover processes: descendants of the test's process that outlived it.

The pytest process is a child subreaper (``PR_SET_CHILD_SUBREAPER``), so a
double-forked daemon or a ``setsid`` child of the test is re-parented to it
instead of init, and ``psutil`` finds it among our descendants. The test's
process is one too: while it lives, its orphans stay in its tree (a prewarmed
process's are spared by the sweep of the test before it). Whatever is new
since the snapshot and still running once the test's process is reaped is
reported with its pid and command line, then killed (TERM, grace, KILL) and
reaped; what the leftovers started meanwhile is stopped, listed until nothing new
appears, and killed. Descendants that exit on their own within ``SETTLE`` seconds (a pool
worker that notices its parent is gone) are not reported.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import psutil

from . import Leak, RunInfo

SETTLE = 0.1  # seconds a new descendant gets to exit by itself before it counts
REAP_WAIT = 10.0  # upper bound for the kernel to reap a SIGKILLed process
STOP_ROUNDS = 1000  # listings of what leftovers started while killed (each one stopped)


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2 :].split()[19])


def _children(pid: int) -> list[int] | None:
    """Direct children from /proc/PID/task/*/children; None where the kernel lacks it."""
    kids: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                kids += map(int, f.read().split())
        except FileNotFoundError:
            return None  # no CONFIG_PROC_CHILDREN (or the task just ended: the caller retries)
        except OSError:
            continue
    return kids


def descendant_keys(spare: frozenset[int] = frozenset()) -> set[tuple[int, float]]:
    """(pid, start time) of every descendant of this process, except ``spare`` subtrees.

    Walks ``/proc/PID/task/*/children`` from this process down, so the cost grows
    with our descendants, not with every process on the machine (a busy CI host
    has thousands); psutil's full scan is the fallback.
    """
    keys: set[tuple[int, float]] = set()
    todo = [os.getpid()]
    while todo:
        kids = _children(todo.pop())
        if kids is None:
            return _descendant_keys_psutil(spare)
        for kid in kids:
            start = _start_time(kid)
            if start is not None and kid not in spare:
                keys.add((kid, float(start)))
                todo.append(kid)
    return keys


def _descendant_keys_psutil(spare: frozenset[int]) -> set[tuple[int, float]]:
    skip = set(spare)
    for pid in spare:
        with contextlib.suppress(psutil.Error):
            skip.update(p.pid for p in psutil.Process(pid).children(recursive=True))
    return {_key(p) for p in psutil.Process().children(recursive=True) if p.pid not in skip}


def _key(p: psutil.Process) -> tuple[int, float]:
    start = _start_time(p.pid)
    return (p.pid, float(start) if start is not None else 0.0)


def sweep(
    before: set[tuple[int, float]], grace: float, spare: frozenset[int] = frozenset()
) -> list[dict[str, Any]]:
    """Kill (TERM, grace, KILL) and reap descendants that appeared since ``before``.

    ``spare``: our own processes (the fork server, prewarmed children), whose
    subtrees are not the test's. Returns the ones that were still running, as
    ``{"pid", "cmdline"}``.

    A leftover may start processes while it is being killed (a pool refilling itself,
    a daemon in the middle of its double fork, a process that forks whenever it is
    signalled): they were not in the listing. Those are stopped as soon as a new
    listing finds them (SIGSTOP, which nothing can ignore, and a stopped process
    cannot fork), the descendants listed again until nothing new appears, and then
    all killed at once, without a grace: they are what the leftovers left.
    """
    new_keys = descendant_keys(spare) - before
    if not new_keys:
        return []
    escaped = _terminate(new_keys, grace)
    late, stopped = _stop_late(before | new_keys, spare)
    for p in late:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(late, timeout=REAP_WAIT)  # killed, or zombies: reaped
    return escaped + stopped


def _terminate(new_keys: set[tuple[int, float]], grace: float) -> list[dict[str, Any]]:
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
        escaped.append({"pid": p.pid, "cmdline": _cmdline(p)})
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, stubborn = psutil.wait_procs(new, timeout=grace if escaped else 0)
    for p in stubborn:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(stubborn, timeout=REAP_WAIT)  # also reaps zombies re-parented to us
    return escaped


def _stop_late(
    seen: set[tuple[int, float]], spare: frozenset[int]
) -> tuple[list[psutil.Process], list[dict[str, Any]]]:
    """Stop every descendant not in ``seen``, listing again until none is new.

    Returns them all (zombies too, to be reaped) and the running ones as leaks."""
    late: list[psutil.Process] = []
    stopped: list[dict[str, Any]] = []
    for _ in range(STOP_ROUNDS):
        keys = descendant_keys(spare) - seen
        if not keys:
            break
        seen = seen | keys
        for pid, _ in keys:
            try:
                p = psutil.Process(pid)
                p.suspend()
            except psutil.Error:
                continue
            late.append(p)
            if alive(p):
                stopped.append({"pid": p.pid, "cmdline": _cmdline(p)})
    return late, stopped


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline()) or p.name()
    except psutil.Error:
        return "?"


class ProcessProbe:
    """Reports (and kills) the test's descendants that outlived it."""

    kind = "process"

    def __init__(self, spare: frozenset[int] = frozenset()) -> None:
        self.spare = spare  # our processes beside the test's: never its leftovers

    def snapshot(self) -> set[tuple[int, float]]:
        return descendant_keys(self.spare)

    def check(self, before: set[tuple[int, float]], run: RunInfo) -> list[Leak]:
        return [
            Leak(
                "process",
                f"process {e['pid']} still running after the test ended (killed): {e['cmdline']}",
                {"pid": e["pid"], "cmdline": e["cmdline"]},
            )
            for e in sweep(before, run.grace, self.spare)
        ]
