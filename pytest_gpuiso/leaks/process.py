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
KILL_ROUNDS = 10  # stop-and-kill rounds, for what a kill woke (SIGCONT to an orphaned group)


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
    new_keys = descendant_keys(spare) - before
    if not new_keys:
        return []
    escaped = _terminate(new_keys, grace)
    seen = before | new_keys
    for round_ in range(KILL_ROUNDS):
        late, found, seen = _stop_late(seen, spare, settle=round_ == 0)
        for p in late:
            with contextlib.suppress(psutil.Error):
                p.kill()
        _, survivors = psutil.wait_procs(late, timeout=REAP_WAIT)  # zombies reaped too
        escaped += _mark_survivors(found, survivors)  # the unsignalled are not in ``late``
        if not late:
            break
    return escaped


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
    _, survivors = psutil.wait_procs(stubborn, timeout=REAP_WAIT)  # reaps zombies too
    return _mark_survivors(escaped, survivors)


def _stop_late(
    seen: set[tuple[int, float]], spare: frozenset[int], *, settle: bool
) -> tuple[list[psutil.Process], list[dict[str, Any]], set[tuple[int, float]]]:
    """Stop every descendant not in ``seen``, listing again until none is new.

    ``settle``: the first new ones get SETTLE to exit by themselves first (a helper a
    leftover ran on its way out), like the leftovers themselves. Returns them all
    (exited ones too, to be reaped), the running ones as leaks, and ``seen`` grown.
    """
    late: list[psutil.Process] = []
    found: list[dict[str, Any]] = []
    for _ in range(STOP_ROUNDS):
        keys = descendant_keys(spare) - seen
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
            entry = {"pid": p.pid, "cmdline": _cmdline(p)}
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


def _mark_survivors(
    entries: list[dict[str, Any]], survivors: list[psutil.Process]
) -> list[dict[str, Any]]:
    """Add ``not_killed`` to the entries of processes still running after SIGKILL."""
    left = {p.pid for p in survivors if alive(p)}
    for entry in entries:
        if entry["pid"] in left:
            entry["not_killed"] = "it survived SIGKILL (another user's process?)"
    return entries


def kill_tree(pid: int) -> None:
    """Stop ``pid`` and every descendant (listing until none is new), then kill them all.

    For a process that never ran its test (a prewarmed one that is discarded): what it
    started, daemons included (it is a child subreaper until its go), goes with it.
    The caller reaps ``pid`` itself; the others are reaped here.
    """
    try:
        root = psutil.Process(pid)
        root.suspend()
    except psutil.Error:
        return
    tree: list[psutil.Process] = []
    seen = {pid}
    for _ in range(STOP_ROUNDS):
        try:
            new = [p for p in root.children(recursive=True) if p.pid not in seen]
        except psutil.Error:
            break
        if not new:
            break
        for p in new:
            seen.add(p.pid)
            with contextlib.suppress(psutil.Error):
                p.suspend()
        tree += new
    for p in (root, *tree):
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(tree, timeout=REAP_WAIT)


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
                f"process {e['pid']} still running after the test ended "
                f"({'not killed: ' + e['not_killed'] if 'not_killed' in e else 'killed'}): "
                f"{e['cmdline']}",
                {"pid": e["pid"], "cmdline": e["cmdline"]},
            )
            for e in sweep(before, run.grace, self.spare)
        ]
