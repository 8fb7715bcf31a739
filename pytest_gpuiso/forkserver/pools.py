"""Threads that native libraries start in the fork server, and making it safe to fork.

A process with more than one thread must not be forked: a thread holding a lock at
that moment leaves it locked forever in the child. Importing numpy (which importing
torch does) loads OpenBLAS, and OpenBLAS starts its pool of worker threads at load
(one less than the CPUs it may use), so a server that imported torch could never fork.

OpenBLAS stops that pool itself before any fork (its ``pthread_atfork`` handler,
``blas_thread_shutdown_``) and starts it again, with the same size, at the first
BLAS call after it. ``quiesce()`` runs that handler ahead of the fork, so the fork
server and its template are single-threaded when asked to fork. A forked test then
starts the pool it would have had in-process or under spawn: the same library, read
from the same environment, so a user's ``OPENBLAS_NUM_THREADS`` / ``OMP_NUM_THREADS``
still decides its size. Nothing about the pool is set: only when it starts changes.

OpenMP runtimes (libgomp, which torch uses, libiomp5) and MKL start their threads at
the first parallel region, not at load, and have no such handler: after one of those
the server refuses to fork, and ``why_threads()`` says which step started them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time

# Library file names (prefixes) of thread pools, and what they are, for messages.
POOLS = {
    "libopenblas": "OpenBLAS",
    "libscipy_openblas": "OpenBLAS",
    "libgomp": "GNU OpenMP",
    "libiomp5": "Intel OpenMP",
    "libomp": "LLVM OpenMP",
    "libmkl": "MKL",
    "libblis": "BLIS",
    "libtbb": "TBB",
}
SHUTDOWN = "blas_thread_shutdown_"  # OpenBLAS's own before-fork handler
# Seconds the threads a shutdown joined get to leave /proc/self/task: pthread_join returns
# when the kernel clears the thread's id, a little before it is gone from the list, and a
# loaded machine can stretch that moment.
EXITING = 0.5

_steps: list[tuple[str, int]] = []  # (what the process did, threads it had after it)


def threads() -> int:
    """This process's threads (native ones included)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def loaded_pools() -> list[tuple[str, str]]:
    """(path, kind) of the thread-pool libraries mapped in this process."""
    found: dict[str, str] = {}
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(" ", 1)[-1].strip()
                if not path.startswith("/") or path in found:
                    continue
                name = os.path.basename(path)
                for prefix, kind in POOLS.items():
                    if name.startswith(prefix):
                        found[path] = kind
    except OSError:
        pass
    return sorted(found.items())


def quiesce() -> int:
    """Stop the worker threads of every OpenBLAS loaded, if this process has threads;
    return how many threads it has then.

    They start again at the next BLAS call (in this process, or in a fork of it).
    """
    count = threads()
    if count <= 1:
        return count
    stopped = False
    for path, kind in loaded_pools():
        if kind != "OpenBLAS":
            continue
        with contextlib.suppress(OSError, AttributeError):
            library = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
            getattr(library, SHUTDOWN)()
            stopped = True
    deadline = time.monotonic() + (EXITING if stopped else 0)
    while (count := threads()) > 1 and time.monotonic() < deadline:
        time.sleep(0.002)
    return count


def step(what: str) -> None:
    """The process did ``what`` (e.g. "importing numpy"); note the threads it left."""
    _steps.append((what, quiesce()))


def why_threads(who: str, count: int) -> str:
    """Which steps started the ``count`` threads ``who`` has, in words a user can act on."""
    started = []
    before = 1
    for what, after in _steps:
        if after > before:
            started.append(f"{what} started {after - before}")
        before = after
    if _steps and count > before:
        started.append(f"{count - before} started after {_steps[-1][0]}")
    names = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if names:
        started.append(", ".join(names))
    else:
        pools = sorted({kind for _, kind in loaded_pools() if kind != "OpenBLAS"})
        started.append(
            f"native threads, of {', '.join(pools)}? These start at the first parallel "
            "operation, e.g. an import that computes with torch"
            if pools
            else "native threads"
        )
    return f"{who} has {count} threads ({'; '.join(started)}); a fork could deadlock"
