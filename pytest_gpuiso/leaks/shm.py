"""Leaked /dev/shm entries: POSIX shared memory, ``sem.*`` named semaphores, raw files.

The snapshot is ``(name, inode)`` of every entry, read with one ``scandir`` (the
inode comes with the directory entry, no ``stat``). After the test's process
tree is gone, an entry that is new is a candidate; it is reported unless

* it matches an ignore pattern (``gpu_isolate_shm_ignore``, and our own files);
* it was created before the test started (ctime) — a rename, not a creation;
* it is not the test's: under xdist, or beside another pytest session, other
  tests create entries in the same window. The test's processes run with
  ``native/gpuiso_shmtrace.c`` preloaded, which logs every entry they create,
  with the creator's pid; an entry the log does not name is not the test's
  (unless its ``torch_<pid>_...`` name names the test's own process). A creator
  the shim cannot see (a static binary, a subprocess started with a scrubbed
  environment) goes unreported. Without the shim (not built), names like
  ``torch_<pid>_...`` give the creator, a pid that is alive and outside the
  test's tree is not ours, and an unnamed entry counts as the test's only when
  no other test of the session runs beside it (no xdist);
* a live process still has it open or mapped (someone is using it).

The holder check reads ``/proc/*/fd`` and ``/proc/*/maps`` and runs only when
there is a candidate, so a clean test pays for one ``scandir`` before and after.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import importlib.machinery
import os
import re
from pathlib import Path

from ..proctree import exists
from . import Leak, RunInfo

SHM_DIR = "/dev/shm"
OWN_PATTERNS = ("pytest-gpuiso-*", ".pytest-gpuiso-*")  # the lease table and its temp files
LOG_ENV = "PYTEST_GPUISO_SHM_LOG"  # read by the shim: where to log created entries
_CREATOR = re.compile(r"^(?:sem\.)?torch_(\d+)_")  # PyTorch: torch_<pid>_<random>_<n>
_CTIME_SLACK = 1.0  # seconds: filesystem timestamps are coarser than time.time()


@functools.cache
def shim_path() -> str | None:
    """The built ``gpuiso_shmtrace`` library, if ``pip install`` built it."""
    here = Path(__file__).resolve().parent.parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = here / f"_shmtrace{suffix}"
        if candidate.is_file():
            return str(candidate)
    return None


def preload_env() -> dict[str, str]:
    """What a process must be started with for the shim to trace it (empty: no shim)."""
    shim = shim_path()
    if shim is None:
        return {}
    return {"LD_PRELOAD": " ".join(p for p in (shim, os.environ.get("LD_PRELOAD", "")) if p)}


def read_log(path: str) -> dict[str, int]:
    """name -> creating pid, from the shim's log."""
    created: dict[str, int] = {}
    with contextlib.suppress(OSError), open(path, "rb") as f:
        for line in f:
            pid, _, name = line.decode("utf-8", "replace").rstrip("\n").partition(" ")
            if pid.isdigit() and name:
                created[name] = int(pid)
    return created


def created_entries(log: str, existed: dict[str, int] | None = None) -> list[str]:
    """The entries the shim logged in ``log`` that are still in /dev/shm, but those in
    ``existed`` (name -> inode, from ``scan()`` before the process started) unchanged."""
    existed = existed or {}
    now = scan()
    return [
        name
        for name in read_log(log)
        if "/" not in name and name in now and existed.get(name) != now[name]
    ]


def remove_created(log: str, existed: dict[str, int] | None = None) -> None:
    """Delete what ``created_entries`` lists: for a process whose test never ran."""
    for name in created_entries(log, existed):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(SHM_DIR, name))


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


class ShmProbe:
    """Reports /dev/shm entries a test created and left behind; deletes them on request."""

    kind = "shm"

    def __init__(
        self,
        ignore: tuple[str, ...] = (),
        cleanup: bool = False,
        directory: str = SHM_DIR,
        log: Path | None = None,
        alone: bool = True,
    ) -> None:
        """``log``: a new private file for the shim's log (None: no tracing); ``alone``:
        no other isolated test of the session runs at the same time (no xdist)."""
        self.ignore = tuple(ignore) + OWN_PATTERNS
        self.cleanup = cleanup
        self.directory = directory
        self.uid = os.getuid()
        self.alone = alone
        preload = preload_env() if log is not None else {}
        self.log = str(log) if preload else None
        # The process gets LD_PRELOAD when it is started (it may be started before
        # this test's turn) and the log's path with its go.
        self.child_env: dict[str, str] = {**preload, LOG_ENV: self.log} if self.log else {}
        self.at_start: dict[str, int] = {}  # entries when the test's process started

    def use_log(self, path: str, at_start: dict[str, int]) -> None:
        """The test's process was started with this log already (it logs from its start,
        before its turn: imports, configure). Entries it names that were not there at
        its start (``at_start``: ``scan()`` then) count even if made before the snapshot."""
        if self.log is not None:
            self.log = path
            self.child_env[LOG_ENV] = path
            self.at_start = at_start

    def snapshot(self) -> dict[str, int]:
        if self.log and not os.path.exists(self.log):
            os.close(os.open(self.log, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        return scan(self.directory)

    def check(self, before: dict[str, int], run: RunInfo) -> list[Leak]:
        created: dict[str, int] | None = None
        if self.log:
            created = read_log(self.log)
            with contextlib.suppress(OSError):
                os.unlink(self.log)
        after = scan(self.directory)
        new = [
            name
            for name, inode in after.items()
            if (
                before.get(name) != inode
                or (created is not None and name in created and self.at_start.get(name) != inode)
            )
            and not any(fnmatch.fnmatchcase(name, pat) for pat in self.ignore)
        ]
        if not new:
            return []
        stats: dict[str, os.stat_result] = {}
        for name in new:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(self.directory, name))
                if st.st_ctime >= run.started - _CTIME_SLACK:
                    stats[name] = st
        creators: dict[str, int] = {}
        for name in list(stats):
            if created is not None and name in created:  # the shim saw the test make it
                creators[name] = created[name]
                continue
            pid = creator_pid(name)
            if created is not None and pid not in run.tree_pids:
                del stats[name]  # traced, not made by this test: another test's or session's
                continue
            if pid is not None and pid not in run.tree_pids and exists(pid):
                del stats[name]  # a live process outside the test's tree made it
            elif pid is None and not self.alone:
                del stats[name]  # nothing says whose it is, and other tests ran beside it
            elif pid is not None:
                creators[name] = pid
        if not stats:
            return []
        held = held_inodes({(st.st_dev, st.st_ino) for st in stats.values()})
        leaks = []
        for name, st in sorted(stats.items()):
            if (st.st_dev, st.st_ino) in held:
                continue
            path = os.path.join(self.directory, name)
            fields: dict[str, object] = {"path": path, "size": st.st_size}
            pid = creators.get(name)
            if pid is not None:
                fields["pid"] = pid
            cleaned = False
            if self.cleanup and st.st_uid == self.uid:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                cleaned = True
            fields["cleaned"] = cleaned
            kind = "semaphore" if name.startswith("sem.") else "segment"
            by = f", created by pid {pid}" if pid is not None else ""
            detail = f"{kind} {path} ({st.st_size} bytes{by}) left in /dev/shm"
            leaks.append(Leak("shm", detail + (" (deleted)" if cleaned else ""), fields))
        return leaks
