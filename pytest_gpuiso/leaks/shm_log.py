"""The /dev/shm shim's log: where a test's processes record the entries they CREATE.

``native/gpuiso_shmtrace.c``, preloaded into a test's processes (``preload_env``), appends
one line per entry they create under /dev/shm (not one they only open with O_CREAT):
the creator's pid, the inode the entry got and its name. The launcher gives each
process its log at its start (``LOG_ENV``); the leak check (``leaks.shm``) reads it
after the test, the launcher for a process discarded before its turn, and the fork
server's template for what it created itself. Only an entry that still holds the logged
inode and is ours is ever deleted (``remove_created``), and only on request, or when the
test's process handed it over (``hand_over``): a segment it created and left registered
with multiprocessing's resource tracker, which would have deleted it at exit.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.machinery
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path
from typing import NamedTuple

from ..wire.environment import LOG_ENV

SHM_DIR = "/dev/shm"
_ESCAPED = re.compile(rb"%([0-9A-Fa-f]{2})")  # the shim's escape of bytes <= 0x20, % and 0x7f
_ASAN_ORDER = "verify_asan_link_order"
LOG_LIMIT = 64 << 20  # bytes of a log read (~1M creations); a line past it is not read


@functools.cache
def shim_path() -> str | None:
    """The built ``gpuiso_shmtrace`` library, if ``pip install`` built it."""
    here = Path(__file__).resolve().parent.parent  # the package's folder: setup.py's place
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = here / f"_shmtrace{suffix}"
        if candidate.is_file():
            return str(candidate)
    return None


_SPLITS = re.compile(r"[\s:]")  # where ld.so splits LD_PRELOAD: no path of it may hold one


@functools.cache
def preloadable() -> tuple[str | None, str]:
    """The path to preload the shim by (None: it cannot be), and why not ("" when it can,
    or when it was not built). Checked once a process: ld.so splits LD_PRELOAD at spaces
    and colons, so a shim installed under such a path ("My Projects") is preloaded through
    a link in our private folder; a process started with it must load it silently."""
    shim = shim_path()
    if shim is None:
        return None, ""
    path = shim if not _SPLITS.search(shim) else _linked(shim)
    if path is None:
        return None, f"its path has a space or colon, where ld.so splits LD_PRELOAD ({shim})"
    problem = _load_problem(path)
    return (None, problem) if problem else (path, "")


def _linked(shim: str) -> str | None:
    """A link to ``shim`` in our private folder (0700, ours), made once; None where that
    folder's path too has a space or colon, or the link cannot be made."""
    from ..proc import workdir

    try:
        folder = workdir.root()
    except workdir.WorkdirError:
        return None
    link = folder / f"shmtrace-{hashlib.sha256(shim.encode()).hexdigest()[:16]}.so"
    if _SPLITS.search(str(link)):
        return None
    try:
        if os.readlink(link) == shim:
            return str(link)
    except OSError:
        pass
    temporary = folder / f".{link.name}.{os.getpid()}"
    try:
        os.symlink(shim, temporary)
        os.replace(temporary, link)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        return None
    return str(link)


def _load_problem(path: str) -> str:
    """What ld.so says when a program is started with ``path`` preloaded ("" if nothing)."""
    true = shutil.which("true")
    if true is None:
        return ""
    env = {**os.environ, "LD_PRELOAD": path}
    env.pop(LOG_ENV, None)
    try:
        done = subprocess.run([true], env=env, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"a program started with it could not run ({exc})"
    said = done.stderr.decode(errors="replace").strip()
    return said.splitlines()[0] if said else ""


def preload_env() -> dict[str, str]:
    """What a process must be started with for the shim to trace it (empty: no shim).

    The user's own LD_PRELOAD entries come first: AddressSanitizer's runtime must be
    the first library of a process (a preloaded libasan stays so). A program linked
    with ASan and run by a test finds the shim ahead of its runtime and would abort
    ("ASan runtime does not come first"), so ``verify_asan_link_order=0`` joins
    ASAN_OPTIONS, unless the user set that key themselves.
    """
    shim, _ = preloadable()
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
    """One creation the shim logged: who made the entry, and which inode it got;
    ``tracked``: the test's process handed it over (``hand_over``)."""

    pid: int
    inode: int
    tracked: bool = False


_TRACKED = b"tracked"  # a hand-over's line: "tracked <inode> <escaped name>"


def read_log(path: str) -> dict[str, Logged]:
    """name (relative to /dev/shm, "dir/name" in a subdirectory) -> its creation, from the
    shim's log; the last creation of a name wins. A hand-over counts for the creation it
    follows, of the same inode."""
    created: dict[str, Logged] = {}
    for line in _read_bounded(path).split(b"\n")[:-1]:  # the last: cut, or empty
        parts = line.split(b" ", 2)
        if len(parts) != 3:
            continue
        pid, inode, name = parts
        if not (inode.isdigit() and name):
            continue
        text = os.fsdecode(_ESCAPED.sub(lambda m: bytes([int(m[1], 16)]), name))
        if pid.isdigit():
            created[text] = Logged(int(pid), int(inode))
        elif pid == _TRACKED and text in created and created[text].inode == int(inode):
            created[text] = created[text]._replace(tracked=True)
    return created


def _read_bounded(path: str) -> bytes:
    """The first ``LOG_LIMIT`` bytes of the regular file ``path``, b"" for anything else:
    the log is the test's to write, and a test may put a symlink, a FIFO or a device
    in its place (no symlink is followed, no open blocks)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return b""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return b""
        chunks = []
        left = LOG_LIMIT
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError:
        return b""
    finally:
        os.close(fd)


def _escape(name: str) -> bytes:
    """``name`` as the shim writes it: bytes <= 0x20, % and 0x7f as %XX."""
    return b"".join(
        b"%%%02X" % byte if byte <= 0x20 or byte in (0x25, 0x7F) else bytes([byte])
        for byte in os.fsencode(name)
    )


def hand_over(log: str, name: str, inode: int) -> bool:
    """Say in ``log`` that the entry ``name`` (relative to /dev/shm), which the log says
    this test's processes created as ``inode``, is left for the leak check to delete once
    it has looked (a test's process, for what multiprocessing's resource tracker would
    have deleted at exit: ``child.tracker``). One ``write``, appended, as the shim writes
    its lines; whether it was written."""
    line = b"%s %d %s\n" % (_TRACKED, inode, _escape(name))
    try:
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return os.write(fd, line) == len(line)
    except OSError:
        return False
    finally:
        os.close(fd)


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


def remove_entry(directory: str, name: str, inode: int, uid: int) -> bool:
    return _same_entry(directory, name, inode, uid, remove=True)


def deepest_first(names: list[str]) -> list[str]:
    """A directory's entries before the directory."""
    return sorted(names, key=lambda name: (-name.count("/"), name))


def created_entries(log: str, directory: str = SHM_DIR) -> list[str]:
    """The entries the shim logged in ``log`` as created that are still there, as the
    same inode, and ours (deepest first)."""
    uid = os.getuid()
    logged = read_log(log)
    return deepest_first(
        [name for name, entry in logged.items() if _still_created(directory, name, entry, uid)]
    )


def remove_created(log: str, directory: str = SHM_DIR) -> list[str]:
    """Delete what ``created_entries`` lists (for a process whose test never ran, under
    ``--gpu-isolate-cleanup``); the names deleted."""
    uid = os.getuid()
    logged = read_log(log)
    return [
        name
        for name in deepest_first(list(logged))
        if remove_entry(directory, name, logged[name].inode, uid)
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
