"""Where reports are written, and how: whole or not at all, checked before the session.

Every output of the plugin and of ``python -m pytest_gpuiso`` (the JSON report, the
Markdown summary, GitLab's Code Quality file, ``$GITHUB_STEP_SUMMARY``) goes through
``write_text``, ``write_json`` or ``append_step_summary``; ``check_output`` fails a bad
path at configure time, not at the session's end.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from ..values import SpecError, bad_value
from .record import SCHEMA_VERSION

STEP_SUMMARY_ENV = "GITHUB_STEP_SUMMARY"  # GitHub Actions' file for a step's Markdown
# A name that is not UTF-8 (a /dev/shm entry's) is a lone surrogate in our text: written
# as its escape (valid in JSON strings), never an error that loses the report.
UNENCODABLE = "backslashreplace"


def write_json(
    path: Path,
    records: list[dict[str, Any]],
    baseline: dict[str, Any] | None = None,
    session: dict[str, Any] | None = None,
    shards: list[dict[str, Any]] | None = None,
) -> None:
    """Write the report atomically (a reader never sees half a file); ``baseline``: what
    the session made of its leak baseline (``Baseline.summary``); ``session``: what run it
    is of (``run_info.session_block``); ``shards``: a merge's shards, each a path and its
    report's session."""
    document: dict[str, Any] = {"version": SCHEMA_VERSION, "tests": records}
    if session is not None:
        document["session"] = session
    if shards is not None:  # a merge: each shard's path and session
        document["shards"] = shards
    if baseline is not None:
        document["baseline"] = baseline
    write_text(path, json.dumps(document, indent=2, ensure_ascii=False) + "\n")


def check_output(value: str, what: str, base: str) -> None:
    """Fail now, not at the session's end, when a report cannot be written at ``value``
    (relative to ``base``): its folder (or the nearest one that exists: the writer makes
    the rest) must be a directory in which a file can be created."""
    path = os.path.normpath(os.path.join(base, value))

    def bad(problem: str) -> SpecError:
        return bad_value(value, what, OUTPUT_FORMS, problem)

    if os.path.isdir(path):
        raise bad(f"{path} is a directory")
    if written_in_place(path):  # /dev/null, /dev/stdout, a FIFO: appended to
        if not os.access(path, os.W_OK):
            raise bad(f"{path} cannot be written")
        return  # its folder needs no room
    try:  # a link to a file: the file is replaced, in its folder
        path = resolved(path)
    except OSError as exc:
        raise bad(str(exc.strerror)) from None
    folder = os.path.dirname(path)
    while not os.path.lexists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise bad(f"{folder} is not a directory")
    try:  # os.access() says yes to root, even where nothing can be created (/proc)
        fd, probe = tempfile.mkstemp(prefix=".gpuiso-check-", dir=folder)
    except OSError as exc:
        raise bad(f"cannot write in {folder}: {exc.strerror or exc}") from None
    os.close(fd)
    os.unlink(probe)


OUTPUT_FORMS = "a file in a folder that can be written, or a device or FIFO to write into"


def written_in_place(path: str | os.PathLike) -> bool:
    """Whether an output file at ``path`` must be written into, not replaced: a device, a
    FIFO, a socket, or one of a process's descriptors (``/dev/stdout`` links to
    ``/proc/self/fd/1``, which may be the file pytest's output is redirected to).
    Renaming a new file over any of those would replace the node (or the ``/dev`` link)
    itself. False for a path that does not exist, a regular file, or a link to one."""
    current = os.fspath(path)
    for _ in range(40):  # the kernel's own limit on links followed
        try:
            st = os.lstat(current)
        except OSError:
            return False
        if not stat.S_ISLNK(st.st_mode):
            return not stat.S_ISREG(st.st_mode)
        try:
            target = os.readlink(current)
        except OSError:
            return False
        current = os.path.normpath(os.path.join(os.path.dirname(current), target))
        if current == "/proc" or current.startswith("/proc/"):
            return True
    return False


def write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (a temporary file renamed over it).

    A device, a FIFO or a descriptor (``/dev/null``, ``/dev/stdout``) is appended to
    instead (``written_in_place``); for a link to a regular file, the file is
    replaced and the link kept.
    """
    if written_in_place(path):
        with open(path, "a", encoding="utf-8", errors=UNENCODABLE) as f:
            f.write(text)
        return
    path = Path(resolved(path))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # a file where the folder should be: say that, not "File exists"
        raise NotADirectoryError(
            errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path.parent)
        ) from None
    fd, tmp = tempfile.mkstemp(prefix=".gpuiso-", suffix=path.suffix, dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", errors=UNENCODABLE) as f:
            f.write(text)
        os.chmod(tmp, _mode_of(path))
        os.replace(tmp, path)
    except BaseException:  # a full disk, Ctrl-C: leave no temporary file behind
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def resolved(path: str | os.PathLike) -> str:
    """``path`` with its symbolic links resolved, as the kernel would, but following only
    links of yours (or root's): another user's link (planted in a shared ``/tmp``) is an
    ``OSError`` naming it, never followed to replace a file of yours with a report.
    (``os.path.realpath`` follows any link in user space, so the kernel's
    ``fs.protected_symlinks`` never applies to it.)"""
    pending = os.path.join(os.getcwd(), os.fspath(path)).split("/")
    done, hops = "/", 0
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            done = os.path.dirname(done)
            continue
        current = os.path.join(done, part)
        try:
            st = os.lstat(current)
        except OSError:  # the rest does not exist (yet): the writer makes it
            return os.path.normpath(os.path.join(current, *pending))
        if not stat.S_ISLNK(st.st_mode):
            done = current
            continue
        if st.st_uid not in (os.geteuid(), 0):
            why = f"{current} is a symbolic link of uid {st.st_uid}, not yours: not followed"
            raise OSError(errno.EPERM, why)
        hops += 1
        if hops > 40:  # the kernel's own limit
            raise OSError(errno.ELOOP, f"too many levels of symbolic links: {path}")
        target = os.readlink(current)
        pending = target.split("/") + pending
        if target.startswith("/"):
            done = "/"
    return done


def _mode_of(path: Path) -> int:
    """The mode a report replacing ``path`` gets: the replaced file's own (a 0600 file
    stays 0600), 0644 for a new one."""
    try:
        st = os.stat(path)
    except OSError:
        return 0o644
    return stat.S_IMODE(st.st_mode) if stat.S_ISREG(st.st_mode) else 0o644


def step_summary_path() -> str | None:
    """The file of ``$GITHUB_STEP_SUMMARY`` (GitHub Actions), None where it is not set."""
    return os.environ.get(STEP_SUMMARY_ENV) or None


def append_step_summary(text: str) -> str | None:
    """Append ``text`` to ``$GITHUB_STEP_SUMMARY`` when it is set.

    Returns None when done (or not set), else why not, naming the file.
    """
    step = step_summary_path()
    if step is None:
        return None
    try:
        with open(step, "a", encoding="utf-8", errors=UNENCODABLE) as f:
            f.write(text)
    except OSError as exc:
        return f"{exc.strerror}: {step}"
    return None
