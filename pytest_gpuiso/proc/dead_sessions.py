"""What the tests of a pytest session that died left running, ended by the next session.

Every process started for an isolated test or a ``run_isolated`` call (spawned, the
fork server and its forks) carries ``OWNER_ENV=<its starter's work directory's
identity>`` (``workdir.owner``: its full path, its inode and its lock file's, which
no copy of it and no lock file put in its place has) in
the environment it is exec'd with and in ``os.environ``, so whatever
it starts inherits it. When pytest dies (SIGKILL, the OOM killer, CI's time-out), the
test's process dies with it (``PR_SET_PDEATHSIG``), but a daemon the test started in a
session of its own (double fork, ``setsid``) is re-parented to init and runs on; the
work directory stays, its lock free. The next session that takes that lock
(``workdir.clean_stale``) ends the processes of this user that carry that exact name
(TERM, grace, KILL) before it removes the directory, and says so once (``describe``).
A process without the name, or with another session's, is never touched.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Collection, Iterable
from typing import Any

import psutil

from ..wire.environment import OWNER_ENV
from .proctree import alive, cmdline, environ, key

GRACE = 1.0  # seconds a process gets to exit after SIGTERM
KILL_WAIT = 5.0  # for a SIGKILLed process to be gone, reaped by init (some reap slowly)
ROUNDS = 10  # listings, for what an ended process started meanwhile
SHOWN = 3  # processes named in the line that reports them
CMDLINE_CUT = 60  # characters of each command line in that line


def end(names: Collection[str]) -> list[dict[str, Any]]:
    """End this user's processes that carry the owner identity of a work directory in
    ``names`` (``workdir.owner``: ``<path>/<pid>-<random>@<dev>:<inode>:<lock inode>``), whose lock
    the caller holds: their pytest is dead.

    Returns each as ``{"pid", "cmdline", "session"}`` (the dead pytest's pid), with
    ``"not_killed"`` for one still running after SIGKILL. Listed again after each
    kill, until nothing new carries a name (a process started by one being ended).
    """
    spare = {os.getpid()}
    with contextlib.suppress(psutil.Error):
        spare.update(p.pid for p in psutil.Process().parents())
    seen: set[tuple[int, float]] = set()
    ended: list[dict[str, Any]] = []
    for _ in range(ROUNDS):
        found = [(p, name) for p, name in _carrying(names, spare) if key(p) not in seen]
        if not found:
            break
        seen.update(key(p) for p, _ in found)
        entries = [
            {"pid": p.pid, "cmdline": cmdline(p), "session": _session_pid(name)}
            for p, name in found
        ]
        procs = [p for p, _ in found]
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        for p in _wait(procs, GRACE):
            with contextlib.suppress(psutil.Error):
                p.kill()
        _wait(procs, KILL_WAIT, _listed)  # a zombie is ended, but listed until init reaps it
        for p, entry in zip(procs, entries, strict=True):
            if alive(p):
                entry["not_killed"] = "it survived SIGKILL"
        ended += entries
    return ended


def _session_pid(owner: str) -> str:
    """The dead pytest's pid in an owner identity (its directory's name starts with it)."""
    return os.path.basename(owner.rpartition("@")[0] or owner).split("-")[0]


def _carrying(names: Collection[str], spare: set[int]) -> list[tuple[psutil.Process, str]]:
    """Running processes of this user, ``spare`` aside, that carry one of ``names``."""
    uid = os.getuid()
    entries = {f"{OWNER_ENV}={name}".encode(): name for name in names}
    found = []
    for pid in psutil.pids():
        if pid in spare:
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
        except OSError:
            continue
        carried = entries.keys() & environ(pid)
        if not carried:
            continue
        name = entries[carried.pop()]
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            if alive(p):
                found.append((p, name))
    return found


def _listed(p: psutil.Process) -> bool:
    """Still in the process table: running, or a zombie not yet reaped."""
    try:
        return p.is_running()
    except psutil.Error:
        return False


def _wait(
    procs: list[psutil.Process], timeout: float, running: Callable[[psutil.Process], bool] = alive
) -> list[psutil.Process]:
    """Wait up to ``timeout`` for ``procs`` (not our children) to end; those still running."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in procs if running(p)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.02)


def describe(ended: list[dict[str, Any]]) -> str:
    """``end``'s processes in one line, for the session that ended them."""
    n = len(ended)
    shown = []
    for e in ended[:SHOWN]:
        text = " ".join(e["cmdline"].split())  # one line
        text = text if len(text) <= CMDLINE_CUT else text[: CMDLINE_CUT - 3] + "..."
        note = f" (not ended: {e['not_killed']})" if "not_killed" in e else ""
        shown.append(f"pid {e['pid']} {text}{note}")
    more = f"; and {n - SHOWN} more" if n > SHOWN else ""
    return (
        f"ended {n} process{'es' if n != 1 else ''} left running by "
        f"{whose(e['session'] for e in ended)}: " + "; ".join(shown) + more
    )


def whose(sessions: Iterable[str]) -> str:
    """ "a pytest session that died (pid N)", or the same of several: whose leftovers."""
    pids = sorted(set(sessions), key=int)
    if len(pids) == 1:
        return f"a pytest session that died (pid {pids[0]})"
    return f"pytest sessions that died (pids {', '.join(pids)})"
