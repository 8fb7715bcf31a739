"""The few Linux process controls the standard library lacks (prctl through ctypes)."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36

MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25  # Linux 6.1+
HUGE_PAGE = 2 << 20  # x86-64 and arm64 (4 KiB base pages)

_libc = None


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        try:  # glibc's name; find_library runs ldconfig in a subprocess, ~5 ms a process
            _libc = ctypes.CDLL("libc.so.6", use_errno=True)
        except OSError:  # another C library (musl)
            _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _libc


def _prctl(option: int, arg: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    return _lib().prctl(option, ctypes.c_ulong(arg), 0, 0, 0) == 0


def set_child_subreaper(on: bool = True) -> bool:
    """Make orphaned descendants re-parent to this process instead of init (or stop)."""
    return _prctl(PR_SET_CHILD_SUBREAPER, int(on))


def die_with_parent(expected_parent: int, sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` when our parent dies; exit now if it already has.

    The re-check closes the race where the parent died before the prctl call.
    """
    _prctl(PR_SET_PDEATHSIG, int(sig))
    if os.getppid() != expected_parent:
        os._exit(70)


def outlive_parent() -> None:
    """Undo ``die_with_parent``: this process lives on when its parent dies."""
    _prctl(PR_SET_PDEATHSIG, 0)


def huge_page_steps(chunk: int = 8 << 20) -> Iterator[int]:
    """Move this process's private writable memory into transparent huge pages, in steps.

    For a process that will be forked many times (the fork server's template):
    ``fork`` copies one page-table entry per 4 KiB page and ``exit`` tears them all
    down again, about 10 ms for the ~150 MB heap of a process that imported torch.
    Backed by 2 MiB pages it is one entry per 2 MiB: ~3 ms. A child's first write to
    such a page still copies only 4 KiB (the kernel splits the mapping).

    Collapsing costs ~2 ms per 2 MiB page here, so it is done ``chunk`` bytes per
    step (each ``next()``; yields the bytes collapsed), between other work. Best
    effort: before Linux 6.1 (no ``MADV_COLLAPSE``) or with THP off, nothing changes.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return
    libc = _lib()
    for line in lines:
        fields = line.split()
        path = fields[5] if len(fields) > 5 else ""
        if fields[1] != "rw-p" or (path and path != "[heap]"):
            continue  # only anonymous private memory: the heap and Python's arenas
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        start = -(-lo // HUGE_PAGE) * HUGE_PAGE
        end = hi // HUGE_PAGE * HUGE_PAGE
        for at in range(start, end, chunk):
            size = min(chunk, end - at)
            libc.madvise(at, size, MADV_HUGEPAGE)
            if libc.madvise(at, size, MADV_COLLAPSE) != 0 and ctypes.get_errno() == errno.EINVAL:
                break  # not this mapping (a thread's stack), or no MADV_COLLAPSE at all
            yield size


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, SIGTSTP: paused by another process, a
    job control, a checkpointer) or traced at a stop: it answers nothing until continued.
    False for a process that is gone or cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read()
    except OSError:
        return False
    state = text[text.rfind(b")") + 2 : text.rfind(b")") + 3]  # after "pid (comm) "
    return state in (b"T", b"t")


def wait_readable(conn: Any, timeout: float, pid: int, step: float = 0.5) -> str | None:
    """Wait up to ``timeout`` seconds for ``conn`` (a multiprocessing connection) to have
    something to read, from process ``pid``. None when it has; else why not: the process
    is stopped (said at once: it would never answer), or the time ran out."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if conn.poll(max(0.0, min(step, left))):
            return None
        if stopped(pid):
            return "it is stopped (SIGSTOP: another process paused it)"
        if left <= step:
            return f"it did not answer within {timeout:g} s"
