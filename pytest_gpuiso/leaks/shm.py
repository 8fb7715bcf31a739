"""Leaked /dev/shm entries: POSIX shared memory, ``sem.*`` named semaphores, raw files.

The snapshot is ``(name, inode)`` of every entry, read with one ``scandir`` (the
inode comes with the directory entry, no ``stat``). After the test's process
tree is gone, an entry that is new is a candidate; it is reported unless

* it matches an ignore pattern (``gpu_isolate_shm_ignore``, and our own files);
* it was created before the test started (ctime) — a rename, not a creation;
* a live process still has it open or mapped: under xdist that is another
  worker's test (or a server) using it, not something this test left behind.

The last check reads ``/proc/*/fd`` and ``/proc/*/maps`` and runs only when
there is a candidate, so a clean test pays for one ``scandir`` before and after.
Names like ``torch_<pid>_...`` (PyTorch's shared storages) give the creator's
pid; a pid that is alive and not from the test's tree means it is not ours.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import re
from dataclasses import dataclass

from . import Leak, RunInfo

SHM_DIR = "/dev/shm"
OWN_PATTERNS = ("pytest-gpuiso-*", ".pytest-gpuiso-*")  # the lease table and its temp files
_CREATOR = re.compile(r"^(?:sem\.)?(?:torch|loky|mp|psm)_(\d+)_")
_CTIME_SLACK = 1.0  # seconds: filesystem timestamps are coarser than time.time()


@dataclass(frozen=True)
class Entry:
    name: str
    inode: int


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
        self, ignore: tuple[str, ...] = (), cleanup: bool = False, directory: str = SHM_DIR
    ) -> None:
        self.ignore = tuple(ignore) + OWN_PATTERNS
        self.cleanup = cleanup
        self.directory = directory
        self.uid = os.getuid()

    def snapshot(self) -> dict[str, int]:
        return scan(self.directory)

    def check(self, before: dict[str, int], run: RunInfo) -> list[Leak]:
        after = scan(self.directory)
        new = [
            name
            for name, inode in after.items()
            if before.get(name) != inode
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
        for name in list(stats):
            pid = creator_pid(name)
            if pid is not None and pid not in run.tree_pids and _alive(pid):
                del stats[name]  # a live process outside the test's tree made it
        if not stats:
            return []
        held = held_inodes({(st.st_dev, st.st_ino) for st in stats.values()})
        leaks = []
        for name, st in sorted(stats.items()):
            if (st.st_dev, st.st_ino) in held:
                continue
            path = os.path.join(self.directory, name)
            fields: dict[str, object] = {"path": path, "size": st.st_size}
            pid = creator_pid(name)
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
