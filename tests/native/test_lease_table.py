"""The native GPU lease table (native/gpuiso_lease.c) under real processes.

Every test attaches to a fresh table file under its tmp_path (never the user's
/dev/shm table) and drives it from separate processes, started with `fork`
and, where the start method could matter (inherited mappings, fds and the
cached owner identity), with `spawn` too. Holders are SIGKILLed at chosen or
random moments. What is proven:

- a device never has more holders than slots, a grant is all-or-nothing, and
  every process that is not killed finishes (random schedules, hypothesis);
- concurrent first attaches publish exactly one complete, private table;
- bad table files give a one-line RegionError and are left untouched;
- a dead holder (SIGKILL, zombie, or exit without release, or a live pid with
  another start time) is reaped, and a waiter is woken at once, not polled;
- waiters are served FIFO and whole; timeouts and interrupts leave no entry.

Each bug the native code had is kept here as a regression test.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import random
import re
import signal
import stat
import struct
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psutil
import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st
from pytest_gpuiso._lease import (
    ABI_VERSION,
    MAGIC,
    MAX_DEVICES,
    MAX_SLOTS,
    REGION_SIZE,
    WHOLE,
    Region,
    RegionError,
)

from tests.helpers.lease_table import (
    ABI_OFFSET,
    CONTEXTS,
    GIB,
    PROMPT,
    START_TIMEOUT,
    Client,
    cpu_seconds,
    held_by,
    lock_table_mutex_and_sleep,
    max_overlap,
    needs_layout,
    slot_offset,
    wait_until,
    waiting_pids,
)


def run_in_child(target: Callable[..., None], *args: Any, timeout: float = 20.0) -> Any:
    """Run `target(*args, conn)` in a forked process; return what it sent, fail on a crash."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=target, args=(*args, child), daemon=True)
    process.start()
    child.close()
    try:
        if not parent.poll(timeout):
            raise AssertionError(f"{target.__name__} hung (no answer in {timeout} s)")
        result = parent.recv()
        process.join(timeout)
        assert process.exitcode == 0, f"{target.__name__} exited with {process.exitcode}"
        return result
    finally:
        if process.exitcode is None:
            process.kill()
        process.join(5)


# ----------------------------------------------------------------------- random schedules


@dataclass(frozen=True)
class Step:
    n: int
    hold_ms: int
    pause_ms: int
    timeout: float | None
    gib: int = 0  # memory leases: GiB on each GPU (0: a 1/slots share)


@dataclass(frozen=True)
class Schedule:
    context: str
    devices: list[str]
    slots: int
    workers: list[list[Step]]
    kills: dict[int, float]  # worker index -> seconds after the start
    capacity_gib: int = 0  # memory leases on devices of this size (0: slots, size unknown)

    def memory(self, gib: int) -> dict[str, Any]:
        """Region.acquire's memory arguments for a step of ``gib`` (none in slot mode)."""
        if not self.capacity_gib:
            return {}
        return {"amount": gib * GIB, "capacities": [self.capacity_gib * GIB] * len(self.devices)}

    def weight(self, step: Step) -> int:
        """What a grant of ``step`` takes of each device: GiB, or one of the slots."""
        return step.gib if self.capacity_gib else 1

    @property
    def room(self) -> int:
        return self.capacity_gib or self.slots


@st.composite
def schedules(draw: st.DrawFn) -> Schedule:
    devices = draw(st.sampled_from([["0", "1"], ["0", "1", "2"]]))
    slots = draw(st.integers(1, 2))
    capacity = draw(st.sampled_from([0, 0, 4, 16]))  # half the examples: memory leases
    step = st.builds(
        Step,
        n=st.integers(1, len(devices)),
        hold_ms=st.integers(0, 30),
        pause_ms=st.integers(0, 10),
        timeout=st.sampled_from([None, None, None, 0.0, 0.03]),
        gib=st.integers(1, capacity) if capacity else st.just(0),
    )
    workers = draw(st.lists(st.lists(step, min_size=2, max_size=6), min_size=3, max_size=5))
    kills = draw(
        st.dictionaries(
            st.integers(0, len(workers) - 1),
            st.floats(0.0, 0.2),
            min_size=1,
            max_size=len(workers) - 1,
        )
    )
    context = draw(st.sampled_from(["fork", "fork", "spawn"]))
    return Schedule(context, devices, slots, workers, kills, capacity)


def _schedule_worker(
    path: str,
    log_path: str,
    index: int,
    schedule: Schedule,
    steps: list[Step],
    conn: Connection,
) -> None:
    """Run one worker's steps, logging what it believes it holds, one write(2) per line.

    "A" is stamped after acquire() returned and "R" before release() is called, so
    the logged interval lies inside the real one: an overlap in the log is real.
    """
    region = Region(path)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    conn.send("ready")
    conn.recv()  # go
    for i, step in enumerate(steps):
        label = f"w{index}s{i}n{step.n}"
        memory = schedule.memory(step.gib)
        got = region.acquire(
            schedule.devices, schedule.slots, step.n, label, step.timeout, **memory
        )
        if got is None:
            os.write(log, f"T {i}\n".encode())
        else:
            lease, names = got
            os.write(log, f"A {i} {lease} {','.join(names)} {time.monotonic()!r}\n".encode())
            time.sleep(step.hold_ms / 1000)
            os.write(log, f"R {i} {lease} {time.monotonic()!r}\n".encode())
            os.write(log, f"F {i} {region.release(lease)}\n".encode())
        time.sleep(step.pause_ms / 1000)
    os.write(log, b"DONE\n")


def check_snapshot(
    snap: dict[str, Any], schedule: Schedule, pids: list[int], killed: frozenset[int] = frozenset()
) -> None:
    """What must hold in every snapshot: slots respected, whole grants, one lease a worker.

    The table is copied under its lock, but each entry's `alive` is read from /proc
    afterwards, one entry at a time: a worker that dies meanwhile can show as alive
    on one device and dead on the next. So a lease counts as live when any of its
    entries is alive (its owner was alive when the copy was taken), and then all its
    entries, alive or not, must be in the copy.

    Except for a worker already sent SIGKILL (pids in ``killed``): the kernel hands its
    robust mutex on (EOWNERDEAD) while the worker is still exiting, before it drops its
    key's lock and becomes a zombie, so a grant it was writing when killed can be copied
    cut short while its entries still read as alive. Such a lease may cover fewer than
    n devices (never more, never another's); capacity and slots are checked as ever.
    """
    rows = [name for name, _, _ in snap["devices"] if name]
    assert len(rows) == len(set(rows)) and set(rows) <= set(schedule.devices), snap
    # Rows are counted only when complete, so even a creator killed while adding one
    # leaves none without a name or its size (0: unknown, shares of 10^6 units).
    size = schedule.capacity_gib * GIB
    assert all(name and capacity == size for name, capacity, _ in snap["devices"]), snap
    assert all(used <= (size or WHOLE) for _, _, used in snap["devices"]), snap
    if size:
        per_device = Counter()
        for h in snap["holders"]:
            per_device[h["device"]] += h["amount"]
        assert all(total <= size for total in per_device.values()), snap
    else:
        per_device = Counter(h["device"] for h in snap["holders"])
        assert all(count <= schedule.slots for count in per_device.values()), snap
    by_lease: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for holder in snap["holders"]:
        by_lease[holder["lease"]].append(holder)
    leases_of_pid: Counter[int] = Counter()
    for lease, entries in by_lease.items():
        if not any(e["alive"] for e in entries):
            continue  # a killed worker's leftovers, possibly a grant cut short
        label = entries[0]["label"]
        worker, n = int(label[1 : label.index("s")]), int(label.split("n")[1])
        assert {e["pid"] for e in entries} == {pids[worker]}, (lease, entries)
        assert all(e["label"] == label for e in entries), entries
        devices = [e["device"] for e in entries]
        whole = len(devices) == n or (pids[worker] in killed and len(devices) < n)
        assert len(devices) == len(set(devices)) and whole, f"lease {lease} of n={n}: {entries}"
        leases_of_pid[pids[worker]] += 1
    assert all(count == 1 for count in leases_of_pid.values()), snap
    waiting = {w["pid"] for w in snap["waiters"] if w["alive"] and w["pid"] not in killed}
    assert not waiting & set(leases_of_pid), f"waiting while holding: {snap}"
    assert waiting <= set(pids), snap


_example_ids = itertools.count()


@settings(
    max_examples=25,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],  # timing-dependent: no shrinking
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(schedule=schedules())
def test_random_schedules_with_kills_never_oversubscribe_and_survivors_finish(
    tmp_path: Path, schedule: Schedule
) -> None:
    """3-5 worker processes acquire (n of 2-3 devices, 1-2 slots or, in half the examples,
    1..C GiB on devices of C = 4 or 16 GiB; some with timeouts), hold, release, while the
    driver SIGKILLs some at random moments and snapshots the table continuously. Safety:
    in every snapshot each device has <= slots holders (<= C GiB leased),
    every live lease covers exactly its n distinct devices, no worker holds two leases
    or waits while holding; from the workers' own logs, no instant had more than
    `slots` processes believing they held one device. Liveness: every worker not
    killed finishes all its steps within 30 s, and after the run the whole table can
    be taken at once (dead entries do not leak slots).
    """
    base = tmp_path / f"example-{next(_example_ids)}"
    base.mkdir()
    path = str(base / "leases")
    region = Region(path)
    ctx = multiprocessing.get_context(schedule.context)
    procs: list[Any] = []
    conns: list[Connection] = []
    killed_at: dict[int, float] = {}
    snapshots = 0
    try:
        for i, steps in enumerate(schedule.workers):
            parent, child = ctx.Pipe()
            log = str(base / f"w{i}.log")
            args = (path, log, i, schedule, steps, child)
            proc = ctx.Process(target=_schedule_worker, args=args, daemon=True)
            proc.start()
            child.close()
            procs.append(proc)
            conns.append(parent)
        for i, conn in enumerate(conns):
            assert conn.poll(START_TIMEOUT), f"worker {i} did not start"
            assert conn.recv() == "ready"
        pids = [proc.pid for proc in procs]
        for conn in conns:
            conn.send("go")
        start = time.monotonic()
        plan = sorted((start + delay, i) for i, delay in schedule.kills.items())
        while True:
            now = time.monotonic()
            while plan and plan[0][0] <= now:
                _, i = plan.pop(0)
                if procs[i].exitcode is None:
                    killed_at[i] = time.monotonic()
                    procs[i].kill()
            snap = region.snapshot()
            snapshots += 1
            check_snapshot(snap, schedule, pids, frozenset(pids[i] for i in killed_at))
            if not plan and all(proc.exitcode is not None for proc in procs):
                break
            assert now - start < 30, f"workers still running after 30 s: {snap}"
            time.sleep(0.002)
    finally:
        for proc in procs:
            if proc.exitcode is None:
                proc.kill()
        for proc in procs:
            proc.join(10)
        for conn in conns:
            conn.close()

    per_device: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    for i, (proc, steps) in enumerate(zip(procs, schedule.workers, strict=True)):
        lines = Path(base / f"w{i}.log").read_text().splitlines()
        if proc.exitcode == -signal.SIGKILL:
            assert i in killed_at, f"worker {i} died of SIGKILL nobody sent"
            event(
                "a worker was killed while "
                + ("holding" if lines[-1:] and lines[-1][0] == "A" else "waiting or between leases")
            )
        else:
            assert proc.exitcode == 0, f"worker {i} exited with {proc.exitcode}: {lines}"
            assert lines[-1] == "DONE", f"worker {i} did not finish: {lines}"
        opened: dict[int, tuple[float, list[str]]] = {}
        done_steps = 0
        for line in lines:
            kind, *fields = line.split()
            if kind == "A":
                step, names, t = int(fields[0]), fields[2].split(","), float(fields[3])
                assert len(names) == len(set(names)) == steps[step].n, line
                assert set(names) <= set(schedule.devices), line
                opened[step] = (t, names)
            elif kind == "R":
                t_acquired, names = opened.pop(int(fields[0]))
                weight = schedule.weight(steps[int(fields[0])])
                for name in names:
                    per_device[name].append((t_acquired, float(fields[2]), weight))
            elif kind == "F":
                assert int(fields[1]) == steps[int(fields[0])].n, f"worker {i}: {line}"
                done_steps += 1
            elif kind == "T":
                assert steps[int(fields[0])].timeout is not None, line
                done_steps += 1
                event("an acquire timed out")
        if proc.exitcode == 0:
            assert done_steps == len(steps), lines
        for step, (t_acquired, names) in opened.items():  # killed while holding
            for name in names:
                per_device[name].append((t_acquired, killed_at[i], schedule.weight(steps[step])))
    for name, intervals in per_device.items():
        assert max_overlap(intervals) <= schedule.room, (name, sorted(intervals))

    if any(not name for name, _, _ in region.snapshot()["devices"]):
        event("a killed worker left a nameless device row (native bug)")
    everything = region.acquire(
        schedule.devices,
        schedule.slots,
        len(schedule.devices),
        "end",
        5,
        **schedule.memory(schedule.capacity_gib),
    )
    assert everything is not None, f"slots leaked: {region.snapshot()}"
    assert region.snapshot()["waiters"] == []
    assert region.release(everything[0]) == len(schedule.devices)
    event(f"context {schedule.context}")
    event("memory leases" if schedule.capacity_gib else "slots")
    event(f"killed {len(killed_at)} of {len(procs)} workers")
    assert snapshots > 0


# ---------------------------------------------------------------------------- creation


def _attach_race_worker(paths: list[str], barrier: Any, results: Any, index: int) -> None:
    for round_, path in enumerate(paths):
        barrier.wait(60)
        try:
            region = Region(path)
            got = region.acquire(["0"], 1, 1, f"racer {index}", 30)
            assert got is not None, "no lease within 30 s"
            results.put((round_, got[0], region.release(got[0]), None))
        except Exception as exc:
            results.put((round_, None, 0, f"{type(exc).__name__}: {exc}"))


@pytest.mark.parametrize("context", CONTEXTS)
def test_concurrent_first_attach_publishes_one_private_complete_table(
    tmp_path: Path, context: str
) -> None:
    """8 processes released together by a barrier attach to a table that does not
    exist yet, then each acquires and releases once; repeated over fresh paths. All
    succeed on one shared table (8 distinct lease ids), which is a 0600 regular file
    of REGION_SIZE bytes, and no `*.init` temp file is left behind.
    """
    processes, rounds = 8, 6
    paths = [str(tmp_path / f"leases-{r}") for r in range(rounds)]
    ctx = multiprocessing.get_context(context)
    barrier = ctx.Barrier(processes)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_attach_race_worker, args=(paths, barrier, results, i), daemon=True)
        for i in range(processes)
    ]
    try:
        for proc in procs:
            proc.start()
        outcomes = [results.get(timeout=START_TIMEOUT) for _ in range(processes * rounds)]
        for proc in procs:
            proc.join(30)
            assert proc.exitcode == 0
    finally:
        for proc in procs:
            if proc.exitcode is None:
                proc.kill()
            proc.join(5)
    assert [error for *_, error in outcomes if error] == []
    for round_, path in enumerate(paths):
        leases = [lease for r, lease, _, _ in outcomes if r == round_]
        assert sorted(leases) == list(range(1, processes + 1)), (path, leases)
        assert all(freed == 1 for r, _, freed, _ in outcomes if r == round_)
        info = os.stat(path, follow_symlinks=False)
        assert stat.S_ISREG(info.st_mode)
        assert stat.S_IMODE(info.st_mode) == 0o600
        assert info.st_size == REGION_SIZE
        assert info.st_nlink == 1
        assert Region(path).snapshot() == {
            "devices": [("0", 0, 0)],
            "holders": [],
            "waiters": [],
            "quarantined": [],
        }
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in paths)


def _attach_and_report(path: str, conn: Connection) -> None:
    try:
        Region(path)
    except Exception as exc:
        conn.send((type(exc).__name__, str(exc)))
    else:
        conn.send(("attached", ""))


def _write_private(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, data)
    os.fchmod(fd, 0o600)
    os.close(fd)


def _garbage(path: str) -> None:
    data = bytearray(os.urandom(REGION_SIZE))
    data[:8] = b"notmagic"
    _write_private(path, bytes(data))


def _other_abi(path: str) -> None:
    Region(path)
    with open(path, "r+b") as f:
        f.seek(ABI_OFFSET)
        f.write(struct.pack("<I", ABI_VERSION + 1))


def _group_readable(path: str) -> None:
    Region(path)
    os.chmod(path, 0o644)


def _symlink(path: str) -> None:
    Region(path + ".real")
    os.symlink(path + ".real", path)


NOT_A_TABLE = r"is not a pytest-gpuiso lease table \(no lease-table header\): choose another path"
HEAD = MAGIC.to_bytes(8, sys.byteorder)  # what every table starts with

BAD_FILES: list[tuple[str, Callable[[str], None], str]] = [
    ("garbage", _garbage, NOT_A_TABLE),  # never "reset it": reset --force leaves it alone
    ("zeros", lambda p: _write_private(p, bytes(REGION_SIZE)), NOT_A_TABLE),
    ("short", lambda p: _write_private(p, b"x" * 100), NOT_A_TABLE),
    ("empty", lambda p: _write_private(p, b""), NOT_A_TABLE),
    ("long", lambda p: _write_private(p, bytes(REGION_SIZE + 1)), NOT_A_TABLE),
    (
        "table-of-another-size",
        lambda p: _write_private(p, HEAD + bytes(92)),
        rf"has 100 bytes, this pytest-gpuiso expects {REGION_SIZE} .*reset it with",
    ),
    (
        "header-scribbled",
        lambda p: _write_private(p, HEAD + bytes(REGION_SIZE - 8)),
        r"is corrupted \(bad header\); reset it with `python -m pytest_gpuiso reset",
    ),
    (
        "abi",
        _other_abi,
        rf"has ABI version {ABI_VERSION + 1}, this pytest-gpuiso expects {ABI_VERSION}; reset",
    ),
    (
        "mode-0644",
        _group_readable,
        r"is not a private file of uid \d+ \(mode 0600\), so not a lease table of this user",
    ),
    ("symlink", _symlink, r"cannot open the lease region .*: Too many levels of symbolic links"),
    ("directory", os.mkdir, r"cannot open the lease region .*: Is a directory"),
]


@pytest.mark.parametrize(
    ("make", "message"), [case[1:] for case in BAD_FILES], ids=[case[0] for case in BAD_FILES]
)
def test_bad_table_file_gives_one_line_region_error_and_is_left_alone(
    tmp_path: Path, make: Callable[[str], None], message: str
) -> None:
    """A table file that is corrupted (bad magic), of the wrong size, of another ABI
    version, readable by others, a symlink or a directory makes Region(path) raise
    RegionError with a one-line message naming the path and the problem; the
    attaching process neither hangs nor crashes, and the file is not modified.
    """
    path = str(tmp_path / "leases")
    make(path)
    before = Path(path).read_bytes() if os.path.isfile(path) else None
    kind, text = run_in_child(_attach_and_report, path)
    assert kind == "RegionError", text
    assert "\n" not in text
    assert path in text
    assert re.search(message, text), text
    if before is not None:
        assert Path(path).read_bytes() == before


# --------------------------------------------------------------------------- dead holders


@pytest.mark.parametrize("context", CONTEXTS)
def test_killed_holder_hands_the_slot_to_a_waiter_at_once(
    clients: Callable[..., Client], region: Region, context: str
) -> None:
    """A holds the only slot; B waits (blocked in poll); A is SIGKILLed. B gets the
    slot without any timeout elapsing: woken by A's pidfd, measured from just before
    the kill to B's acquire() returning, over 5 rounds (< 2 s each; target 0.1 s).
    """
    waiter = clients(context)
    latencies = []
    for round_ in range(5):
        holder = clients(context)
        assert holder.acquire(["0"], 1, 1, f"holder {round_}") is not None
        waiter.start_acquire(["0"], 1, 1, f"waiter {round_}")
        wait_until(lambda: waiter.pid in waiting_pids(region), "B to queue")
        assert not waiter.answered(0.1)  # B really waits, and is in poll() by now
        before_kill = time.monotonic()
        holder.kill()
        got = waiter.reply(10)
        assert got[0] == "acquired" and got[1][1] == ["0"], got
        latencies.append(got[3] - before_kill)
        assert held_by(region.snapshot(), holder.pid) == []
        assert waiter.release(got[1][0]) == 1
    print(
        f"\n{context}: dead holder -> waiter latency (s): "
        + " ".join(f"{x:.4f}" for x in latencies)
    )
    assert max(latencies) < PROMPT, latencies


@pytest.mark.parametrize("reaped", [True, False], ids=["reaped", "zombie"])
def test_killed_holder_is_reaped_by_the_next_acquire(
    clients: Callable[..., Client], region: Region, reaped: bool
) -> None:
    """A holds the only slot and is SIGKILLed while nobody waits. A later acquire
    (timeout=0, so it may not wait at all) succeeds at once, whether A has been
    reaped by its parent or is still a zombie, and A's entry is gone.
    """
    later = clients()
    holder = clients()
    assert holder.acquire(["0"], 1, 1, "doomed") is not None
    holder.kill()
    if reaped:
        holder.process.join(10)
    else:
        wait_until(
            lambda: psutil.Process(holder.pid).status() == psutil.STATUS_ZOMBIE, "A to be a zombie"
        )
    assert [h["alive"] for h in region.snapshot()["holders"]] == [False]
    got = later.acquire(["0"], 1, 1, "next", timeout=0)
    assert got is not None and got[1] == ["0"]
    assert [h["pid"] for h in region.snapshot()["holders"]] == [later.pid]
    if not reaped:
        assert psutil.Process(holder.pid).status() == psutil.STATUS_ZOMBIE


def test_holder_that_exits_without_releasing_is_reaped(
    clients: Callable[..., Client], region: Region
) -> None:
    """A forked holder that exits normally (os._exit) without releasing, and is reaped
    (its pid free for reuse), leaves an entry that no longer counts: an acquire with
    timeout=0 succeeds at once and the old pid disappears from the snapshot.
    """
    holder = clients()
    assert holder.acquire(["0", "1"], 1, 2, "leaver") is not None
    holder.send("exit_without_release")
    holder.process.join(10)
    assert holder.process.exitcode == 0
    started = time.monotonic()
    got = region.acquire(["0", "1"], 1, 2, "next", 0)
    assert got is not None and sorted(got[1]) == ["0", "1"]
    assert time.monotonic() - started < PROMPT
    snap = region.snapshot()
    assert holder.pid not in {h["pid"] for h in snap["holders"]}
    assert {h["pid"] for h in snap["holders"]} == {os.getpid()}


@needs_layout
def test_live_pid_with_another_start_time_is_not_the_owner(
    clients: Callable[..., Client], region: Region, region_path: str
) -> None:
    """PID reuse: an entry whose pid is a live process but whose recorded start time
    differs (forged in the file) is a dead owner. It shows as not alive, and another
    process takes the slot at once, while the pid's real process is still running.
    """
    holder = clients()
    assert holder.acquire(["0"], 1, 1, "original") is not None
    [entry] = region.snapshot()["holders"]
    offset = slot_offset(0, entry["slot"])
    fd = os.open(region_path, os.O_RDWR)
    try:
        pid, _, start = struct.unpack("<iIQ", os.pread(fd, 16, offset))
        assert (pid, start) == (entry["pid"], entry["start"]), "layout mismatch"
        os.pwrite(fd, struct.pack("<Q", start + 1), offset + 8)
    finally:
        os.close(fd)
    assert [h["alive"] for h in region.snapshot()["holders"]] == [False]
    assert psutil.pid_exists(holder.pid)
    got = region.acquire(["0"], 1, 1, "newcomer", 0)
    assert got is not None
    assert [h["pid"] for h in region.snapshot()["holders"]] == [os.getpid()]


@needs_layout
def test_process_killed_inside_the_table_lock_does_not_wedge_it(
    clients: Callable[..., Client], region: Region, region_path: str
) -> None:
    """A process SIGKILLed while it holds the table's robust mutex: a client blocked
    on that mutex in acquire() gets it (EOWNERDEAD, made consistent) at once, and
    the table keeps working for everyone.
    """
    region.acquire(["0"], 1, 1, "create row", 0)
    region.clear()
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    locker = ctx.Process(target=lock_table_mutex_and_sleep, args=(region_path, child), daemon=True)
    locker.start()
    try:
        assert parent.poll(10) and parent.recv() == 0
        client = clients()
        client.start_acquire(["0"], 1, 1, "behind the lock", 30)
        assert not client.answered(0.3), "acquire went through a locked table"
        before_kill = time.monotonic()
        locker.kill()
        kind, got, _, returned = client.reply(10)
        assert kind == "acquired" and got is not None, got
        print(f"\nlock owner killed -> blocked acquire latency: {returned - before_kill:.4f} s")
        assert returned - before_kill < PROMPT
        assert held_by(region.snapshot(), client.pid) == ["0"]
        assert client.release(got[0]) == 1
    finally:
        locker.kill()
        locker.join(5)


# ------------------------------------------------------------------------ fairness, api


def test_multi_gpu_waiter_is_served_whole_and_before_a_later_single_gpu_waiter(
    clients: Callable[..., Client], region: Region
) -> None:
    """Devices 0,1 with one slot each. H holds 0; W2 queues for both (n=2), then W1
    for one of them (n=1). W1 must not take the free device 1 ahead of W2; when H
    releases, W2 gets both at once (never one of them alone, in any snapshot), and W1
    gets a device only after W2 releases.
    """
    holder, w2, w1 = clients(), clients(), clients()
    both = ["0", "1"]
    assert holder.acquire(["0"], 1, 1, "H") is not None
    w2.start_acquire(both, 1, 2, "W2")
    wait_until(lambda: w2.pid in waiting_pids(region), "W2 to queue")
    w1.start_acquire(both, 1, 1, "W1")
    wait_until(lambda: w1.pid in waiting_pids(region), "W1 to queue")
    tickets = {w["pid"]: w["ticket"] for w in region.snapshot()["waiters"]}
    assert tickets[w2.pid] < tickets[w1.pid]
    assert not w1.answered(0.3), "W1 overtook the earlier two-GPU request"
    snap = region.snapshot()
    assert [(h["device"], h["pid"]) for h in snap["holders"]] == [("0", holder.pid)]

    def watch_until(done: Callable[[], bool], what: str) -> dict[str, Any]:
        deadline = time.monotonic() + 10
        while True:
            snap = region.snapshot()
            assert len(held_by(snap, w2.pid)) in (0, 2), f"W2 holds a part: {snap}"
            if done():
                return snap
            assert time.monotonic() < deadline, f"gave up waiting for {what}: {snap}"

    holder.send("release", 1)
    watch_until(lambda: w2.answered(0), "W2's grant")
    assert holder.reply() == ("released", 1)
    kind, got2, _, w2_time = w2.reply()
    assert kind == "acquired" and sorted(got2[1]) == both
    snap = region.snapshot()
    assert held_by(snap, w2.pid) == both and held_by(snap, w1.pid) == []
    assert not w1.answered(0.3), "W1 got a device W2 holds"
    assert w2.release(got2[0]) == 2
    kind, got1, _, w1_time = w1.reply()
    assert kind == "acquired" and len(got1[1]) == 1 and w2_time < w1_time
    assert region.snapshot()["waiters"] == []


def test_a_killed_earlier_waiter_unblocks_a_later_one_at_once(
    clients: Callable[..., Client], region: Region
) -> None:
    """H holds 0; E queues for 0 and 1 (n=2); L queues for 1, which is free but
    reserved for the earlier E. When E is SIGKILLed, L is woken by E's pidfd and
    takes 1 at once, though H still holds 0 and nobody released anything.
    """
    holder, early, late = clients(), clients(), clients()
    assert holder.acquire(["0"], 1, 1, "H") is not None
    early.start_acquire(["0", "1"], 1, 2, "E")
    wait_until(lambda: early.pid in waiting_pids(region), "E to queue")
    late.start_acquire(["1"], 1, 1, "L")
    wait_until(lambda: late.pid in waiting_pids(region), "L to queue")
    assert not late.answered(0.2)
    before_kill = time.monotonic()
    early.kill()
    kind, got, _, returned = late.reply(10)
    assert kind == "acquired" and got[1] == ["1"], got
    print(f"\nearlier waiter killed -> later waiter latency: {returned - before_kill:.4f} s")
    assert returned - before_kill < PROMPT
    assert region.snapshot()["waiters"] == []


@pytest.mark.parametrize(
    ("devices", "slots", "n"),
    [
        (["0", "1"], 1, 3),
        (["0"], 1, 0),
        (["0"], 0, 1),
        (["0"], MAX_SLOTS + 1, 1),
        ([], 1, 1),
        ([str(i) for i in range(MAX_DEVICES + 1)], 1, 1),
        (["x" * 64], 1, 1),
    ],
    ids=["n>devices", "n=0", "slots=0", "slots>max", "no-devices", "devices>max", "long-name"],
)
def test_impossible_requests_raise_value_error_and_leave_no_trace(
    region: Region, devices: list[str], slots: int, n: int
) -> None:
    """A request for more GPUs than devices (or 0, or out-of-range slots, device count
    or name length) raises ValueError at once and leaves the table untouched.
    """
    with pytest.raises(ValueError):
        region.acquire(devices, slots, n, "bad", 0)
    assert region.snapshot() == {"devices": [], "holders": [], "waiters": [], "quarantined": []}


def test_release_only_frees_the_callers_own_lease(
    clients: Callable[..., Client], region: Region
) -> None:
    """Releasing a lease id held by another process frees nothing (returns 0), as do
    an unknown id and a second release; the owner's release frees all its slots.
    """
    holder = clients()
    got = holder.acquire(["0", "1"], 1, 2, "mine")
    assert got is not None
    assert region.release(got[0]) == 0
    assert region.release(got[0] + 1000) == 0
    assert held_by(region.snapshot(), holder.pid) == ["0", "1"]
    assert holder.release(got[0]) == 2
    assert holder.release(got[0]) == 0
    assert region.snapshot()["holders"] == []


def test_sessions_with_other_slot_counts_share_a_device_by_its_shares(
    clients: Callable[..., Client], region: Region
) -> None:
    """slots=1 takes the whole device, slots=2 half of it: a slots=2 request waits for a
    slots=1 holder (never overbooked) and two slots=2 requests then fit together."""
    holder = clients()
    assert holder.acquire(["0"], 1, 1, "whole") is not None
    assert region.acquire(["0"], 2, 1, "half", 0) is None  # timed out at once: no room
    holder.kill()
    holder.process.join(10)
    assert region.acquire(["0"], 2, 1, "half", 0) is not None
    assert region.acquire(["0"], 2, 1, "other half", 0) is not None
    assert region.acquire(["0"], 2, 1, "third half", 0) is None
    assert region.snapshot()["devices"] == [("0", 0, WHOLE)]


def test_capacity_conflict_with_a_live_waiter_is_an_error(
    clients: Callable[..., Client], region: Region
) -> None:
    """n2: a waiter sized against 80 GiB GPUs is queued (GPU 1 held); a session that says
    GPU 0 has 40 GiB must not re-size it under the waiter (whose request might then never
    fit, with every later request queued behind it): RegionError naming the waiter."""
    holder, waiter = clients(), clients()
    caps = [80 * GIB, 80 * GIB]
    assert holder.acquire(["1"], 1, 1, "a1", amount=70 * GIB, capacities=[80 * GIB]) is not None
    waiter.start_acquire(["0", "1"], 1, 2, "a2 needs both", None, amount=60 * GIB, capacities=caps)
    deadline = time.monotonic() + 10
    while not region.snapshot()["waiters"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert region.snapshot()["waiters"], "the two-GPU request never queued"
    with pytest.raises(
        RegionError,
        match=rf"device 0 is waited for as 80 GiB of memory by pid {waiter.pid} \(a2 needs "
        r"both\); this session says 40 GiB$",
    ):
        region.acquire(["0"], 1, 1, "b", 0, amount=30 * GIB, capacities=[40 * GIB])
    waiter.kill()
    waiter.process.join(10)
    assert region.acquire(["0"], 1, 1, "b", 0, amount=30 * GIB, capacities=[40 * GIB]) is not None


def test_capacity_conflict_with_a_live_holder_is_an_error(
    clients: Callable[..., Client], region: Region
) -> None:
    """A device leased as 80 GiB cannot be leased as 40 GiB while a holder lives:
    RegionError naming the device, the holder's pid and both sizes; once the holder
    is gone, the new size replaces the old."""
    holder = clients()
    assert holder.acquire(["0"], 1, 1, "big", amount=GIB, capacities=[80 * GIB]) is not None
    with pytest.raises(
        RegionError,
        match=rf"device 0 is leased as 80 GiB of memory by pid {holder.pid} .*says 40 GiB$",
    ):
        region.acquire(["0"], 1, 1, "small", 0, amount=GIB, capacities=[40 * GIB])
    holder.kill()
    holder.process.join(10)
    assert region.acquire(["0"], 1, 1, "small", 0, amount=GIB, capacities=[40 * GIB]) is not None
    assert region.snapshot()["devices"] == [("0", 40 * GIB, GIB)]


# ------------------------------------------------------------------ memory leases


def test_memory_leases_pack_until_full_and_never_overbook(region: Region) -> None:
    """Requests of 12 GiB on an 80 GiB device: six fit (72 GiB), the seventh waits; a
    4 GiB one still fits beside them; releasing one admits the waiting size again."""
    caps = [80 * GIB]
    leases = [
        region.acquire(["0"], 1, 1, f"t{i}", 0, amount=12 * GIB, capacities=caps) for i in range(6)
    ]
    assert all(lease is not None for lease in leases)
    assert region.acquire(["0"], 1, 1, "t6", 0, amount=12 * GIB, capacities=caps) is None
    small = region.acquire(["0"], 1, 1, "small", 0, amount=4 * GIB, capacities=caps)
    assert small is not None
    assert region.snapshot()["devices"] == [("0", 80 * GIB, 76 * GIB)]
    assert region.release(leases[0][0]) == 1
    assert region.acquire(["0"], 1, 1, "t6", 0, amount=12 * GIB, capacities=caps) is not None
    holders = region.snapshot()["holders"]
    assert sorted(h["amount"] for h in holders) == [4 * GIB] + [12 * GIB] * 6


def test_memory_leases_go_where_most_is_free_all_or_nothing(region: Region) -> None:
    """Two 40 GiB devices: a 30 GiB request lands on each in turn (most free first); a
    2-GPU request of 20 GiB each then waits, since only one device has 20 GiB free."""
    caps = [40 * GIB, 40 * GIB]
    first = region.acquire(["0", "1"], 1, 1, "a", 0, amount=30 * GIB, capacities=caps)
    second = region.acquire(["0", "1"], 1, 1, "b", 0, amount=10 * GIB, capacities=caps)
    assert first is not None and second is not None
    assert first[1] != second[1]  # the second went to the emptier device
    assert region.acquire(["0", "1"], 1, 2, "pair", 0, amount=20 * GIB, capacities=caps) is None
    assert region.release(first[0]) == 1
    pair = region.acquire(["0", "1"], 1, 2, "pair", 0, amount=20 * GIB, capacities=caps)
    assert pair is not None and sorted(pair[1]) == ["0", "1"]


def test_a_request_no_device_can_hold_is_refused_at_once(region: Region) -> None:
    with pytest.raises(ValueError, match="only 0 of the devices are known to be that large"):
        region.acquire(["0"], 1, 1, "huge", 0, amount=100 * GIB, capacities=[80 * GIB])
    with pytest.raises(ValueError, match="only 0 of the devices"):  # size unknown: no bytes
        region.acquire(["0"], 1, 1, "bytes", 0, amount=GIB)
    with pytest.raises(ValueError, match="one capacity per device"):
        region.acquire(["0", "1"], 1, 1, "caps", 0, amount=GIB, capacities=[GIB])


def test_a_big_waiter_is_not_starved_by_small_requests(
    clients: Callable[..., Client], region: Region
) -> None:
    """FIFO: with 70 of 80 GiB held, a 40 GiB waiter is first in line; a later 4 GiB
    request (which would fit) waits behind it instead of taking its room."""
    caps = [80 * GIB]
    held = region.acquire(["0"], 1, 1, "held", 0, amount=70 * GIB, capacities=caps)
    assert held is not None
    big = clients()
    big.start_acquire(["0"], 1, 1, "big", 30, amount=40 * GIB, capacities=caps)
    wait_until(lambda: big.pid in waiting_pids(region), "the big request to queue")
    small = clients()
    small.start_acquire(["0"], 1, 1, "small", 30, amount=4 * GIB, capacities=caps)
    wait_until(lambda: small.pid in waiting_pids(region), "the small request to queue")
    time.sleep(0.3)
    assert held_by(region.snapshot(), small.pid) == []
    region.release(held[0])
    assert big.granted(timeout=PROMPT + 10) is not None
    assert small.granted(timeout=PROMPT + 10) is not None  # 44 of 80 GiB


# ------------------------------------------------------------------ timeouts, waiting


def test_timed_out_acquire_returns_none_and_leaves_no_waiter(
    clients: Callable[..., Client], region: Region
) -> None:
    """With the device held elsewhere, acquire(timeout=0.3) returns None after about
    0.3 s, timeout=0 returns None at once, and neither leaves a waiter entry; the
    holder is untouched.
    """
    holder = clients()
    assert holder.acquire(["0"], 1, 1, "H") is not None
    started = time.monotonic()
    assert region.acquire(["0"], 1, 1, "patient", 0.3) is None
    waited = time.monotonic() - started
    assert 0.29 <= waited < 0.3 + PROMPT, waited
    started = time.monotonic()
    assert region.acquire(["0"], 1, 1, "impatient", 0) is None
    assert time.monotonic() - started < PROMPT
    snap = region.snapshot()
    assert snap["waiters"] == []
    assert [(h["pid"], h["alive"]) for h in snap["holders"]] == [(holder.pid, True)]


def test_interrupted_acquire_raises_and_leaves_no_waiter(
    clients: Callable[..., Client], region: Region
) -> None:
    """A signal whose Python handler raises, delivered while acquire() blocks, makes
    acquire() raise that exception and leave the queue; the process can then acquire
    normally once the device is free.
    """
    holder, waiter = clients(), clients()
    got = holder.acquire(["0"], 1, 1, "H")
    assert got is not None
    waiter.start_acquire(["0"], 1, 1, "interrupted")
    wait_until(lambda: waiter.pid in waiting_pids(region), "the waiter to queue")
    assert not waiter.answered(0.1)
    os.kill(waiter.pid, signal.SIGUSR1)
    kind, text, *_ = waiter.reply(PROMPT + 3)
    assert (kind, text) == ("error", "Interrupted: signal 10")
    assert region.snapshot()["waiters"] == []
    assert holder.release(got[0]) == 1
    assert waiter.acquire(["0"], 1, 1, "again", 5) is not None


def test_two_slots_are_shared_and_a_third_holder_waits(
    clients: Callable[..., Client], region: Region
) -> None:
    """slots=2: two processes hold the device at once, a third waits; when one of the
    two releases, the third gets the freed slot and the other keeps its own.
    """
    a, b, c = clients(), clients(), clients()
    got_a = a.acquire(["0"], 2, 1, "A", 0)
    got_b = b.acquire(["0"], 2, 1, "B", 0)
    assert got_a is not None and got_b is not None
    c.start_acquire(["0"], 2, 1, "C")
    wait_until(lambda: c.pid in waiting_pids(region), "C to queue")
    assert not c.answered(0.2)
    assert sorted(h["pid"] for h in region.snapshot()["holders"]) == sorted([a.pid, b.pid])
    assert a.release(got_a[0]) == 1
    assert c.granted() is not None
    snap = region.snapshot()
    assert sorted(h["pid"] for h in snap["holders"]) == sorted([b.pid, c.pid])
    assert len({h["slot"] for h in snap["holders"]}) == 2


def test_waiting_does_not_burn_cpu(clients: Callable[..., Client], region: Region) -> None:
    """A process blocked in acquire() for 1.5 s uses (far) less than 0.2 s of CPU:
    it sleeps in poll() on inotify and pidfds instead of polling the table.
    """
    holder, waiter = clients(), clients()
    assert holder.acquire(["0"], 1, 1, "H") is not None
    waiter.start_acquire(["0"], 1, 1, "W")
    wait_until(lambda: waiter.pid in waiting_pids(region), "the waiter to queue")
    time.sleep(0.05)
    before = cpu_seconds(waiter.pid)
    assert not waiter.answered(1.5)
    used = cpu_seconds(waiter.pid) - before
    print(f"\nCPU used while waiting 1.5 s: {used:.4f} s")
    assert used < 0.2, used


# ------------------------------ native bugs: fixed ones (regressions), open ones (xfail)


def test_a_process_out_of_file_descriptors_cannot_steal_a_live_holders_slot(
    clients: Callable[..., Client], region: Region
) -> None:
    """H holds the only slot. T (which has acquired once before, so its own identity
    is cached) uses up its file descriptors, then asks for the slot with a timeout. T
    must time out; H must still be the live holder.
    """
    thief, holder = clients(), clients()
    got = thief.acquire(["0"], 1, 1, "warm-up", 0)
    assert got is not None and thief.release(got[0]) == 1
    assert holder.acquire(["0"], 1, 1, "H") is not None
    thief.send("exhaust_fds")
    assert thief.reply() == ("exhausted", 24)  # EMFILE
    stolen = thief.acquire(["0"], 1, 1, "T", 0.5)
    snap = region.snapshot()
    assert stolen is None, f"T took a slot H still holds: {snap['holders']}"
    assert [(h["pid"], h["alive"]) for h in snap["holders"]] == [(holder.pid, True)]


def test_a_waiter_across_clear_is_only_granted_devices_it_asked_for(
    clients: Callable[..., Client], region: Region
) -> None:
    """`python -m pytest_gpuiso reset --force` (Region.clear) while W waits for
    device 1: rows are then re-created in another order (1 before 0); W must end up
    with device 1, the one it asked for, and never with 0.
    """
    lease0, _ = region.acquire(["0"], 1, 1, "row 0", 0)
    lease1, _ = region.acquire(["1"], 1, 1, "row 1", 0)
    assert region.release(lease0) == 1
    waiter = clients()
    waiter.start_acquire(["1"], 1, 1, "wants 1", 5)
    wait_until(lambda: waiter.pid in waiting_pids(region), "W to queue")
    region.clear()  # W re-resolves its rows and re-queues on the cleared table
    other, names0 = region.acquire(["0"], 1, 1, "0 after clear", 5)
    assert names0 == ["0"]
    got = waiter.granted(10)
    assert got is not None and got[1] == ["1"], f"W asked for ['1'] and got {got}"


def test_duplicate_device_names_are_rejected(region: Region) -> None:
    """A request that names a device twice cannot be n distinct GPUs: ValueError,
    as for any other impossible request, not a lease that names one GPU twice.
    """
    with pytest.raises(ValueError):
        got = region.acquire(["0", "0"], 1, 2, "twice", 0)
        print(f"got {got}; holders {region.snapshot()['holders']}")


def _create_rows_until_full(path: str) -> None:
    region = Region(path)
    for i in range(MAX_DEVICES):  # all 64 rows made (a 65th name would recycle one)
        got = region.acquire([f"d{i}"], 1, 1, "", 0)
        assert got is not None
        region.release(got[0])


def test_a_creator_killed_while_adding_device_rows_leaves_no_broken_row(
    tmp_path: Path,
) -> None:
    """A process adding device rows is SIGKILLed at random moments (often inside the
    critical section, holding the robust mutex). A row is counted only once it is
    complete, so the table never keeps a nameless or slot-less row (each would be a
    permanent loss out of the 64 rows); the next locker carries on after EOWNERDEAD.
    """
    rng = random.Random(1234)
    for round_ in range(12):
        path = str(tmp_path / f"leases-{round_}")
        region = Region(path)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            try:
                _create_rows_until_full(path)
            finally:
                os._exit(0)
        time.sleep(rng.uniform(0, 0.003))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        devices = region.snapshot()["devices"]  # also proves the mutex is usable again
        assert all(name and cap == 0 for name, cap, _ in devices), f"broken row: {devices}"
        if len(devices) < MAX_DEVICES:
            assert region.acquire(["after"], 1, 1, "after", 0) is not None


def test_device_rows_are_recycled_when_no_one_uses_them(region: Region) -> None:
    """Device names come and go (MIG instances, UUIDs): past the table's 64 rows a new
    name takes a row that no live holder or waiter uses; while all are held, it is refused
    in one line, and gets the row freed first."""
    held = []
    for i in range(MAX_DEVICES):
        got = region.acquire([f"d{i}"], 1, 1, f"holder {i}", 0)
        assert got is not None
        held.append(got[0])
    with pytest.raises(
        RegionError, match="no room for device new: its 64 device rows are all held"
    ):
        region.acquire(["new"], 1, 1, "new", 0)
    region.release(held.pop(7))  # d7's row is free now
    lease, devices = region.acquire(["new"], 1, 1, "new", 0)
    assert devices == ["new"]
    names = [name for name, _, _ in region.snapshot()["devices"]]
    assert len(names) == MAX_DEVICES and "new" in names and "d7" not in names
    assert region.acquire(["d8"], 1, 1, "again", 0) is None  # still held: not recycled
    for lease_id in [*held, lease]:
        region.release(lease_id)
    # every row free: two new names in one request take two distinct rows
    lease, devices = region.acquire(["x", "y"], 1, 2, "two new", 0)
    assert sorted(devices) == ["x", "y"]
    names = [name for name, _, _ in region.snapshot()["devices"]]
    assert {"x", "y"} <= set(names) and len(names) == MAX_DEVICES
    region.release(lease)


def test_a_child_adopts_its_parents_lease_and_no_one_else_can(
    region: Region, region_path: str, tmp_path: Path
) -> None:
    """adopt(): a pinned worker takes over the lease its controller (its parent) took for
    it, so the lease ends with the worker; a process whose parent does not hold the lease
    (here a grandchild, through a shell) takes nothing."""
    import subprocess

    lease, _ = region.acquire(["0"], 1, 1, "pinned worker gw0", 5.0)
    adopt = (
        "import sys; from pytest_gpuiso._lease import Region; "
        f"print(Region({region_path!r}).adopt({lease}))"
    )
    grandchild = subprocess.run(
        ["sh", "-c", f'"{sys.executable}" -c "{adopt}"; true'],
        capture_output=True, text=True, cwd=tmp_path, timeout=60,
    )  # fmt: skip
    assert grandchild.stdout.strip() == "0", grandchild.stderr
    assert held_by(region.snapshot(), os.getpid()) == ["0"]
    child = subprocess.run(
        [sys.executable, "-c", adopt], capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    assert child.stdout.strip() == "1", child.stderr
    # it was the child's, and ended with it: the parent holds nothing, the GPU is free
    assert region.release(lease) == 0
    assert region.acquire(["0"], 1, 1, "next", 0) is not None
