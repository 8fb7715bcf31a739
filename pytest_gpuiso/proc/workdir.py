"""Private per-process directories for spill files, child output and stack dumps.

Layout: ``$TMPDIR/pytest-gpuiso-<uid>/<pid>-<random>/``, the parent 0700 and owned
by us, made only when something needs it (an isolated test, ``run_isolated``, the
fork server): a session without isolated tests never touches it, so a name taken
by someone else costs it nothing. When it is taken (another owner, not a directory,
open to others), ``WorkdirError`` says so in one line, with the way out (``TMPDIR``).

Each process holds an ``flock`` on the ``lock`` file in its own directory for its
lifetime; the kernel releases it when the process dies, in whatever pid namespace
(a pid and a start time mean nothing in another one, and sessions in containers may
share a TMPDIR). The lock file gets its name only once it is locked, so no one ever
finds it unlocked while its process lives; before that, it is given the directory's
identity (``owner``: the path, the directory's inode and its own), which the session's
processes carry. A later session removes the directories whose lock it can take, after
ending the processes their tests left running (``dead_sessions``), only for one whose lock
file holds its own identity (``_proven``); anything else (no lock file, not a directory,
another name, a file a process of ours still has open in it) is kept.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import os
import pwd
import re
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import dead_sessions

LOCK = "lock"
_NAME = re.compile(r"^\d+-[A-Za-z0-9_]+$")  # <pid>-<random>: a process's directory
IDENTITY_LIMIT = 8192  # bytes of a lock file read: more than any identity (PATH_MAX + 40)
_mine: dict[int, tuple[Path, int]] = {}  # by pid: the directory and its lock's descriptor


class WorkdirError(RuntimeError):
    """The work directory cannot be used; the message is one line with the way out."""


def base() -> Path:
    return Path(tempfile.gettempdir()) / f"pytest-gpuiso-{os.getuid()}"


def user_name(uid: int) -> str:
    """ "user NAME (uid N)", or "uid N" when the uid has no name here."""
    try:
        return f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _refuse(path: Path, problem: str) -> WorkdirError:
    return WorkdirError(
        f"the work directory {path} {problem}; set TMPDIR to a directory of yours "
        "to have pytest-gpuiso work there instead"
    )


def root(create: bool = True) -> Path:
    """``base()``, made (0700) when ``create`` and missing; ``WorkdirError`` when it is
    not a directory of ours that only we can enter."""
    path = base()
    if create:
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise _refuse(path, f"cannot be created ({exc.strerror})") from None
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise _refuse(path, f"cannot be used ({exc.strerror})") from None
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(path, f"is a symbolic link (owned by {user_name(st.st_uid)})")
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, f"is not a directory (owned by {user_name(st.st_uid)})")
    if st.st_uid != os.getuid():
        raise _refuse(path, f"is owned by {user_name(st.st_uid)}, not by {user_name(os.getuid())}")
    if st.st_mode & 0o077:
        raise _refuse(path, f"is open to other users (mode {stat.S_IMODE(st.st_mode):04o})")
    return path


def process_dir() -> Path:
    """This process's own directory, created (locked) on first use and removed at exit.

    Raises ``WorkdirError`` when it cannot be made (the name taken, no descriptor left).
    """
    pid = os.getpid()
    mine = _mine.get(pid)
    if mine is not None:
        return mine[0]
    top = root()
    path = None
    try:
        path = Path(tempfile.mkdtemp(prefix=f"{pid}-", dir=top))
        # Locked before it is given its name: no one ever finds it unlocked.
        fd = os.open(path / ".lock-new", os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, _identity(path, fd).encode())  # what proves it ours (``_proven``)
            os.rename(path / ".lock-new", path / LOCK)
        except BaseException:
            os.close(fd)
            raise
    except OSError as exc:
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)
        raise WorkdirError(
            f"cannot make this process's work directory in {top}: {describe(exc)}"
        ) from None
    _mine[pid] = (path, fd)
    atexit.register(remove_process_dir)
    return path


def remove_process_dir() -> None:
    mine = _mine.pop(os.getpid(), None)
    if mine is not None:
        path, fd = mine
        shutil.rmtree(path, ignore_errors=True)
        os.close(fd)  # only now: until it is gone, no one else may take it


def clean_stale(on_dead: Callable[[Path, str], None] | None = None) -> list[dict[str, Any]]:
    """Remove the directories of processes that are gone (their lock is free), after
    ending what their tests left running (``dead_sessions.end``) and handing each to
    ``on_dead`` (the directory, its dead pytest's pid: for what else its files name);
    return what was ended.

    Only a directory whose lock file holds its own identity (``_proven``) has processes
    ended and is handed over; an unproven one (its lock file replaced, or made by a
    version that wrote none) ends nothing. Either is kept, and not handed over, while a
    process of ours still has a file open in it. Makes nothing, and says nothing when the
    work directory is missing or not ours. Lists processes only when some directory is found dead.
    """
    try:
        entries = list(root(create=False).iterdir())
    except (WorkdirError, OSError):
        return []
    taken: list[tuple[Path, int]] = []
    kept: set[Path] = set()
    try:
        for entry in entries:
            fd = _take(entry) if _NAME.match(entry.name) else None
            if fd is not None:
                taken.append((entry, fd))
        # While the locks are ours: no other session ends them too, and one that dies
        # now leaves the directories for the next to finish.
        proven = {entry: name for entry, fd in taken if (name := _proven(entry, fd))}
        ended = dead_sessions.end(list(proven.values())) if proven else []
        # What a process of ours still has open (after those ended: a live session's
        # lock moved aside, a process that carries no name) is not a dead session's.
        kept = _in_use([entry for entry, _ in taken])
        if on_dead is not None:
            for entry in proven.keys() - kept:
                on_dead(entry, entry.name.split("-")[0])
        return ended
    finally:
        for entry, fd in taken:
            if entry not in kept:
                shutil.rmtree(entry, ignore_errors=True)
            os.close(fd)


def owner(path: Path) -> str:
    """The identity of the work directory ``path`` that its session's processes carry
    (``OWNER_ENV``): its full path, its inode and its lock file's, which no copy of it
    (another ``TMPDIR``'s, a restored cache), no directory made later at that path and
    no lock file put in the place of its own shares. "" when it cannot be read (then
    nothing is taken for it)."""
    mine = _mine.get(os.getpid())
    if mine is not None and mine[0] == path:
        return _identity(path, mine[1])  # our own lock, whatever its name now holds
    try:
        fd = os.open(path / LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        return _identity(path, fd)
    finally:
        os.close(fd)


def _identity(path: Path, lock: int) -> str:
    """``owner``'s text for ``path`` and its lock file's descriptor; "" when unreadable."""
    try:
        st, lock_st = os.lstat(path), os.fstat(lock)
    except OSError:
        return ""
    return f"{os.path.realpath(path)}@{st.st_dev:x}:{st.st_ino:x}:{lock_st.st_ino:x}"


def _proven(entry: Path, fd: int) -> str:
    """``entry``'s identity when its lock file (``fd``) holds it, as written when the
    directory was made (``process_dir``); else "". A lock file put in the place of a
    live session's (moved aside, its lock still held) holds another inode than the one
    its processes carry, so even a forged text in it names no live process."""
    name = _identity(entry, fd)
    try:
        written = os.pread(fd, IDENTITY_LIMIT, 0)
    except OSError:
        return ""
    return name if name and written == name.encode() else ""


def _in_use(entries: list[Path]) -> set[Path]:
    """Which of ``entries`` a process of ours, this one aside (it holds their locks), has
    a file open in (by ``/proc/*/fd``)."""
    inside = {os.path.realpath(entry) + os.sep: entry for entry in entries}
    uid, found = os.getuid(), set()
    try:
        pids = os.listdir("/proc") if inside else []
    except OSError:
        return set(entries)  # nothing can be known: nothing is removed
    for pid in pids:
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    found.update(e for prefix, e in inside.items() if target.startswith(prefix))
    return found


def _take(entry: Path) -> int | None:
    """The descriptor of ``entry``'s lock, locked, if it can be taken (its process is
    dead); None when it is held or ``entry`` is not one to judge."""
    try:
        fd = os.open(entry / LOCK, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None  # no lock file (half made, or not ours to judge): kept
    try:
        if stat.S_ISDIR(os.lstat(entry).st_mode) and stat.S_ISREG(os.fstat(fd).st_mode):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
    except OSError:
        pass  # held: its process lives, in this pid namespace or another
    os.close(fd)
    return None


def describe(exc: OSError) -> str:
    """An ``OSError`` in one line, with what a resource limit error means."""
    text = f"[Errno {exc.errno}] {exc.strerror}" if exc.strerror else str(exc)
    hint = EXHAUSTED.get(exc.errno)
    return f"{text}; {hint}" if hint else text


EXHAUSTED = {  # errors of a resource that ran out, and what it means
    errno.EAGAIN: "the process limit (ulimit -u, or the machine's) is reached",
    errno.EMFILE: "this process's open file limit (ulimit -n) is reached",
    errno.ENFILE: "the machine's open file limit is reached",
    errno.ENOMEM: "out of memory",
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is reached",
}


def private_file(directory: Path, name: str) -> Path:
    """Create an empty file only we can read (0600); it must not exist yet."""
    path = directory / name
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    return path


def remove(*paths: Path | None) -> None:
    """Delete files that may already be gone."""
    for path in paths:
        if path is not None:
            with contextlib.suppress(OSError):
                path.unlink()


def read_end(path: Path, keep: int) -> tuple[str, int]:
    """The last ``keep`` bytes of a file as text, from a line's start when cut, and its size.

    ``("", 0)`` when it cannot be read.
    """
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - keep))
            data = f.read()
    except OSError:
        return "", 0
    text = data.decode("utf-8", "replace")
    if size > keep:
        text = text.split("\n", 1)[-1]  # the first line is probably cut
    return text, size
