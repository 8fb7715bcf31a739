"""Leaked /dev/shm entries: POSIX shared memory, ``sem.*`` named semaphores, raw files.

The snapshot is ``(name, inode)`` of every entry, read with one ``scandir`` (the
inode comes with the directory entry, no ``stat``). After the test's process
tree is gone, an entry that is new is a candidate; it is reported unless

* it matches an ignore pattern (``gpu_isolate_shm_ignore``, and our own files);
* it was created before the test started (ctime) — a rename, not a creation;
* it belongs to another user: another uid's entry is never the test's, whatever
  its name says (anyone may name a file ``torch_<your pid>_...``);
* it is not the test's: under xdist, or beside another pytest session, other
  tests create entries in the same window. The test's processes run with
  ``native/gpuiso_shmtrace.c`` preloaded, which logs every entry they CREATE
  (not those they only open with O_CREAT: the shim tries O_EXCL first), with
  the creator's pid and the entry's inode, subdirectories of /dev/shm included;
  an entry the log does not name is not the test's (unless its
  ``torch_<pid>_...`` name names the test's own process). A creator the shim
  cannot see (a static binary, a raw syscall, a call bound to libc's own handle
  such as ``ctypes.CDLL("libc.so.6").open``, a subprocess started with a
  scrubbed environment) goes unreported. Without the shim (not built), names
  like ``torch_<pid>_...`` give the creator, a pid that is alive and outside the
  test's tree is not ours, and an unnamed entry counts as the test's only when
  no other test of the session runs beside it (no xdist);
* a live process still has it open or mapped (someone is using it).

What is deleted, and only with ``--gpu-isolate-cleanup``: an entry the shim's
log says the test's processes created, while its name still holds the logged
inode and it is ours (``lstat``, no symlink followed on the way), and a
``torch_<pid>_...`` entry of ours whose pid is one of the test's processes. An
entry attributed by anything weaker is reported, never deleted. The same rule
holds for a prewarmed process that is discarded and for the fork server's
template when it gives up (``remove_created``): without the option, what they
created is left in place. One exception, whatever the options: a segment the
test's process created and left registered with multiprocessing's resource
tracker, which would delete it at its own exit (after pytest's, with a warning
on pytest's terminal). The test's process hands it over in the log instead
(``child.tracker``; only with ``CHECKED_ENV``, when this check reads that log), and
it is deleted once checked (``_handed_over``: still the logged inode, ours, made
since the process started, never one of our own files), reported or not.

What the tests of a pytest session that died created (its shim's logs, read by the next
session before it removes the dead session's work directory) is judged by the same rules
(``DeadSessionShm``): deleted with ``--gpu-isolate-cleanup``, else named, said once.

The holder check reads ``/proc/*/fd`` and ``/proc/*/maps`` and runs only when
there is a candidate, so a clean test pays for one ``scandir`` before and after.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ..proc.dead_sessions import whose
from ..proc.proctree import exists
from ..proc.workdir import LOCK
from ..values import size_text
from ..wire.environment import CHECKED_ENV, LOG_ENV
from . import Leak, Probe, RunInfo, StartedProcess
from .shm_log import SHM_DIR, Logged, deepest_first, preload_env, read_log, remove_entry

OWN_PATTERNS = ("pytest-gpuiso-*", ".pytest-gpuiso-*")  # the lease table and its temp files
_CREATOR = re.compile(r"^(?:sem\.)?torch_(\d+)_")  # PyTorch: torch_<pid>_<random>_<n>
_CTIME_SLACK = 1.0  # seconds: filesystem timestamps are coarser than time.time()
_DEAD_LOGS = re.compile(r"^shm-[A-Za-z0-9_.-]+\.log$")  # the launcher's names for the shim's logs
SHOWN = 3  # entries named in the line about a dead session's


def scan(directory: str = SHM_DIR) -> dict[str, int]:
    """name -> inode of every entry of ``directory`` (empty if it does not exist)."""
    try:
        with os.scandir(directory) as it:
            return {e.name: e.inode() for e in it}
    except OSError:
        return {}


def creator_pid(name: str) -> int | None:
    m = _CREATOR.match(name)
    return int(m.group(1)) if m else None


def held_inodes(candidates: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """Which of the ``(device, inode)`` pairs a live process has open or mapped."""
    held: set[tuple[int, int]] = set()
    # /proc/PID/maps names a file by "major:minor inode" (device in hex)
    by_map = {
        f"{os.major(dev):02x}:{os.minor(dev):02x} {ino}".encode(): (dev, ino)
        for dev, ino in candidates
    }
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        base = f"/proc/{pid}"
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"{base}/fd"):
                with contextlib.suppress(OSError):
                    st = os.stat(f"{base}/fd/{fd}")
                    if (st.st_dev, st.st_ino) in candidates:
                        held.add((st.st_dev, st.st_ino))
        with contextlib.suppress(OSError), open(f"{base}/maps", "rb") as f:
            for line in f:
                # address perms offset dev inode path
                parts = line.split(None, 5)
                if len(parts) >= 5:
                    found = by_map.get(parts[3] + b" " + parts[4])
                    if found is not None:
                        held.add(found)
        if held == candidates:
            break
    return held


@dataclass
class _Whose:
    """Who made the entries a test left: by the shim's log (``traced``, this very inode),
    by a ``torch_<pid>_`` name of one of its processes (``named``), or a name alone."""

    creators: dict[str, int] = field(default_factory=dict)  # entry -> its creator's pid
    traced: set[str] = field(default_factory=set)
    named: set[str] = field(default_factory=set)


class ShmProbe(Probe):
    """Reports /dev/shm entries a test created and left behind; deletes them on request."""

    kind = "shm"

    def __init__(
        self,
        ignore: tuple[str, ...] = (),
        cleanup: bool = False,
        directory: str = SHM_DIR,
        alone: bool = True,
    ) -> None:
        """``alone``: no other isolated test of the session runs at the same time (no xdist)."""
        self.ignore = tuple(ignore) + OWN_PATTERNS
        self.cleanup = cleanup
        self.directory = directory
        self.uid = os.getuid()
        self.alone = alone
        self.log: str | None = None  # the shim's log of the test's process (None: no shim)

    def before_start(self, started: StartedProcess) -> None:
        """The test's process was started with its log (it logs from its start, before
        its turn: imports, configure). What it names counts even if made before the
        snapshot: each line carries the inode the entry got."""
        self.log = started.shm_log

    def child_env(self) -> dict[str, str]:
        # It got LD_PRELOAD when it was started (maybe before its turn); with its go,
        # what its own processes inherit says the same, and that this check reads it.
        return {**preload_env(), LOG_ENV: self.log, CHECKED_ENV: self.log} if self.log else {}

    def snapshot(self) -> dict[str, int]:
        return scan(self.directory)

    def _ignored(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pat) for pat in self.ignore)

    def _handed_over(
        self, logged: dict[str, Logged] | None, run: RunInfo
    ) -> dict[str, os.stat_result]:
        """The entries the test's process handed over (``child.tracker``: a segment it left
        to multiprocessing's resource tracker, which would have deleted it at exit), that
        are still what the log says it created, ours and made since its start, and not one
        of our own files: deleted once looked at, reported or not."""
        found: dict[str, os.stat_result] = {}
        for name, entry in (logged or {}).items():
            if not entry.tracked or any(fnmatch.fnmatchcase(name, p) for p in OWN_PATTERNS):
                continue
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(self.directory, name))
                if (
                    st.st_ino == entry.inode
                    and st.st_uid == self.uid
                    and st.st_ctime >= run.started - _CTIME_SLACK
                ):
                    found[name] = st
        return found

    def check(self, before: dict[str, int], run: RunInfo) -> list[Leak]:
        """What the test left: the entries new since ``before`` (or the shim saw it create),
        the test's by the shim's log or their names, that no live process holds."""
        logged: dict[str, Logged] | None = None
        if self.log:
            logged = read_log(self.log)
            with contextlib.suppress(OSError):
                os.unlink(self.log)
        stats = self._new_entries(before, logged, run)
        whose = self._whose(stats, logged, run)
        handed = self._handed_over(logged, run)
        held = held_inodes({(st.st_dev, st.st_ino) for st in stats.values()}) if stats else set()
        leaks: dict[str, Leak] = {}
        for name in deepest_first(list(stats)):  # a directory after what it holds
            st = stats[name]
            if (st.st_dev, st.st_ino) not in held:
                leaks[name] = self._leak(name, st, whose, handed)
        # What was handed over and is no leak of the test (ignored, in use) goes too
        for name in deepest_first([name for name in handed if name not in leaks]):
            remove_entry(self.directory, name, handed[name].st_ino, self.uid)
        return [leaks[name] for name in sorted(leaks)]

    def _new_entries(
        self, before: dict[str, int], logged: dict[str, Logged] | None, run: RunInfo
    ) -> dict[str, os.stat_result]:
        """The entries new since ``before`` or logged by the shim (in subdirectories too,
        and before the snapshot), not ignored, this user's, changed since the test began."""
        after = scan(self.directory)
        new = {name for name, inode in after.items() if before.get(name) != inode}
        if logged:
            new.update(logged)
        stats: dict[str, os.stat_result] = {}
        for name in sorted(new):
            if self._ignored(name):
                continue
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(self.directory, name))
                # Another user's entry is never the test's, whatever its name says.
                if st.st_uid == self.uid and st.st_ctime >= run.started - _CTIME_SLACK:
                    stats[name] = st
        return stats

    def _whose(
        self, stats: dict[str, os.stat_result], logged: dict[str, Logged] | None, run: RunInfo
    ) -> _Whose:
        """Who made each entry of ``stats``; those that are not the test's leave ``stats``."""
        whose = _Whose()
        for name, st in list(stats.items()):
            entry = logged.get(name) if logged is not None else None
            if entry is not None and entry.inode == st.st_ino:
                whose.creators[name] = entry.pid
                whose.traced.add(name)
                continue
            pid = creator_pid(name)
            if pid is not None and pid in run.tree_pids:
                whose.creators[name] = pid
                whose.named.add(name)
            elif logged is not None:
                del stats[name]  # traced, not made by this test: another test's or session's
            elif pid is not None and exists(pid):
                del stats[name]  # a live process outside the test's tree made it
            elif pid is None and not self.alone:
                del stats[name]  # nothing says whose it is, and other tests ran beside it
            elif pid is not None:
                whose.creators[name] = pid
        return whose

    def _leak(
        self, name: str, st: os.stat_result, whose: _Whose, handed: dict[str, os.stat_result]
    ) -> Leak:
        """The leak of entry ``name``, deleted first where that is asked for and safe."""
        path = os.path.join(self.directory, name)
        fields: dict[str, object] = {"path": path, "size": st.st_size}
        pid = whose.creators.get(name)
        if pid is not None:
            fields["pid"] = pid
        # Only what the test is known to have made: never an entry it only opened.
        made = name in whose.traced or name in whose.named
        cleaned = (name in handed or (self.cleanup and made)) and remove_entry(
            self.directory, name, st.st_ino, self.uid
        )
        fields["cleaned"] = cleaned
        if name in handed:
            fields["tracked"] = True
        if stat.S_ISDIR(st.st_mode):
            kind = "directory"
        else:
            kind = "semaphore" if os.path.basename(name).startswith("sem.") else "segment"
        if name in whose.traced:
            by = f", created by pid {pid}"
        elif pid is not None:
            by = f", named for pid {pid}"  # its name says so; the shim did not see it
        else:
            by = ""
        detail = f"{kind} {path} ({size_text(st.st_size)}{by}) left in /dev/shm"
        if cleaned:
            why = ", as Python's resource tracker would" if name in handed else ""
            detail += f" (deleted{why})"
        return Leak("shm", detail, fields)


class DeadSessionShm:
    """The /dev/shm entries the tests of pytest sessions that died created (by the shim's
    logs in their work directories, handed over by ``workdir.clean_stale``'s ``on_dead``
    before it removes them), judged by the after-test rules: still the logged inode, ours,
    changed since the dead session made its directory (its lock file's ctime), not
    ignored, not open or mapped by a live process. Deleted with ``cleanup``, else named;
    either way said once (``dispose``)."""

    def __init__(self, ignore: tuple[str, ...] = (), cleanup: bool = False) -> None:
        self.probe = ShmProbe(ignore, cleanup)
        self.found: dict[str, tuple[os.stat_result, str]] = {}  # name -> (stat, session)

    def take(self, workdir: Path, session: str) -> None:
        """``on_dead``: the entries the logs in ``workdir`` name, of the session ``session``."""
        probe = self.probe
        try:
            since = os.lstat(workdir / LOCK).st_ctime - _CTIME_SLACK
            logs = sorted(e.name for e in os.scandir(workdir) if _DEAD_LOGS.match(e.name))
        except OSError:
            return
        for log in logs:
            for name, entry in read_log(str(workdir / log)).items():
                if name in self.found or probe._ignored(name):
                    continue
                with contextlib.suppress(OSError):
                    st = os.lstat(os.path.join(probe.directory, name))
                    if st.st_ino == entry.inode and st.st_uid == probe.uid and st.st_ctime >= since:
                        self.found[name] = (st, session)

    def dispose(self) -> str:
        """Delete what was found (with ``cleanup``), else leave it; what was, in one line
        ("" for nothing)."""
        probe = self.probe
        stats = {name: st for name, (st, _) in self.found.items()}
        held = held_inodes({(st.st_dev, st.st_ino) for st in stats.values()}) if stats else set()
        names = [
            n for n in deepest_first(list(stats)) if (stats[n].st_dev, stats[n].st_ino) not in held
        ]
        if probe.cleanup:
            names = [
                n for n in names if remove_entry(probe.directory, n, stats[n].st_ino, probe.uid)
            ]
        if not names:
            return ""
        n = len(names)
        size = size_text(sum(stats[m].st_size for m in names))
        what = f"{n} /dev/shm entr{'ies' if n != 1 else 'y'} ({size})"
        by = f"created by the tests of {whose(self.found[m][1] for m in names)}"
        shown = ", ".join(_printable(f"{probe.directory}/{m}") for m in sorted(names)[:SHOWN])
        more = f" and {n - SHOWN} more" if n > SHOWN else ""
        if probe.cleanup:
            return f"deleted {what} {by}: {shown}{more}"
        return f"left {what} {by} in place: {shown}{more} (--gpu-isolate-cleanup deletes them)"


def _printable(path: str) -> str:
    """``path`` as it is, or quoted and escaped where it has a control character or bytes
    that are not UTF-8: the line stays one printable line."""
    return path if path.isprintable() else ascii(path)
