"""Per-test cost of the leak probes under load, measured side by side in one run.

Times what the supervisor does around one isolated test, besides starting it:
``snapshot()`` of every probe before the child starts and ``check(before, run)``
after it is reaped, for the three probes in the supervisor's order:

* process: ``ProcessProbe`` (psutil descendants of this process, before and after);
* shm: ``ShmProbe`` as the plugin builds it (with the shim's log file when the
  shim is built), on a private directory standing in for /dev/shm and, in
  alternate iterations of the same loop, on the real /dev/shm;
* gpu_memory: ``GpuMemoryProbe`` on one device with a fake reader that returns
  constant samples. Real NVML calls are NOT included (a line says whether NVML
  is available here; when it is, one row times NvmlReader.sample itself).

Scenarios, in one run on the same machine:

(a) quiet: the private directory empty, /dev/shm as found, no extra processes;
(b) --entries (1,000) entries in the private directory and as many extra files
    in /dev/shm (unique prefix, removed at the end), plus --procs (300) idle
    ``sleep`` processes in their own sessions that are NOT our descendants
    (started by a helper that exits), then the same with --procs idle
    descendants instead (the process probe walks descendants);
(c) (b), and the test leaks one segment (an unheld file created between snapshot
    and check, logged as the shim would): the probe stats it and reads
    /proc/*/fd and /proc/*/maps of every process for a holder before reporting.

Each row: median and p95 of the per-test probe cost, the median of each probe,
and the ratios to the 20 ms/test target and to one bare spawn (start to reaped
of a ``multiprocessing`` spawn of a no-op, timed first). Every file and process
made here is removed/killed in ``finally`` blocks (SIGTERM/SIGHUP included);
the sleeps also exit by themselves after --lifetime seconds.

    python bench/leaks_cost.py [--quick] [--iterations 150] [--leak-iterations 30]
                               [--entries 1000] [--procs 300] [--profile]
"""

from __future__ import annotations

# Only the standard library at module level: a spawned child re-imports this
# script, and the spawn timed here should be a bare one (psutil and the plugin
# are imported in main()).
import argparse
import contextlib
import math
import multiprocessing as mp
import os
import platform
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import types

TARGET_S = 0.020  # per-test probe budget
SHM = "/dev/shm"

# Started by a helper process that exits: the sleeps are re-parented away from us.
HELPER = r"""
import subprocess, sys
n, token = int(sys.argv[1]), sys.argv[2]
for _ in range(n):
    p = subprocess.Popen(["sleep", token], start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(p.pid, flush=True)
"""


def noop() -> None:
    pass


class _Terminated(Exception):
    pass


def _on_signal(signum, frame):
    raise _Terminated(f"signal {signum}")


DEFERRED = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


@contextlib.contextmanager
def signals_deferred():
    """Ctrl-C/TERM/HUP wait until the block ends: a child is never started unrecorded,
    and the cleanup is not cut short."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, DEFERRED)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


# ------------------------------------------------------------------ load


class Load:
    """Everything this benchmark creates; ``close()`` removes all of it."""

    def __init__(self, lifetime: float) -> None:
        self.prefix = f"gpuiso-leakbench-{os.getpid()}-{secrets.token_hex(4)}"
        # a unique argument: the sleeps exit after `lifetime` s, and are ours beyond doubt
        self.token = f"{lifetime:.0f}.{secrets.randbelow(10**9):09d}"
        self.real_shm = os.path.isdir(SHM) and os.access(SHM, os.W_OK)
        self.private = ""  # stands in for /dev/shm (on tmpfs when /dev/shm is writable)
        self.logs = ""  # the shim's per-test log files
        self.shim = False  # the shim is built: each test's process has a log
        self.others: list = []  # psutil.Process of the non-descendant sleeps
        self.children: list[subprocess.Popen] = []  # descendant sleeps

    def open(self) -> None:
        base = SHM if self.real_shm else None
        self.private = tempfile.mkdtemp(prefix=self.prefix + ".", dir=base)
        self.logs = tempfile.mkdtemp(prefix=self.prefix + "-logs.")

    def fill(self, directory: str, n: int) -> None:
        for i in range(n):
            path = os.path.join(directory, f"{self.prefix}-{i}")
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))

    def start_others(self, n: int) -> None:
        import psutil

        helper = subprocess.Popen(
            [sys.executable, "-c", HELPER, str(n), self.token],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        with helper:
            for line in helper.stdout:
                with contextlib.suppress(psutil.Error):
                    self.others.append(psutil.Process(int(line)))
        if helper.returncode:
            raise RuntimeError(f"the helper that starts the sleeps failed ({helper.returncode})")
        mine = {p.pid for p in psutil.Process().children(recursive=True)}
        if mine & {p.pid for p in self.others}:
            raise RuntimeError("the 'other session' sleeps are our descendants (a subreaper?)")

    def start_children(self, n: int) -> None:
        for _ in range(n):
            with signals_deferred():  # the sleep inherits the mask; we kill with SIGKILL
                self.children.append(
                    subprocess.Popen(
                        ["sleep", self.token],
                        start_new_session=True,
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )

    def stop_others(self) -> None:
        import psutil

        for p in self.others:
            with contextlib.suppress(psutil.Error):
                p.kill()  # psutil checks the start time: never a reused pid
        psutil.wait_procs(self.others, timeout=5)
        self.others.clear()
        self.sweep_token()

    def sweep_token(self) -> None:
        """Kill any sleep carrying this run's unique argument that we did not record (the
        helper was interrupted). Twice, so one that was between fork and exec is caught."""
        import psutil

        uid = os.getuid()
        for attempt in range(2):
            if attempt:
                time.sleep(0.2)
            found = []
            for p in psutil.process_iter(["cmdline", "uids"]):
                with contextlib.suppress(psutil.Error):
                    info = p.info
                    if info["cmdline"] == ["sleep", self.token] and info["uids"].real == uid:
                        p.kill()
                        found.append(p)
            psutil.wait_procs(found, timeout=5)

    def stop_children(self) -> None:
        for p in self.children:
            with contextlib.suppress(OSError):
                p.kill()
        for p in self.children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)
        self.children.clear()

    def close(self) -> None:
        with signals_deferred():
            self._close()

    def _close(self) -> None:
        errors = []
        for step in (self.stop_children, self.stop_others):
            try:
                step()
            except Exception as exc:  # keep cleaning
                errors.append(exc)
        for path in (self.private, self.logs):
            if path:
                shutil.rmtree(path, ignore_errors=True)
        if self.real_shm:
            with contextlib.suppress(OSError):
                for name in os.listdir(SHM):
                    if name.startswith(self.prefix):
                        path = os.path.join(SHM, name)
                        if os.path.isdir(path) and not os.path.islink(path):
                            shutil.rmtree(path, ignore_errors=True)
                        else:
                            with contextlib.suppress(OSError):
                                os.unlink(path)
        if errors:
            raise errors[0]


# ------------------------------------------------------------------ measurement


class FakeReader:
    """Constant NVML samples: the probe's own logic, no driver calls."""

    def __init__(self, sample) -> None:
        self._sample = sample

    def sample(self, device: str):
        return self._sample


class Variant:
    """One shm directory: the probes of one test on it, and the per-test times."""

    def __init__(self, label: str, directory: str, load: Load) -> None:
        self.label = label
        self.directory = directory
        self.load = load
        self.totals: list[float] = []
        self.per: dict[str, list[float]] = {}
        self.found: list[int] = []  # leaks reported per test
        self.n_logs = 0

    def reset(self) -> None:
        self.totals, self.per, self.found = [], {}, []


def one_test(v: Variant, reader, leak: bool, mods) -> None:
    """Snapshot, (the test), check: as the supervisor does around one test."""
    RunInfo, ProcessProbe, ShmProbe, GpuMemoryProbe = mods
    clock = time.perf_counter
    v.n_logs += 1
    log = os.path.join(v.load.logs, f"shm-{v.n_logs}.log")
    spent: dict[str, float] = {}

    t = clock()
    shm = ShmProbe((), cleanup=False, directory=v.directory, alone=True)
    probes = (ProcessProbe(), shm, GpuMemoryProbe(reader, ["0"]))
    if v.load.shim:  # the launcher makes the log and starts the test's process with it
        os.close(os.open(log, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        shm.before_start(types.SimpleNamespace(shm_log=log))
    spent["build"] = clock() - t
    snaps = []
    for p in probes:
        t = clock()
        snaps.append(p.snapshot())
        spent[p.kind] = clock() - t

    # ---- the test runs here (not timed) ----
    wall_start = time.time()
    test_pid = os.getpid()  # stands in for the reaped child: only compared, never signalled
    leaked = None
    if leak:
        leaked = os.path.join(v.directory, f"{v.load.prefix}-leak-{v.n_logs}")
        fd = os.open(leaked, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.ftruncate(fd, 8192)
        os.close(fd)  # not held by anyone: the holder scan goes through all of /proc
        with open(log, "a") as f:  # what the preloaded shim writes for the test
            f.write(f"{test_pid} {os.stat(leaked).st_ino} {os.path.basename(leaked)}\n")
    # ----------------------------------------

    run = RunInfo(test_pid, wall_start, time.time(), 1.0, frozenset({test_pid}))
    found = 0
    for p, before in zip(probes, snaps, strict=True):
        t = clock()
        found += len(p.check(before, run))
        spent[p.kind] += clock() - t
    if leaked:
        with contextlib.suppress(OSError):
            os.unlink(leaked)
    with contextlib.suppress(OSError):
        os.unlink(log)  # check() removes it; here in case it did not

    v.totals.append(sum(spent.values()))
    for kind, s in spent.items():
        v.per.setdefault(kind, []).append(s)
    v.found.append(found)


def measure(variants: list[Variant], reader, leak: bool, n: int, mods) -> None:
    for v in variants:
        v.reset()
        one_test(v, reader, leak, mods)  # warm-up
        v.reset()
    for _ in range(n):
        for v in variants:  # alternated: both directories see the same conditions
            one_test(v, reader, leak, mods)


def spawn_times(n: int) -> list[float]:
    ctx = mp.get_context("spawn")
    out = []
    for i in range(n + 1):
        proc = ctx.Process(target=noop)
        t = time.perf_counter()
        proc.start()
        proc.join()
        if i:  # the first one is a warm-up
            out.append(time.perf_counter() - t)
        if proc.exitcode != 0:
            raise RuntimeError(f"the no-op spawn exited with {proc.exitcode}")
    return out


def p95(xs: list[float]) -> float:
    s = sorted(xs)
    return s[max(0, math.ceil(0.95 * len(s)) - 1)]


def ms(s: float) -> str:
    return f"{s * 1000:.2f}"


# ------------------------------------------------------------------ output


HEADER = (
    f"{'scenario':<34}{'shm dir':<10}{'n':>4}{'median':>9}{'p95':>9}"
    f"{'process':>9}{'shm':>8}{'gpu':>7}{'build':>7}{'/target':>9}{'p95/tgt':>9}{'/spawn':>8}"
    f"  leaks"
)


def row(scenario: str, v: Variant, spawn: float, expect: int) -> str:
    med = statistics.median(v.totals)
    per = {k: statistics.median(xs) for k, xs in v.per.items()}
    bad = sum(1 for f in v.found if f != expect)
    leaks = f"{expect}/test" + (f" ({bad} tests reported otherwise)" if bad else "")
    flag = "  OVER" if med > TARGET_S else ""
    return (
        f"{scenario:<34}{v.label:<10}{len(v.totals):>4}{ms(med):>9}{ms(p95(v.totals)):>9}"
        f"{ms(per['process']):>9}{ms(per['shm']):>8}{ms(per['gpu_memory']):>7}"
        f"{ms(per['build']):>7}{med / TARGET_S:>8.2f}x{p95(v.totals) / TARGET_S:>8.2f}x"
        f"{med / spawn:>7.3f}x  {leaks}{flag}"
    )


def nvml_line(NvmlReader) -> tuple[str, object]:
    reader = NvmlReader()
    if not reader.available():
        return f"NVML: unavailable here ({reader.error}); real NVML calls are not included", None
    try:
        reader.sample("0")
    except Exception as exc:
        return f"NVML: loaded but device 0 unusable ({exc}); real NVML calls not included", None
    return "NVML: available; the last row times NvmlReader.sample('0') itself", reader


def machine() -> str:
    import psutil

    return (
        f"{platform.platform()}, {os.cpu_count()} CPUs "
        f"({len(os.sched_getaffinity(0))} usable), Python {sys.version.split()[0]}, "
        f"psutil {psutil.__version__}"
    )


def profile(variant: Variant, reader, mods, n: int) -> None:
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        one_test(variant, reader, True, mods)
    prof.disable()
    print(f"\ncProfile of {n} leaking tests ({variant.label}), top by cumulative time:")
    pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative").print_stats(14)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations (CI speed)")
    parser.add_argument("--iterations", type=int, help="clean tests per row (default 150)")
    parser.add_argument("--leak-iterations", type=int, help="leaking tests per row (default 30)")
    parser.add_argument("--spawns", type=int, help="no-op spawns timed (default 10)")
    parser.add_argument("--entries", type=int, default=1000, help="extra shm entries")
    parser.add_argument("--procs", type=int, default=300, help="idle processes")
    parser.add_argument("--lifetime", type=float, default=300, help="the sleeps' own timeout, s")
    parser.add_argument("--profile", action="store_true", help="cProfile a leaking test at load")
    opts = parser.parse_args()
    clean_n = opts.iterations or (40 if opts.quick else 150)
    leak_n = opts.leak_iterations or (8 if opts.quick else 30)
    spawns = opts.spawns or (3 if opts.quick else 10)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)

    import psutil

    from pytest_gpuiso.gpu.nvml import NvmlReader, Sample
    from pytest_gpuiso.leaks import RunInfo
    from pytest_gpuiso.leaks.gpu_memory import GpuMemoryProbe
    from pytest_gpuiso.leaks.process import ProcessProbe
    from pytest_gpuiso.leaks.shm import ShmProbe
    from pytest_gpuiso.leaks.shm_log import shim_path

    mods = (RunInfo, ProcessProbe, ShmProbe, GpuMemoryProbe)
    reader = FakeReader(Sample(1 << 30, {4242: 1 << 28}))

    print(f"machine: {machine()}")
    line, real_reader = nvml_line(NvmlReader)
    print(line)
    print(f"shm shim: {'built, its log is created/read per test' if shim_path() else 'not built'}")
    started = time.monotonic()
    spawn = spawn_times(spawns)
    spawn_med = statistics.median(spawn)
    print(
        f"bare spawn (multiprocessing 'spawn' of a no-op, start -> reaped): median "
        f"{ms(spawn_med)} ms, max {ms(max(spawn))} ms over {spawns}"
    )

    load = Load(opts.lifetime)
    load.shim = shim_path() is not None
    try:
        load.open()
        variants = [Variant("private", load.private, load)]
        if load.real_shm:
            variants.append(Variant(SHM, SHM, load))
        procs0 = len(psutil.pids())
        shm0 = len(os.listdir(SHM)) if load.real_shm else 0
        print(
            f"load: {procs0} processes, {shm0} entries in {SHM} at the start; private dir "
            f"{load.private}; per row {clean_n} clean / {leak_n} leaking tests, "
            "directories alternated"
        )
        if not load.real_shm:
            print(f"{SHM} is not writable here: only the private directory is measured")
        print(
            "\nper-test probe cost, ms (snapshot + check; process/shm/gpu/build: medians of "
            f"each part); target {TARGET_S * 1000:.0f} ms/test"
        )
        print(HEADER)

        def block(scenario: str, leak: bool) -> None:
            measure(variants, reader, leak, leak_n if leak else clean_n, mods)
            for v in variants:
                print(row(scenario, v, spawn_med, 1 if leak else 0), flush=True)

        block("(a) quiet", False)
        load.fill(load.private, opts.entries)
        if load.real_shm:
            load.fill(SHM, opts.entries)

        load.start_others(opts.procs)
        n = len(load.others)
        block(f"(b) {opts.entries} shm + {n} other-session", False)
        block("(c) (b) + 1 leaked segment", True)
        if opts.profile:
            profile(variants[0], reader, mods, leak_n)
            print(HEADER)
        load.stop_others()

        load.start_children(opts.procs)
        n = len(load.children)
        block(f"(b') {opts.entries} shm + {n} descendants", False)
        block("(c') (b') + 1 leaked segment", True)
        load.stop_children()

        if real_reader is not None:
            times = []
            for _ in range(clean_n):
                t = time.perf_counter()
                real_reader.sample("0")
                times.append(time.perf_counter() - t)
            print(
                f"NvmlReader.sample('0'): median {ms(statistics.median(times))} ms, "
                f"p95 {ms(p95(times))} ms (a clean test takes 2: snapshot + one check)"
            )
        print(f"\ntotal {time.monotonic() - started:.1f} s")
    finally:
        load.close()


if __name__ == "__main__":
    main()
