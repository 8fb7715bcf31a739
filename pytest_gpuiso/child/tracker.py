"""multiprocessing's resource tracker, as a test's process leaves it: its segments, handed over.

Runs in the test's process. The resource tracker is one process of the session, started
by pytest's own (``proc.proctree.ensure_resource_tracker``), with pytest's stderr; pytest
and every test's process hold the write end of its pipe (inherited through spawn, or
through the fork server's fork), so it reads end-of-file only when pytest itself exits.
Only then does it warn of the shared memory segments still registered ("There appear to
be 1 leaked shared_memory objects") and delete them: the warning lands on pytest's
terminal after its last line (an xdist worker's, into the progress line), far from the
test that left the segment.

From the test's go (``watch``), the segments this process registers and unregisters are
noted. At its exit (``hand_over``), after the test's own exit handlers, each one still
registered that the /dev/shm shim's log says the test's processes created (that very
inode) is handed to the leak check, which reads that log (``CHECKED_ENV``): a line in
the log says so, then the tracker forgets it. The check reports the segment as the
test's leak, and deletes it, as the tracker would have. Without a check that reads the
log (``shm=off``, the shim not built, a ``run_isolated`` call), or for a segment the test
only attached to, nothing changes: the tracker keeps it, warns and deletes it at its end.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from typing import Any

from ..leaks import shm_log
from ..wire.environment import CHECKED_ENV, LOG_ENV

SHARED_MEMORY = "shared_memory"  # the tracker's name for a segment's kind


class _Noted:
    """The segments registered since the go and not unregistered since (names as the
    tracker has them: with a leading ``/``), and the tracker's own ``_send``."""

    names: dict[str, None] = {}
    send: Callable[[str, str, str], None] | None = None


def _tracker() -> Any:
    """The process's resource tracker client (None: multiprocessing not imported, or a
    Python whose tracker is not as this module knows it)."""
    module = sys.modules.get("multiprocessing.resource_tracker")
    tracker = getattr(module, "_resource_tracker", None)
    return tracker if callable(getattr(tracker, "_send", None)) else None


def watch() -> None:
    """At the test's go: note from now on what this process registers with the tracker
    (what the imports, plugins, conftests or the template registered before stays theirs)."""
    _Noted.names.clear()
    tracker = _tracker()
    if tracker is None or _Noted.send is not None:
        return
    send = tracker._send

    def noting(cmd: str, name: str, rtype: str) -> None:
        send(cmd, name, rtype)  # as ever first: its error is the caller's
        if rtype == SHARED_MEMORY:
            if cmd == "REGISTER":
                _Noted.names[name] = None
            elif cmd == "UNREGISTER":
                _Noted.names.pop(name, None)

    _Noted.send = send
    tracker._send = noting  # register() and unregister() send through it


def hand_over() -> None:
    """At the process's end, after its exit handlers: hand the segments it created and left
    registered to the leak check that reads its log, and unregister them (so the tracker
    neither warns nor deletes them); the others stay the tracker's."""
    names, send = list(_Noted.names), _Noted.send
    _Noted.names.clear()
    log = os.environ.get(LOG_ENV)
    if not names or send is None or not log or os.environ.get(CHECKED_ENV) != log:
        return
    created = shm_log.read_log(log)
    for name in names:
        entry = name.lstrip("/")  # shm_open's name; the entry in /dev/shm has no slash
        logged = created.get(entry)
        if logged is None:
            continue  # attached to, not created by the test: the tracker's to delete
        try:
            inode = os.lstat(os.path.join(shm_log.SHM_DIR, entry)).st_ino
        except OSError:
            continue  # gone already, or unreadable: the tracker's
        if inode == logged.inode and shm_log.hand_over(log, entry, inode):
            with contextlib.suppress(Exception):
                send("UNREGISTER", name, SHARED_MEMORY)
