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
import re
import stat
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..values import SpecError, bad_value
from .record import SCHEMA_VERSION

if TYPE_CHECKING:
    from .baseline import Summary
    from .record import Record
    from .run_info import Session
    from .shards import Shard

STEP_SUMMARY_ENV = "GITHUB_STEP_SUMMARY"  # GitHub Actions' file for a step's Markdown
# A name that is not UTF-8 (a /dev/shm entry's) is a lone surrogate in our text: written
# as its escape (valid in JSON strings), never an error that loses the report.
UNENCODABLE = "backslashreplace"


def write_json(
    path: Path,
    records: list[Record],
    baseline: Summary | None = None,
    session: Session | None = None,
    shards: list[Shard] | None = None,
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
    (relative to ``base``): another user's link on the way, or a device, FIFO or socket
    there that is not yours (or root's), or that cannot be written; else its folder (or
    the nearest one that exists: the writer makes the rest) must be a directory in which
    a file can be created."""
    path = os.path.normpath(os.path.join(base, value))

    def bad(problem: str) -> SpecError:
        return bad_value(value, what, OUTPUT_FORMS, problem)

    try:  # a link to a file: the file is replaced, in its folder
        target = resolved(path)
    except OSError as exc:
        raise bad(str(exc.strerror)) from None
    if os.path.isdir(target):
        raise bad(f"{path} is a directory")
    node = _written_into(target)
    if node is not None:  # /dev/null, /dev/stdout, a FIFO: appended to
        problem = None if _DESCRIPTOR.fullmatch(target) else _not_yours(node, target)
        if problem is not None:
            raise bad(problem)
        if not os.access(target, os.W_OK):
            raise bad(f"{path} cannot be written")
        return  # its folder needs no room
    folder = os.path.dirname(target)
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
# A process's open file (``/dev/stdout`` leads to ``/proc/self/fd/1``): a link that names
# no path when its file is a pipe or a socket, opened by the kernel, never resolved.
_DESCRIPTOR = re.compile(r"/proc/[^/]+(?:/task/[^/]+)?/fd/[^/]+")
_KIND_NAMES = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFREG: "a file",
}


def _written_into(target: str) -> os.stat_result | None:
    """The node at ``target`` (``resolved``) when a report must be written into it, not a
    new file renamed over it: a device, a FIFO, a socket, or a process's descriptor (the
    one link ``resolved`` leaves). Renaming over any of those would replace the node (or
    the ``/dev`` link) itself. None for nothing there, or a regular file."""
    try:
        st = os.lstat(target)
    except OSError:
        return None
    return None if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode) else st


def _not_yours(st: os.stat_result, target: str) -> str | None:
    """Why a node of another user (not you, not root) is not written into: a FIFO planted
    in a shared folder would hand the report to its owner. None for yours."""
    if st.st_uid in (os.geteuid(), 0):
        return None
    kind = _KIND_NAMES.get(stat.S_IFMT(st.st_mode), "a node")
    return f"{target} is {kind} of uid {st.st_uid}, not yours: not written"


def _append(target: str, text: str, create: bool = False) -> None:
    """Append ``text`` to the node at ``target`` (``resolved``): opened without following
    a link (but a descriptor's), without blocking (a FIFO without a reader is an error, not
    a wait for one) and without becoming the controlling terminal; then, by its descriptor,
    checked to be yours (or root's), unless it is your process's own descriptor."""
    descriptor = _DESCRIPTOR.fullmatch(target) is not None  # by its path: /proc, no race
    flags = os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    flags |= (0 if descriptor else os.O_NOFOLLOW) | (os.O_CREAT if create else 0)
    try:
        fd = os.open(target, flags, 0o666)  # as open(): the umask decides
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # O_NONBLOCK's answer for a FIFO without a reader
            why = f"{target} is a FIFO that no process reads (or a socket): not written"
            raise OSError(errno.ENXIO, why) from None
        if exc.errno == errno.ELOOP and not descriptor:  # a link put there meanwhile
            raise OSError(errno.ELOOP, f"{target} is a symbolic link now: not followed") from None
        raise
    try:
        st = os.fstat(fd)
        problem = None if descriptor else _not_yours(st, target)
        if problem is not None:
            raise OSError(errno.EPERM, problem)
        os.set_blocking(fd, True)  # a reader there is waited for, as stdout's is
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "w", encoding="utf-8", errors=UNENCODABLE) as f:
        f.write(text)


def write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (a temporary file renamed over it).

    A device, a FIFO or a descriptor (``/dev/null``, ``/dev/stdout``) is appended to
    instead (``_append``: yours or root's only, never waited on); for a link to a regular
    file, the file is replaced and the link kept. Another user's link on the way is an
    ``OSError`` naming it (``resolved``).
    """
    target = resolved(path)
    if _written_into(target) is not None:
        _append(target, text)
        return
    path = Path(target)
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
    ``fs.protected_symlinks`` never applies to it.) A process's descriptor at the end
    (``/proc/self/fd/1``, where ``/dev/stdout`` leads) is left as it is, for the kernel
    to open: its file may be a pipe, which no path names."""
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
        if not any(pending) and _DESCRIPTOR.fullmatch(current):
            return current
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
    try:  # as a report is written into: no link, FIFO or file of another user's
        _append(resolved(step), text, create=True)
    except OSError as exc:
        return f"{exc.strerror}: {step}"
    return None
