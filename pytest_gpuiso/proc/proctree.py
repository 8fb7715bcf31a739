"""Process primitives: liveness, start times, descendants, signalling, killing, reaping.

One version of each, used by the supervisor, the leak probes and the fork server.
A process is identified by its pid *and* its start time (``start_time``), since a
pid is reused once its process is reaped.
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import signal
import sys
import time
import types
from collections.abc import Iterable, Iterator
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import psutil

REAP_WAIT = 10.0  # upper bound for the kernel to reap a SIGKILLed process
STOP_ROUNDS = 1000  # listings of what a tree started while it was being stopped


def stat_fields(pid: int) -> list[bytes] | None:
    """/proc/PID/stat's fields after the command name: ``[0]`` is field 3 (the state),
    ``[k - 3]`` field k; None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2 :].split()


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat)."""
    fields = stat_fields(pid)
    return None if fields is None else int(fields[19])


def alive(p: psutil.Process) -> bool:
    """Running and not a zombie, and its pid not reused by another process since ``p``
    was made (psutil compares start times)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def exists(pid: int) -> bool:
    """Whether the kernel still has a process ``pid``: a zombie, or another user's
    process (one we may not signal), counts."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def environ(pid: int) -> set[bytes]:
    """The ``NAME=value`` entries of the environment ``pid`` was exec'd with
    (``/proc/PID/environ``, which its forks share); empty when it is gone or not ours to read."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return set(f.read().split(b"\0"))
    except OSError:
        return set()


def children(pid: int) -> list[int] | None:
    """Direct children from /proc/PID/task/*/children; None where the kernel lacks it."""
    kids: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                kids += map(int, f.read().split())
        except FileNotFoundError:
            return None  # no CONFIG_PROC_CHILDREN (or the task just ended: the caller retries)
        except OSError:
            continue
    return kids


def descendant_keys(spare: frozenset[int] = frozenset()) -> set[tuple[int, float]]:
    """(pid, start time) of every descendant of this process, except ``spare`` subtrees.

    Walks ``/proc/PID/task/*/children`` from this process down, so the cost grows
    with our descendants, not with every process on the machine (a busy CI host
    has thousands); psutil's full scan is the fallback.
    """
    keys: set[tuple[int, float]] = set()
    todo = [os.getpid()]
    while todo:
        kids = children(todo.pop())
        if kids is None:
            return _descendant_keys_psutil(spare)
        for kid in kids:
            start = start_time(kid)
            if start is not None and kid not in spare:
                keys.add((kid, float(start)))
                todo.append(kid)
    return keys


def _descendant_keys_psutil(spare: frozenset[int]) -> set[tuple[int, float]]:
    skip = set(spare)
    for pid in spare:
        with contextlib.suppress(psutil.Error):
            skip.update(p.pid for p in psutil.Process(pid).children(recursive=True))
    return {key(p) for p in psutil.Process().children(recursive=True) if p.pid not in skip}


def key(p: psutil.Process) -> tuple[int, float]:
    """What tells a process from a later one with its pid: (pid, start time); 0.0 gone."""
    start = start_time(p.pid)
    return (p.pid, float(start) if start is not None else 0.0)


def live_descendants() -> list[int]:
    """This process's running descendants; its exited children are reaped first."""
    with contextlib.suppress(ChildProcessError, OSError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    try:
        kids = psutil.Process().children(recursive=True)
    except psutil.Error:
        return []
    return [p.pid for p in kids if alive(p)]


def cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline()) or p.name()
    except psutil.Error:
        return "?"


def signal_group(pid: int, sig: int, extra: Iterable[psutil.Process] = ()) -> None:
    """Signal ``pid``'s process group (``pid`` alone before it made one) and ``extra``."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for p in extra:
        with contextlib.suppress(psutil.Error):
            p.send_signal(sig)


def kill_tree(pid: int) -> None:
    """Stop ``pid`` and every descendant (listing until none is new), then kill them all.

    For a process that never ran its test (a prewarmed one that is discarded): what it
    started, daemons included (it is a child subreaper until its go), goes with it.
    The caller reaps ``pid`` itself; the others are reaped here.
    """
    try:
        root = psutil.Process(pid)
        root.suspend()
    except psutil.Error:
        return
    tree: list[psutil.Process] = []
    seen = {pid}
    for _ in range(STOP_ROUNDS):
        try:
            new = [p for p in root.children(recursive=True) if p.pid not in seen]
        except psutil.Error:
            break
        if not new:
            break
        for p in new:
            seen.add(p.pid)
            with contextlib.suppress(psutil.Error):
                p.suspend()
        tree += new
    for p in (root, *tree):
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(tree, timeout=REAP_WAIT)


def pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when ``pid`` exits; None before Linux 5.3.

    Unlike ``multiprocessing``'s sentinel pipe, which every process the child forks
    inherits, it fires when the child itself exits, whatever its descendants do.
    """
    with contextlib.suppress(AttributeError, OSError):
        return os.pidfd_open(pid)
    return None


class Child:
    """A child process of ours that ``multiprocessing`` did not start (the fork server's
    forks): the subset of ``multiprocessing.Process`` we use."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.exitcode: int | None = None
        self.sentinel = None  # a pidfd serves instead

    def join(self, timeout: float | None = None) -> None:
        if self.exitcode is not None:
            return
        try:
            pid, status = os.waitpid(self.pid, 0 if timeout is None else os.WNOHANG)
        except ChildProcessError:
            self.exitcode = 255
            return
        if pid:
            self.exitcode = os.waitstatus_to_exitcode(status)


def reap(proc: Any, exited: Any, timeout: float = REAP_WAIT) -> bool:
    """Collect the exit status of our child ``proc`` (a ``Process`` or a ``Child``) once
    ``exited`` (its pidfd or sentinel) says it has exited, waiting up to ``timeout``.

    Returns whether it was reaped. ``Process.join(timeout)`` would wait on the sentinel
    pipe, which a forked grandchild may still hold; once the pidfd says the child
    exited, a blocking join is just ``waitpid`` on a zombie and returns at once.
    """
    if exited is not None and wait([exited], timeout):
        proc.join()
        return True
    proc.join(0)
    return proc.exitcode is not None


def reap_or_kill(proc: Any, exited: Any, patience: float, timeout: float = 5.0) -> None:
    """Reap our child ``proc`` (see ``reap``) if it exits within ``patience`` seconds;
    else SIGKILL it and reap it, waiting up to ``timeout``."""
    if not reap(proc, exited, patience):
        with contextlib.suppress(OSError):
            os.kill(proc.pid, signal.SIGKILL)
        reap(proc, exited, timeout)


def reap_pid(pid: int, timeout: float = 5.0) -> None:
    """Reap our child ``pid``, SIGKILLing it if it has not exited within ``timeout``."""
    fd = pidfd(pid)
    try:
        reap_or_kill(Child(pid), fd, timeout, timeout)
    finally:
        if fd is not None:
            os.close(fd)


def unlist(proc: Any) -> None:
    """Keep one of our spawned processes out of ``multiprocessing.active_children()``.

    A test (run in-process) that cleans up the children it sees there must not
    terminate the fork server or a prewarmed process. We wait for and reap them
    ourselves (pidfd, ``join``).
    """
    with contextlib.suppress(AttributeError, KeyError):
        multiprocessing.process._children.discard(proc)  # type: ignore[attr-defined]


@contextlib.contextmanager
def main_not_rerun() -> Iterator[None]:
    """While starting a spawned process: it must not re-run this process's ``__main__``.

    multiprocessing re-runs the parent's main script in every spawned child (as
    ``__mp_main__``) so that functions defined there unpickle. pytest's processes need
    nothing from it, and re-running it is harmful: a ``run_tests.py`` calling
    ``pytest.main()`` without a ``__name__`` guard would start pytest again in every
    test's process, and a script read from stdin (``python -``) cannot be re-run at all.
    The preparation data is taken inside ``start()``, so a bare ``__main__`` is in
    place only for that call.
    """
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def dump_stack(pid: int, signum: int, stack_file: Path, timeout: float = 2.0) -> str:
    """Send ``signum`` to a process whose faulthandler dumps its threads' stacks into
    ``stack_file`` on it, and read the dump back (waiting at most ``timeout`` seconds)."""
    return dump_stacks([(pid, stack_file)], signum, timeout)[0]


def dump_stacks(targets: list[tuple[int, Path]], signum: int, timeout: float = 2.0) -> list[str]:
    """``dump_stack`` for several processes at once: every one asked before any is waited
    for (a group's N stuck ranks cost one wait, not N)."""
    texts = [""] * len(targets)
    sizes = {}
    for i, (pid, _) in enumerate(targets):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
            sizes[i] = -1
    deadline = time.monotonic() + timeout
    # faulthandler writes from the signal handler without any notification;
    # the only way to know it is done is that the file stopped growing.
    while sizes and time.monotonic() < deadline:
        time.sleep(0.05)
        for i in list(sizes):
            texts[i] = targets[i][1].read_text(errors="replace")
            if texts[i] and len(texts[i]) == sizes[i]:
                del sizes[i]
            else:
                sizes[i] = len(texts[i])
    return [text.strip() for text in texts]


def kernel_waits(pid: int) -> str:
    """Where each thread of ``pid`` is in the kernel, one line a thread: its id, name,
    state and wait channel (/proc/PID/task/TID: ``wchan``, e.g. ``futex_wait_queue``
    for a lock or a condition, ``do_epoll_wait`` or ``unix_stream_read_generic`` for a
    socket): what a Python stack cannot say of a thread in C code (a collective).
    Empty where /proc cannot be read."""
    lines = []
    try:
        tids = sorted(os.listdir(f"/proc/{pid}/task"), key=int)
    except (OSError, ValueError):
        return ""
    for tid in tids:
        task = f"/proc/{pid}/task/{tid}"
        try:
            with open(f"{task}/stat", "rb") as f:
                stat = f.read()
            with open(f"{task}/wchan") as f:
                wchan = f.read().strip()
        except OSError:
            continue
        name = stat[stat.index(b"(") + 1 : stat.rindex(b")")].decode(errors="replace")
        state = stat[stat.rindex(b")") + 2 :].split()[0].decode()
        where = f", waiting in {wchan}" if wchan not in ("", "0") else ""
        lines.append(f"  thread {tid} ({name}): state {state}{where}")
    if not lines:
        return ""
    return "Threads in the kernel (/proc/PID/task/*/wchan):\n" + "\n".join(lines)


@contextlib.contextmanager
def exec_environment(extra: dict[str, str]) -> Iterator[None]:
    """Variables the new process must have when it is exec'd (LD_PRELOAD of a probe).

    ``spawn`` execs the interpreter with this process's environment, and setting
    them later, in the child, would be too late for the dynamic linker.
    """
    saved = {name: os.environ.get(name) for name in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def ensure_resource_tracker() -> None:
    """multiprocessing's resource tracker, started now: a long-lived helper of ours."""
    with contextlib.suppress(Exception):
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
