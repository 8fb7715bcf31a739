"""Driving the native lease table from real processes: lease clients in their own
processes, the table's private layout (for the tests that forge or lock entries), and
waiting helpers. Used by the lease table's tests and the tests built on it."""

from __future__ import annotations

import ctypes
import mmap
import multiprocessing
import os
import resource
import signal
import time
from multiprocessing.connection import Connection
from typing import Any

import psutil
import pytest
from pytest_gpuiso._lease import (
    MAX_DEVICES,
    MAX_SLOTS,
    REGION_SIZE,
    Region,
)

from tests.helpers import wait_until  # noqa: F401 (used by the tests built on this)

CONTEXTS = ["fork", "spawn"]
GIB = 1 << 30
START_TIMEOUT = 60.0  # a spawned interpreter on a loaded 2-core machine
PROMPT = 2.0  # "at once", with room for a loaded CI machine; the design target is 0.1 s

# Private layout of region_t (x86_64, glibc's 40-byte pthread_mutex_t), used only by
# the tests that forge or lock entries directly; they skip if the layout moved.
MUTEX_OFFSET = 24  # magic u64, abi u32, size u32, bell u64
ABI_OFFSET = 8
NDEVICES_OFFSET = 80  # ... lock, next_ticket u64, next_lease u64
DEV_OFFSET = 96  # ... ndevices u32, generation u32, next_key u32, pad u32
SLOT_OFFSET = 72  # name[64], capacity u64
SLOT_SIZE = 240  # owner {pid i32, key u32, start u64, ns u64}, lease u64, amount u64,
# since_ns i64, label[192]
DEVICE_SIZE = SLOT_OFFSET + MAX_SLOTS * SLOT_SIZE + 8 + 192  # quarantined_ns i64, why[192]
WAITER_SIZE = 256
LAYOUT_KNOWN = REGION_SIZE == DEV_OFFSET + MAX_DEVICES * DEVICE_SIZE + 256 * WAITER_SIZE
needs_layout = pytest.mark.skipif(
    not LAYOUT_KNOWN, reason="region_t layout changed; update the offsets in this test"
)


# ----------------------------------------------------------------------------- helpers


def waiting_pids(region: Region) -> set[int]:
    return {w["pid"] for w in region.snapshot()["waiters"]}


def held_by(snapshot: dict[str, Any], pid: int) -> list[str]:
    """Devices on which `pid` holds a slot in `snapshot`."""
    return sorted(h["device"] for h in snapshot["holders"] if h["pid"] == pid)


def cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


class Interrupted(Exception):
    """Raised by a client's SIGUSR1 handler, to interrupt a blocked acquire."""


def _raise_interrupted(signum: int, frame: object) -> None:
    raise Interrupted(f"signal {signum}")


def _client_main(path: str, conn: Connection) -> None:
    """A process that attaches to the table at `path` and runs lease calls on command."""
    signal.signal(signal.SIGUSR1, _raise_interrupted)
    region = Region(path)
    fds: list[int] = []
    conn.send(("ready", os.getpid()))
    while True:
        try:
            op, *args = conn.recv()
        except EOFError:
            return
        if op == "acquire":
            devices, slots, n, label, timeout, memory = args
            called = time.monotonic()
            try:
                got = region.acquire(devices, slots, n, label, timeout, **memory)
            except Exception as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}", called, time.monotonic()))
            else:
                conn.send(("acquired", got, called, time.monotonic()))
        elif op == "release":
            conn.send(("released", region.release(args[0])))
        elif op == "exhaust_fds":
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 128), hard))
            try:
                while True:
                    fds.append(os.open("/dev/null", os.O_RDONLY))
            except OSError as exc:
                conn.send(("exhausted", exc.errno))
        elif op == "exit_without_release":
            os._exit(0)


class Client:
    """Drives one `_client_main` process through a pipe."""

    def __init__(self, context: str, path: str) -> None:
        ctx = multiprocessing.get_context(context)
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_client_main, args=(path, child), daemon=True)
        self.process.start()
        child.close()

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def wait_ready(self) -> None:
        assert self.reply(START_TIMEOUT) == ("ready", self.pid)

    def send(self, *msg: Any) -> None:
        self.conn.send(msg)

    def reply(self, timeout: float = 10.0) -> tuple[Any, ...]:
        if not self.conn.poll(timeout):
            raise AssertionError(f"client {self.pid} did not answer within {timeout} s")
        return self.conn.recv()

    def answered(self, within: float) -> bool:
        return self.conn.poll(within)

    def start_acquire(
        self,
        devices: list[str],
        slots: int,
        n: int,
        label: str,
        timeout: float | None = None,
        **memory: Any,
    ) -> None:
        """``memory``: Region.acquire's amount= and capacities=."""
        self.send("acquire", devices, slots, n, label, timeout, memory)

    def acquire(
        self,
        devices: list[str],
        slots: int,
        n: int,
        label: str,
        timeout: float | None = None,
        **memory: Any,
    ) -> tuple[int, list[str]] | None:
        """Acquire and return what Region.acquire returned (fails on an exception)."""
        self.start_acquire(devices, slots, n, label, timeout, **memory)
        return self.granted(timeout=(timeout or 10.0) + 10.0)

    def granted(self, timeout: float = 10.0) -> tuple[int, list[str]] | None:
        kind, result, *_ = self.reply(timeout)
        assert kind == "acquired", result
        return None if result is None else (result[0], list(result[1]))

    def release(self, lease: int) -> int:
        self.send("release", lease)
        kind, freed = self.reply()
        assert kind == "released"
        return freed

    def kill(self) -> None:
        """SIGKILL (never a reaped pid: multiprocessing checks that it has not reaped it)."""
        if self.process.exitcode is None:
            self.process.kill()


def max_overlap(intervals: list[tuple[float, float, int]]) -> int:
    """The most weight open at one instant (an end and a start at the same time don't meet)."""
    edges = sorted(
        [(s, w) for s, e, w in intervals if e > s] + [(e, -w) for s, e, w in intervals if e > s]
    )
    depth = most = 0
    for _, delta in edges:
        depth += delta
        most = max(most, depth)
    return most


def slot_offset(row: int, slot: int) -> int:
    return DEV_OFFSET + row * DEVICE_SIZE + SLOT_OFFSET + slot * SLOT_SIZE


def lock_table_mutex(path: str, conn: Connection) -> mmap.mmap:
    """Take the table's mutex behind its back (its private layout) and send the result.
    The caller keeps the mapping while it holds the lock: unmapped, the robust mutex is
    off the kernel's list, and the holder's death would not release it."""
    fd = os.open(path, os.O_RDWR)
    mapping = mmap.mmap(fd, REGION_SIZE)
    mutex = ctypes.c_char.from_buffer(mapping, MUTEX_OFFSET)
    libc = ctypes.CDLL(None, use_errno=True)
    conn.send(libc.pthread_mutex_lock(ctypes.c_void_p(ctypes.addressof(mutex))))
    return mapping


def lock_table_mutex_and_sleep(path: str, conn: Connection) -> None:
    mapping = lock_table_mutex(path, conn)
    time.sleep(120)
    mapping.close()
