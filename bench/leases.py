"""GPU lease schemes measured side by side in one run: latency, dead holders, throughput.

Compares, on the same machine and in the same run, three ways for processes to
share one GPU slot:

* ours: ``pytest_gpuiso._lease.Region`` (robust process-shared mutex, waiters
  woken by inotify on release and by a pidfd when a holder dies);
* filelock: a ``filelock.FileLock`` per GPU slot file in a temporary directory,
  like pytest-isolate (acquire = ``FileLock(path).acquire()``, release =
  ``.release()``; a waiter polls every 50 ms, the filelock default). Skipped,
  with a line saying so, when filelock is not installed;
* seed 003: a process-shared semaphore waited with ``sem_timedwait`` timeouts of
  SEM_WAIT_TIME and a forced ``sem_post`` once SEM_WAIT_RETRY_TIMES retries have
  timed out (10 s and 30 in the seed). It is run twice: "as written", where the
  absolute deadline is computed once before the retry loop as in the seed's
  code, so only the first wait sleeps and the 30 retries time out at once; and
  "as documented", with a fresh 10 s wait per retry ("up to 5 minutes"). Its
  time constants are divided by --scale (default 1000: 10 s becomes 10 ms) so
  the run stays short; the count of retries is kept. Both the measured time and
  the figure at the real constants are printed.

Measured:

1. Uncontended acquire+release latency: median (and p99) of the time of one
   acquire+release pair, timed one pair at a time, in this process.
2. Dead-holder recovery: a holder process takes the only slot, a waiter process
   starts waiting, the holder is SIGKILLed; the time from the kill to the waiter
   holding the lease (both sides read CLOCK_MONOTONIC; the waiter reports
   through a pipe). Ours and filelock are killed --settle-ms after the waiter
   starts waiting, so that it is really blocked; the seed's waiter is killed at
   once, since its wait does not depend on the holder at all. A floor row times
   the kill to a pidfd of the holder turning readable in this process: the
   kernel's own exit time, which no scheme can beat. Then a holder that
   is merely slow (holds 0.5 s, longer than the seed's scaled give-up time)
   shows whether a second holder is admitted beside it ("double-booked").
3. Throughput: N processes (2, 4, 8) contend for one slot, each doing K cycles
   of acquire -> hold (sleep --hold-ms) -> release. Prints leases/second, the
   longest single wait (fairness) and the number of overlapping holds, checked
   from the enter/exit times every holder records (must be 0).

    python bench/leases.py [--quick] [--iterations 20000] [--trials 10] [--cycles 100]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import select
import shutil
import signal
import statistics
import sys
import tempfile
import time
from multiprocessing.connection import Connection

import psutil
from pytest_gpuiso._lease import Region

try:
    import filelock
except ImportError:  # optional: the comparison is skipped, with a line saying so
    filelock = None

CTX = mp.get_context("fork")  # cheap children; each one opens its own lease handle
SKIP_FILELOCK = "skipped: pip install filelock"

# Seed 003 (HAMi-core option 5C, lock_postinit): real constants.
SEM_WAIT_TIME = 10.0  # seconds per sem_timedwait
SEM_WAIT_RETRY_TIMES = 30  # forced sem_post once more than this many waits timed out


# ------------------------------------------------------------------ schemes


class Ours:
    """pytest-gpuiso's native lease table, one GPU "0" with one slot."""

    name = "ours (Region)"

    def __init__(self, tmp: str) -> None:
        self.path = os.path.join(tmp, "region")
        self.region: Region | None = None

    def fresh(self) -> None:
        pass

    def connect(self) -> None:
        self.region = Region(self.path)  # in the process that uses it: its own inotify watch

    def acquire(self, label: str) -> int:
        lease, _names = self.region.acquire(["0"], 1, 1, label, None)
        return lease

    def release(self, token: int) -> None:
        self.region.release(token)


class FileLockLease:
    """A FileLock per GPU slot file (one GPU, one slot: one file), like pytest-isolate."""

    name = "filelock"

    def __init__(self, tmp: str) -> None:
        self.path = os.path.join(tmp, "gpu0.slot0.lock")
        self.lock = None

    def fresh(self) -> None:
        pass

    def connect(self) -> None:
        self.lock = filelock.FileLock(self.path)

    def acquire(self, label: str) -> int:
        self.lock.acquire()
        return 0

    def release(self, token: int) -> None:
        self.lock.release()


class Seed003:
    """Seed 003's lock_postinit/unlock_postinit, with its time constants divided by `scale`.

    as_written: the absolute deadline is computed once, before the loop, as in the
    seed's code (get_timespec before while (1)); after the first timeout every
    retry times out at once. Otherwise a fresh SEM_WAIT_TIME per retry, as its
    text says ("10 second timeout per retry, 30 retries max (5 minutes total)").
    """

    def __init__(self, scale: float, as_written: bool) -> None:
        self.wait = SEM_WAIT_TIME / scale
        self.retries = SEM_WAIT_RETRY_TIMES
        self.as_written = as_written
        self.name = "seed 003 as written" if as_written else "seed 003 as documented"
        self.timed_waits = 1 if as_written else self.retries + 1  # waits that really sleep
        self.sem = None
        self.forced = 0
        self.fresh()

    def fresh(self) -> None:
        self.sem = CTX.Semaphore(1)  # sem_init(&sem, 1, 1): process-shared, unlocked

    def connect(self) -> None:
        self.forced = 0

    def acquire(self, label: str) -> int:
        deadline = time.monotonic() + self.wait  # get_timespec(SEM_WAIT_TIME, &sem_ts)
        trials = 0
        while True:
            if not self.as_written:
                deadline = time.monotonic() + self.wait
            # sem_timedwait(&sem, &sem_ts): an expired deadline still takes a free semaphore
            if self.sem.acquire(timeout=max(0.0, deadline - time.monotonic())):
                return 0
            trials += 1
            if trials > self.retries:
                self.sem.release()  # "Force acquire by posting (increment) then waiting"
                self.forced += 1

    def release(self, token: int) -> None:
        self.sem.release()  # unlock_postinit: sem_post

    def real_seconds(self, measured: float) -> float:
        """`measured` at the real constants: the sleeping waits scale, the rest does not."""
        return measured + self.timed_waits * (SEM_WAIT_TIME - self.wait)


# ------------------------------------------------------------------ children


def _holder(scheme, conn: Connection, hold_s: float | None) -> None:
    scheme.connect()
    token = scheme.acquire("holder")
    conn.send(("held", time.monotonic()))
    if hold_s is None:  # until SIGKILLed
        while True:
            time.sleep(3600)
    time.sleep(hold_s)
    released = time.monotonic()
    scheme.release(token)
    conn.send(("released", released))


def _waiter(scheme, conn: Connection, hold_s: float) -> None:
    scheme.connect()
    conn.send(("waiting", time.monotonic()))
    token = scheme.acquire("waiter")
    got = time.monotonic()
    conn.send(("got", got, getattr(scheme, "forced", 0)))
    time.sleep(hold_s)
    scheme.release(token)


def _cycler(scheme, conn: Connection, go, cycles: int, hold_s: float) -> None:
    scheme.connect()
    conn.send("ready")
    go.wait()
    spans, waits = [], []
    for i in range(cycles):
        asked = time.monotonic()
        token = scheme.acquire(f"cycle {i}")
        entered = time.monotonic()
        time.sleep(hold_s)
        left = time.monotonic()
        scheme.release(token)
        spans.append((entered, left))
        waits.append(entered - asked)
    conn.send((spans, waits))


class Children:
    """Every process this benchmark starts; all are killed and reaped on close()."""

    def __init__(self) -> None:
        self.procs: list = []

    def start(self, target, *args) -> tuple:
        recv, send = CTX.Pipe(duplex=False)
        proc = CTX.Process(target=_call, args=(target, args, send), daemon=True)
        proc.start()
        send.close()
        self.procs.append(proc)
        return proc, recv

    def close(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
            proc.join()
        self.procs.clear()


def _call(target, args: tuple, conn: Connection) -> None:
    scheme, *rest = args  # targets take (scheme, conn, ...)
    target(scheme, conn, *rest)


def expect(conn: Connection, what: str, timeout: float = 60.0):
    if not conn.poll(timeout):
        raise RuntimeError(f"no {what!r} from a child in {timeout:.0f} s")
    msg = conn.recv()
    if (msg if isinstance(msg, str) else msg[0]) != what:
        raise RuntimeError(f"expected {what!r} from a child, got {msg!r}")
    return msg


# ------------------------------------------------------------------ 1. latency


def latency(scheme, iterations: int) -> tuple[float, float]:
    """Median and p99 of one acquire+release pair, in µs."""
    scheme.connect()
    for _ in range(min(1000, iterations)):  # warm-up
        scheme.release(scheme.acquire("bench"))
    clock = time.perf_counter_ns
    times = []
    for _ in range(iterations):
        start = clock()
        scheme.release(scheme.acquire("bench"))
        times.append(clock() - start)
    times.sort()
    return statistics.median(times) / 1000, times[int(len(times) * 0.99)] / 1000


# ------------------------------------------------------------------ 2. dead holders


def recovery(scheme, children: Children, trials: int, settle_s: float) -> tuple[list, int]:
    """Seconds from SIGKILL of the holder to the waiter holding the lease, per trial."""
    times, forced = [], 0
    for _ in range(trials):
        scheme.fresh()
        holder, hconn = children.start(_holder, scheme, None)
        expect(hconn, "held")
        waiter, wconn = children.start(_waiter, scheme, 0.0)
        expect(wconn, "waiting")
        time.sleep(settle_s)
        killed = time.monotonic()
        os.kill(holder.pid, signal.SIGKILL)
        _, got, n = expect(wconn, "got")
        times.append(got - killed)
        forced += n
        waiter.join()
        holder.join()
        children.close()
    return times, forced


class NoLease:
    """No lease at all: a holder that only sleeps, for the kernel's own exit time."""

    name = "(floor: exit -> pidfd)"

    def fresh(self) -> None:
        pass

    def connect(self) -> None:
        pass

    def acquire(self, label: str) -> int:
        return 0

    def release(self, token: int) -> None:
        pass


def exit_floor(children: Children, trials: int) -> list:
    """Seconds from SIGKILL to the process being gone, seen by a pidfd here: no scheme beats it."""
    times = []
    for _ in range(trials):
        holder, hconn = children.start(_holder, NoLease(), None)
        expect(hconn, "held")
        pidfd = os.pidfd_open(holder.pid)
        try:
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            killed = time.monotonic()
            os.kill(holder.pid, signal.SIGKILL)
            poller.poll(60_000)
            times.append(time.monotonic() - killed)
        finally:
            os.close(pidfd)
        children.close()
    return times


def slow_holder(scheme, children: Children, hold_s: float) -> tuple[bool, float]:
    """Does a waiter get the slot while a live holder still holds it? (and the waiter's wait)"""
    scheme.fresh()
    holder, hconn = children.start(_holder, scheme, hold_s)
    expect(hconn, "held")
    waiter, wconn = children.start(_waiter, scheme, 0.05)
    _, asked = expect(wconn, "waiting")
    _, got, _ = expect(wconn, "got", timeout=hold_s + 60)
    _, released = expect(hconn, "released", timeout=hold_s + 60)
    waiter.join()
    holder.join()
    children.close()
    return got < released, got - asked


# ------------------------------------------------------------------ 3. throughput


def throughput(scheme, children: Children, nprocs: int, cycles: int, hold_s: float) -> dict:
    go = CTX.Event()
    conns = []
    for _ in range(nprocs):
        _, conn = children.start(_cycler, scheme, go, cycles, hold_s)
        conns.append(conn)
    for conn in conns:
        expect(conn, "ready")
    started = time.monotonic()
    go.set()
    spans, waits = [], []
    for conn in conns:
        if not conn.poll(300):
            raise RuntimeError("a throughput child did not finish in 300 s")
        s, w = conn.recv()
        spans += s
        waits += w
    children.close()
    spans.sort()
    overlaps, last_exit = 0, float("-inf")
    for entered, left in spans:
        overlaps += entered < last_exit
        last_exit = max(last_exit, left)
    return {
        "rate": len(spans) / (last_exit - started),
        "overlaps": overlaps,
        "max_wait": max(waits),
        "median_wait": statistics.median(waits),
    }


# ------------------------------------------------------------------ output


def machine() -> str:
    cpus = os.cpu_count()
    physical = psutil.cpu_count(logical=False)
    usable = len(os.sched_getaffinity(0))
    fl = f"filelock {filelock.__version__}" if filelock else "filelock not installed"
    return (
        f"{platform.platform()} ({platform.machine()}), {cpus} CPUs ({physical} physical, "
        f"{usable} usable), Python {sys.version.split()[0]}, {fl}"
    )


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def human(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds >= 1 else ms(seconds)


def scratch_dir() -> str:
    """A private temp dir on tmpfs (where the real region lives) if there is one."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        return tempfile.mkdtemp(prefix="gpuiso-bench-", dir=shm)
    return tempfile.mkdtemp(prefix="gpuiso-bench-")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations (CI speed)")
    parser.add_argument("--iterations", type=int, help="latency pairs (default 20000)")
    parser.add_argument("--trials", type=int, help="dead-holder kills per scheme (default 10)")
    parser.add_argument("--cycles", type=int, help="cycles per process in 3. (default 100)")
    parser.add_argument("--procs", default="2,4,8", help="process counts in 3.")
    parser.add_argument("--hold-ms", type=float, default=1.0, help="hold per cycle in 3.")
    parser.add_argument("--settle-ms", type=float, default=20.0, help="waiter blocked before kill")
    parser.add_argument("--scale", type=float, default=1000.0, help="seed 003 time divisor")
    opts = parser.parse_args()
    iterations = opts.iterations or (2000 if opts.quick else 20000)
    trials = opts.trials or (3 if opts.quick else 10)
    cycles = opts.cycles or (20 if opts.quick else 100)
    procs = [int(n) for n in opts.procs.split(",")]
    hold_s = opts.hold_ms / 1000
    settle_s = opts.settle_ms / 1000

    print(f"machine: {machine()}")
    tmp = scratch_dir()
    print(f"scratch: {tmp}")
    children = Children()
    try:
        ours = Ours(tmp)
        fl = FileLockLease(tmp) if filelock else None
        written = Seed003(opts.scale, as_written=True)
        documented = Seed003(opts.scale, as_written=False)

        print(f"\n1. uncontended acquire+release, {iterations} pairs, one at a time (µs per pair)")
        print(f"{'scheme':<26}{'median':>10}{'p99':>10}{'vs ours':>10}")
        base, p99 = latency(ours, iterations)
        print(f"{ours.name:<26}{base:>10.1f}{p99:>10.1f}{'1.0x':>10}")
        ours.region = None  # children open their own
        if fl:
            med, p99 = latency(fl, iterations)
            print(f"{fl.name:<26}{med:>10.1f}{p99:>10.1f}{med / base:>9.1f}x")
            fl.lock = None
        else:
            print(f"{'filelock':<26}  {SKIP_FILELOCK}")
        med, p99 = latency(written, iterations)
        print(f"{'seed 003 (semaphore)':<26}{med:>10.1f}{p99:>10.1f}{med / base:>9.1f}x")
        print(f"target for ours: <= 20 µs: {'met' if base <= 20 else 'MISSED'}")

        print(
            f"\n2. dead holder: SIGKILL of the holder -> waiter holds the lease, {trials} trials\n"
            f"   seed 003 constants divided by {opts.scale:g}: SEM_WAIT_TIME {SEM_WAIT_TIME:g} s"
            f" -> {human(written.wait)}, SEM_WAIT_RETRY_TIMES {SEM_WAIT_RETRY_TIMES} kept"
        )
        print(f"{'scheme':<26}{'median':>12}{'max':>12}{'vs ours':>10}   at real constants")
        rows = [(ours, settle_s)] + ([(fl, settle_s)] if fl else [])
        rows += [(written, 0.0), (documented, 0.0)]  # the seed's wait ignores the holder
        ours_median = None
        for scheme, settle in rows:
            times, forced = recovery(scheme, children, trials, settle)
            med, worst = statistics.median(times), max(times)
            ours_median = ours_median or med
            line = f"{scheme.name:<26}{ms(med):>12}{ms(worst):>12}{med / ours_median:>9.0f}x"
            if isinstance(scheme, Seed003):
                real = scheme.real_seconds(med)
                ratio = real / ours_median
                line += f"   {human(real)} = {ratio:,.0f}x ours ({forced} forced sem_post)"
            print(line)
            if scheme is ours and not fl:
                print(f"{'filelock':<26}  {SKIP_FILELOCK}")
        times = exit_floor(children, trials)
        print(f"{NoLease.name:<26}{ms(statistics.median(times)):>12}{ms(max(times)):>12}")
        print(f"target for ours: <= 100 ms: {'met' if ours_median <= 0.1 else 'MISSED'}")

        slow = 0.5
        print(f"\n   a live holder that is merely slow (holds {human(slow)}), then a waiter:")
        print(f"{'scheme':<26}{'waited':>12}   double-booked")
        for scheme in [ours] + ([fl] if fl else []) + [written, documented]:
            double, waited = slow_holder(scheme, children, slow)
            line = f"{scheme.name:<26}{ms(waited):>12}   {'yes' if double else 'no'}"
            if isinstance(scheme, Seed003):
                value = scheme.sem.get_value()
                limit = scheme.real_seconds(scheme.timed_waits * scheme.wait)
                line += (
                    f" (at real constants: any hold over {human(limit)}; "
                    f"semaphore value after both released: {value})"
                )
            print(line)

        print(
            f"\n3. throughput: N processes, 1 GPU x 1 slot, {cycles} cycles each of "
            f"acquire -> sleep {opts.hold_ms:g} ms -> release "
            f"(ideal <= {1 / hold_s:.0f} leases/s)"
        )
        header = f"{'N':>3}  {'scheme':<16}{'leases/s':>10}{'vs ours':>9}"
        print(f"{header}{'median wait':>13}{'max wait':>11}{'overlaps':>10}")
        for n in procs:
            results = [(ours, throughput(ours, children, n, cycles, hold_s))]
            if fl:
                results.append((fl, throughput(fl, children, n, cycles, hold_s)))
            base_rate = results[0][1]["rate"]
            for scheme, res in results:
                print(
                    f"{n:>3}  {scheme.name:<16}{res['rate']:>10.0f}{res['rate'] / base_rate:>8.2f}x"
                    f"{ms(res['median_wait']):>13}{ms(res['max_wait']):>11}{res['overlaps']:>10}"
                )
            if not fl:
                print(f"{n:>3}  {'filelock':<16}  {SKIP_FILELOCK}")
    finally:
        children.close()
        for child in psutil.Process().children(recursive=True):  # only ours: fork children
            child.kill()
            child.wait(5)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
