"""Whether the template is fit to be forked: what it made outside its memory.

The template serves only if configuring and collecting left nothing outside its memory
that its forks would share (``left_outside``); a successor template, only if importing
what a test imported did not either (``import_audited``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

from ..child import imports, relay
from ..child.env_reads import env_reads
from ..leaks.shm_log import created_entries
from ..proc._linux import set_child_subreaper
from ..proc.proctree import live_descendants
from ..wire.environment import per_test
from . import pools
from .fork import unsafe_to_fork


def import_audited(names: list[tuple[str, str]]) -> tuple[str, str] | None:
    """In a successor template: import modules a test's process imported while its test
    ran, so that the tests forked after it have them, as in-process pytest keeps them.

    Each import is audited like the collection: a module that starts a thread or a
    process, opens a file or a shared mapping, touches CUDA or reads a variable each
    test's process is given anew (its GPUs, its port) leaves this process unfit to fork;
    (that module, why) is returned, and the template that forked it serves on.
    A module that fails to import, or that this process would find elsewhere than the
    test's process did (a test that put a folder first on ``sys.path``), is left to the
    tests that import it.
    """
    from importlib import import_module
    from importlib.util import find_spec

    for name, origin in names:
        if name in sys.modules or not imports.is_learnt((name, origin)):
            continue
        try:
            spec = find_spec(name)  # imports its parent packages
        except BaseException:  # noqa: BLE001 - a parent that fails: the tests meet it
            continue
        if spec is None or spec.origin != origin:
            continue
        before = snapshot()
        set_child_subreaper(True)  # a daemon it starts is seen (left_outside)
        with env_reads() as reads, contextlib.suppress(BaseException):  # even SystemExit:
            import_module(name)  # the tests meet it
        pools.step(f"importing {name}, which a test imported")
        problem = unfit(before, None) or _reads_per_test(reads)
        set_child_subreaper(False)
        if problem is not None:
            return name, f"after importing {name}, as a test did: {problem}"
    relay.freeze()
    return None


def _reads_per_test(reads: dict[str, str | None]) -> str | None:
    """Why a module that read, at import, a variable each test's process is given anew
    (its GPUs, its port) may not be imported where tests are forked from: every test
    forked after would see this process's value in it."""
    names = sorted(name for name in reads if per_test(name))
    if not names:
        return None
    return f"it read {', '.join(names)} at import, which each test's process is given anew"


def unfit(
    before: tuple[dict[int, str], set[str]], shm_log: str | None, kept: set[int] = frozenset()
) -> str | None:
    """Why this template may not be forked (``unsafe_to_fork``, ``left_outside``; ``kept``:
    descriptors each test's process takes over), or None; when it may not, the
    processes it started are killed first: they go with it, not to a test's account."""
    problem = unsafe_to_fork("the template") or left_outside(before, shm_log, kept)
    if problem is not None:
        for pid in live_descendants():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    return problem


def snapshot() -> tuple[dict[int, str], set[str]]:
    """What ``left_outside`` compares with: the open descriptors and shared mappings."""
    return _descriptors(), _shared_mappings()


def _descriptors() -> dict[int, str]:
    """This process's open descriptors and what they point to."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            found[int(name)] = os.readlink(f"/proc/self/fd/{name}")
    return found


def _write_only(fd: int) -> bool:
    """Whether ``fd`` was opened for writing only (its offset then only ever grows)."""
    try:
        with open(f"/proc/self/fdinfo/{fd}") as info:
            for line in info:
                if line.startswith("flags:"):
                    return int(line.split()[1], 8) & os.O_ACCMODE == os.O_WRONLY
    except (OSError, ValueError):
        pass
    return False


def _shared_mappings() -> set[str]:
    """This process's shared memory mappings (lines of /proc/self/maps with an "s")."""
    try:
        with open("/proc/self/maps") as maps:
            return {line for line in maps.read().splitlines() if line.split()[1][3:4] == "s"}
    except OSError:
        return set()


def left_outside(
    before: tuple[dict[int, str], set[str]], shm_log: str | None, kept: set[int] = frozenset()
) -> str | None:
    """What configuring and collecting made outside this process's memory, or None.

    Forked tests' processes would share it: one test would see what another wrote into
    a shared mapping (``mmap``, a multiprocessing lock) or read from a file (the
    offset is shared), and each one's ``pytest_unconfigure`` would tear down what the
    next one still needs (a helper process, a connection). A regular file opened for
    writing only is fine (a log file: each test's process appends to it).
    """
    fds, mappings = before
    kids = live_descendants()
    if kids:
        return f"it started process {kids[0]}" + (f" and {len(kids) - 1} more" if kids[1:] else "")
    for fd, target in _descriptors().items():
        if fds.get(fd) == target or fd in kept:
            continue
        regular = target.startswith("/") and not target.startswith(("/dev/", "/proc/"))
        if regular and not _write_only(fd):
            return f"it opened {target} for reading (descriptor {fd})"
        if not (regular or target in ("/dev/null", "/dev/urandom")):
            return f"it opened {target} (descriptor {fd})"
    for mapping in sorted(_shared_mappings() - mappings):
        fields = mapping.split(maxsplit=5)
        what = fields[5] if len(fields) > 5 else ""
        if not what or what.startswith("/dev/zero"):
            what = "anonymous memory"
        return f"it made a shared mapping of {what} ({fields[0]})"
    created = created_entries(shm_log) if shm_log else []
    if created:
        return f"it created /dev/shm/{created[0]}"
    return None
