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
created is left in place.

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
import stat
from pathlib import Path
from typing import NamedTuple

from ..proctree import exists
from . import Leak, RunInfo

SHM_DIR = "/dev/shm"
OWN_PATTERNS = ("pytest-gpuiso-*", ".pytest-gpuiso-*")  # the lease table and its temp files
LOG_ENV = "PYTEST_GPUISO_SHM_LOG"  # read by the shim: where to log created entries
_CREATOR = re.compile(r"^(?:sem\.)?torch_(\d+)_")  # PyTorch: torch_<pid>_<random>_<n>
_ESCAPED = re.compile(rb"%([0-9A-Fa-f]{2})")  # the shim's escape of bytes <= 0x20, % and 0x7f
_CTIME_SLACK = 1.0  # seconds: filesystem timestamps are coarser than time.time()
_ASAN_ORDER = "verify_asan_link_order"


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
    """What a process must be started with for the shim to trace it (empty: no shim).

    The user's own LD_PRELOAD entries come first: AddressSanitizer's runtime must be
    the first library of a process (a preloaded libasan stays so). A program linked
    with ASan and run by a test finds the shim ahead of its runtime and would abort
    ("ASan runtime does not come first"), so ``verify_asan_link_order=0`` joins
    ASAN_OPTIONS, unless the user set that key themselves.
    """
    shim = shim_path()
    if shim is None:
        return {}
    user = os.environ.get("LD_PRELOAD", "")
    env = {"LD_PRELOAD": " ".join(p for p in (user, shim) if p)}
    asan = os.environ.get("ASAN_OPTIONS", "")
    keys = {part.split("=", 1)[0].strip() for part in re.split(r"[:\s,]+", asan)}
    if _ASAN_ORDER not in keys:
        env["ASAN_OPTIONS"] = ":".join(p for p in (asan, f"{_ASAN_ORDER}=0") if p)
    return env


class Logged(NamedTuple):
    """One creation the shim logged: who made the entry, and which inode it got."""

    pid: int
    inode: int


def read_log(path: str) -> dict[str, Logged]:
    """name (relative to /dev/shm, "dir/name" in a subdirectory) -> its creation, from the
    shim's log; the last creation of a name wins."""
    created: dict[str, Logged] = {}
    with contextlib.suppress(OSError), open(path, "rb") as f:
        for line in f:
            parts = line.rstrip(b"\n").split(b" ", 2)
            if len(parts) != 3:
                continue
            pid, inode, name = parts
            if pid.isdigit() and inode.isdigit() and name:
                text = os.fsdecode(_ESCAPED.sub(lambda m: bytes([int(m[1], 16)]), name))
                created[text] = Logged(int(pid), int(inode))
    return created


def _walk(directory: str, name: str) -> tuple[int, str]:
    """A descriptor of the directory that holds ``name`` (under ``directory``) and its last
    component, reached without following a symlink; the caller closes it."""
    *dirs, last = name.split("/")
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in dirs:
            flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            inner = os.open(part, flags, dir_fd=fd)
            os.close(fd)
            fd = inner
    except OSError:
        os.close(fd)
        raise
    return fd, last


def _same_entry(directory: str, name: str, inode: int, uid: int, remove: bool = False) -> bool:
    """Whether ``name`` still holds ``inode`` and is ours (no symlink followed on the way);
    ``remove``: then delete it too (a directory only when empty), and say whether it went."""
    try:
        fd, last = _walk(directory, name)
    except OSError:
        return False
    try:
        st = os.stat(last, dir_fd=fd, follow_symlinks=False)
        if st.st_ino != inode or st.st_uid != uid or st.st_dev != os.fstat(fd).st_dev:
            return False
        if remove and stat.S_ISDIR(st.st_mode):
            os.rmdir(last, dir_fd=fd)
        elif remove:
            os.unlink(last, dir_fd=fd)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _still_created(directory: str, name: str, logged: Logged, uid: int) -> bool:
    return _same_entry(directory, name, logged.inode, uid)


def _remove(directory: str, name: str, inode: int, uid: int) -> bool:
    return _same_entry(directory, name, inode, uid, remove=True)


def _deepest_first(names: list[str]) -> list[str]:
    """A directory's entries before the directory."""
    return sorted(names, key=lambda name: (-name.count("/"), name))


def created_entries(log: str, directory: str = SHM_DIR) -> list[str]:
    """The entries the shim logged in ``log`` as created that are still there, as the
    same inode, and ours (deepest first)."""
    uid = os.getuid()
    logged = read_log(log)
    return _deepest_first(
        [name for name, entry in logged.items() if _still_created(directory, name, entry, uid)]
    )


def remove_created(log: str, directory: str = SHM_DIR) -> list[str]:
    """Delete what ``created_entries`` lists (for a process whose test never ran, under
    ``--gpu-isolate-cleanup``); the names deleted."""
    uid = os.getuid()
    logged = read_log(log)
    return [
        name
        for name in _deepest_first(list(logged))
        if _remove(directory, name, logged[name].inode, uid)
    ]


def dispose_created(log: str, cleanup: bool) -> str:
    """What a process whose test never ran created (its log): deleted with ``cleanup``
    (``remove_created``), else left; then "created /dev/shm/X ...; left in place" for a
    notice, else ""."""
    if cleanup:
        remove_created(log)
        return ""
    left = created_entries(log)
    if not left:
        return ""
    more = f" and {len(left) - 1} more" if left[1:] else ""
    return f"created /dev/shm/{left[0]}{more}; left in place (--gpu-isolate-cleanup deletes it)"


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

    def use_log(self, path: str) -> None:
        """The test's process was started with this log already (it logs from its start,
        before its turn: imports, configure). What it names counts even if made before
        the snapshot: each line carries the inode the entry got."""
        if self.log is not None:
            self.log = path
            self.child_env[LOG_ENV] = path

    def snapshot(self) -> dict[str, int]:
        if self.log and not os.path.exists(self.log):
            os.close(os.open(self.log, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        return scan(self.directory)

    def _ignored(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pat) for pat in self.ignore)

    def check(self, before: dict[str, int], run: RunInfo) -> list[Leak]:
        logged: dict[str, Logged] | None = None
        if self.log:
            logged = read_log(self.log)
            with contextlib.suppress(OSError):
                os.unlink(self.log)
        after = scan(self.directory)
        new = {name for name, inode in after.items() if before.get(name) != inode}
        if logged:  # what the test made, in subdirectories too, and before the snapshot
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
        creators: dict[str, int] = {}
        traced: set[str] = set()  # the shim saw the test create it (this very inode)
        named: set[str] = set()  # a torch_<pid>_ name of one of the test's processes
        for name, st in list(stats.items()):
            entry = logged.get(name) if logged is not None else None
            if entry is not None and entry.inode == st.st_ino:
                creators[name] = entry.pid
                traced.add(name)
                continue
            pid = creator_pid(name)
            if pid is not None and pid in run.tree_pids:
                creators[name] = pid
                named.add(name)
            elif logged is not None:
                del stats[name]  # traced, not made by this test: another test's or session's
            elif pid is not None and exists(pid):
                del stats[name]  # a live process outside the test's tree made it
            elif pid is None and not self.alone:
                del stats[name]  # nothing says whose it is, and other tests ran beside it
            elif pid is not None:
                creators[name] = pid
        if not stats:
            return []
        held = held_inodes({(st.st_dev, st.st_ino) for st in stats.values()})
        leaks: dict[str, Leak] = {}
        for name in _deepest_first(list(stats)):  # a directory after what it holds
            st = stats[name]
            if (st.st_dev, st.st_ino) in held:
                continue
            path = os.path.join(self.directory, name)
            fields: dict[str, object] = {"path": path, "size": st.st_size}
            pid = creators.get(name)
            if pid is not None:
                fields["pid"] = pid
            # Only what the test is known to have made: never an entry it only opened.
            cleaned = (
                self.cleanup
                and (name in traced or name in named)
                and _remove(self.directory, name, st.st_ino, self.uid)
            )
            fields["cleaned"] = cleaned
            if stat.S_ISDIR(st.st_mode):
                kind = "directory"
            else:
                kind = "semaphore" if os.path.basename(name).startswith("sem.") else "segment"
            if name in traced:
                by = f", created by pid {pid}"
            elif pid is not None:
                by = f", named for pid {pid}"  # its name says so; the shim did not see it
            else:
                by = ""
            detail = f"{kind} {path} ({st.st_size} bytes{by}) left in /dev/shm"
            leaks[name] = Leak("shm", detail + (" (deleted)" if cleaned else ""), fields)
        return [leaks[name] for name in sorted(leaks)]
