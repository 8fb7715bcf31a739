"""Per-test overhead of isolation, measured side by side in one run.

Builds a suite of N tiny torch tests in a temporary directory (``import torch``
at the module's top; each test does one small tensor op and asserts; with
``--device cuda`` the tensors live on the GPU and the tests are marked
``gpu_isolated`` so that they lease one; it first checks, in a separate
interpreter, that torch sees a CUDA device, and stops with one line saying why
not; with ``--sleep S`` each test also sleeps S seconds, as a test waiting on
its GPU would, which shows what prewarming hides) and times, on the same
machine and in the same run:

* in-process pytest;
* ``--gpu-isolate`` alone: the fork server (the default start method), default
  prewarming, with its pre-collected template (the default), and without
  (``--gpu-isolate-start=forkserver --gpu-isolate-no-precollect``: each test's process
  configures pytest and collects its module itself);
* ``--gpu-isolate-start=spawn``, prewarming off (``--gpu-isolate-prewarm=0``), of the
  next test (the default) and of the next 2;
* naive isolation: one ``pytest FILE::test_i`` process per test. It is slow, so
  only --naive-tests of the N tests are run and their per-test cost is
  extrapolated to N (the output says so);
* pytest-isolate's ``--isolate`` (fork) as a reference, when it is installed:
  ``-p no:timeout`` is added to its run, since pytest-isolate quietly runs every
  test in-process while pytest-timeout is loaded, and ``-p no:pytest_isolate``
  to every other run, so that its plugin taxes none of them;
* the bare start-up ``python -c "import pytest, torch"``.

Every configuration runs once per round, in an order rotated from round to round
so that drift hits all of them alike, and the best of --repeat rounds is kept.
Each test appends its process id to a log, which is checked after every run: all
N tests ran, in one process (in-process) or in N (isolated). Every pytest run has
``-q -p no:cacheprovider`` and the plugins as installed (``--no-hypothesis``
adds ``-p no:hypothesispytest``); PYTEST_ADDOPTS is cleared. A failed command
ends the run with its output's tail, except pytest-isolate's, whose failure is
shown in its row and below the table.

Prints the wall times, their ratio to in-process, the overhead per test
((wall - in-process) / N) and, for the spawn rows, that overhead as a ratio to
the bare start-up; then whether the targets are met: forkserver wall <= 1.3x
in-process, and spawn overhead per test <= 1.2x the bare start-up.

    python bench/overhead.py [--quick] [--tests 40] [--repeat 3] [--naive-tests 5]
                             [--device cpu|cuda] [--sleep S] [--no-hypothesis]
                             [--only WORDS]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

FORKSERVER_TARGET = 1.3  # forkserver wall / in-process wall
SPAWN_TARGET = 1.2  # spawn overhead per test / bare start-up
MODULE = "test_tiny_torch.py"
PIDS = "pids.log"


@dataclass
class Config:
    label: str
    kind: str  # "pytest", "naive" or "bare"
    args: list[str] = field(default_factory=list)  # added to the common pytest arguments
    isolated: bool = False  # one process per test expected
    spawn: bool = False  # its overhead is compared with the bare start-up
    times: list[float] = field(default_factory=list)
    failed: str = ""  # why it could not be measured (pytest-isolate only)
    error: str = ""  # the gist of that, for its row


def write_suite(cwd: Path, n: int, device: str, sleep: float = 0.0) -> None:
    (cwd / "pytest.ini").write_text("[pytest]\n")  # no stray ini from a parent directory
    mark = "@pytest.mark.gpu_isolated\n" if device == "cuda" else ""
    wait = f"    time.sleep({sleep!r})\n" if sleep else ""
    head = (
        "import os\nimport time\n\nimport pytest\nimport torch\n\n"
        f"DEVICE = {device!r}\nPIDS = {str(cwd / PIDS)!r}\n\n\n"
        "def record():\n"
        "    with open(PIDS, 'a') as log:\n"
        "        log.write(f'{os.getpid()}\\n')\n"
    )
    tests = "".join(
        f"\n\n{mark}def test_{i}():\n"
        "    record()\n"
        f"{wait}"
        f"    x = torch.arange(4, device=DEVICE) * {i}\n"
        f"    assert x.sum().item() == {6 * i}\n"
        for i in range(n)
    )
    (cwd / MODULE).write_text(head + tests)


def tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float):
    """Run ``cmd``; return (seconds, exit status, output). Kills its whole session on timeout."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return time.perf_counter() - start, None, out
    return time.perf_counter() - start, proc.returncode, out


def check(cfg: Config, cmd: list[str], rc: int | None, out: str, pids: Path, tests: int) -> str:
    """Why this run does not count ("" when it does): exit status, then the tests' process ids."""
    if rc is None:
        why = "timed out"
    elif rc != 0:
        why = f"exit status {rc}"
    elif cfg.kind == "bare":
        return ""
    else:
        seen = pids.read_text().split() if pids.exists() else []
        expected = tests if cfg.isolated else 1
        if len(seen) == tests and len(set(seen)) == expected:
            return ""
        procs = len(set(seen))
        why = f"{len(seen)} of {tests} tests ran, in {procs} process(es), {expected} expected"
    return f"{why}\n  command: {shlex.join(cmd)}\n--- output tail ---\n{tail(out)}"


def measure(
    cfg: Config, common: list[str], names: list[str], cwd: Path, env: dict[str, str], opts
) -> float:
    """One timed run of ``cfg`` (for naive: the sum over ``names``, one process each)."""
    py = sys.executable
    if cfg.kind == "bare":
        cmds = [[py, "-c", "import pytest, torch"]]
    elif cfg.kind == "naive":
        cmds = [[py, "-m", "pytest", *common, *cfg.args, f"{MODULE}::{name}"] for name in names]
    else:
        cmds = [[py, "-m", "pytest", *common, *cfg.args, MODULE]]
    total = 0.0
    pids = cwd / PIDS
    for cmd in cmds:
        pids.unlink(missing_ok=True)
        seconds, rc, out = run(cmd, cwd, env, opts.timeout)
        why = check(cfg, cmd, rc, out, pids, 1 if cfg.kind == "naive" else opts.tests)
        if why:
            if cfg.label.startswith("pytest-isolate"):
                cfg.failed = why
                cfg.error = error_line(out) or why.splitlines()[0]
                return 0.0
            sys.exit(f"{cfg.label}: {why}")
        total += seconds
    return total


def error_line(out: str) -> str:
    """The first ``E   ...`` line of a pytest failure in ``out``, else ""."""
    for line in out.splitlines():
        if line.startswith("E   "):
            return line[4:].strip()
    return ""


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def machine_line() -> str:
    cpus = os.cpu_count()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cpus
    line = (
        f"machine: {cpus} CPUs ({usable} usable), Python {platform.python_version()}, "
        f"torch {version('torch')}, numpy {version('numpy')}, pytest {version('pytest')}, "
        f"{platform.platform()}"
    )
    threads = [f"{name}={os.environ[name]}" for name in THREAD_ENV if name in os.environ]
    if threads:  # they decide how many threads numpy's OpenBLAS and OpenMP start
        line += f", {' '.join(threads)}"
    if sys.dont_write_bytecode:  # every process then re-rewrites what has no .pyc yet
        line += ", PYTHONDONTWRITEBYTECODE set"
    return line


def plugins_line() -> str:
    names = sorted(
        f"{ep.name} {ep.dist.version if ep.dist else '?'}"
        for ep in importlib.metadata.entry_points(group="pytest11")
    )
    return "pytest plugins installed: " + ", ".join(names)


def cuda_missing() -> str:
    """Why the tests could not allocate on cuda here ("" when they can).

    Asked of a separate interpreter: this one starts every measured run, and keeps
    no CUDA state of its own.
    """
    probe = (
        "import sys, torch\n"
        "if not torch.cuda.is_available():\n"
        "    built = torch.version.cuda or 'no'\n"
        "    sys.exit(f'torch {torch.__version__} sees no CUDA device (built for CUDA: {built})')\n"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300
        )
    except subprocess.TimeoutExpired:
        return "checking for a CUDA device took over 300 s"
    if done.returncode == 0:
        return ""
    lines = done.stderr.strip().splitlines()
    return lines[-1] if lines else f"the check exited with status {done.returncode}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 tests, 1 round, naive on 2")
    parser.add_argument("--tests", type=int, help="tests in the suite (default 40)")
    parser.add_argument("--repeat", type=int, help="rounds; the best is kept (default 3)")
    parser.add_argument(
        "--naive-tests", type=int, help="tests run the naive way, then extrapolated (default 5)"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--sleep",
        type=float,
        default=0.0,
        metavar="S",
        help="each test also sleeps S seconds (a stand-in for GPU work, which leaves the "
        "CPU to prewarming); default 0",
    )
    parser.add_argument(
        "--no-hypothesis", action="store_true", help="add -p no:hypothesispytest to every run"
    )
    parser.add_argument("--timeout", type=float, default=900, help="limit per command, s")
    parser.add_argument(
        "--only",
        metavar="WORDS",
        help="measure only the configurations whose label contains one of these "
        "comma-separated words (in-process and the bare start-up are always measured)",
    )
    opts = parser.parse_args()
    if opts.tests is None:
        opts.tests = 10 if opts.quick else 40
    if opts.repeat is None:
        opts.repeat = 1 if opts.quick else 3
    if opts.naive_tests is None:
        opts.naive_tests = 2 if opts.quick else 5
    n = opts.tests
    naive_n = max(0, min(opts.naive_tests, n))
    if n < 1 or opts.repeat < 1:
        parser.error("--tests and --repeat must be at least 1")
    if not 0 <= opts.sleep <= 60:
        parser.error(f"--sleep must be from 0 to 60 seconds, not {opts.sleep:g}")
    if opts.device == "cuda":
        missing = cuda_missing()
        if missing:
            sys.exit(f"overhead.py: --device cuda: {missing}")

    have_isolate = importlib.util.find_spec("pytest_isolate") is not None
    have_timeout = importlib.util.find_spec("pytest_timeout") is not None
    # pytest-randomly off: the same order in every configuration (and its releases before
    # 3.11 or so crash without the cache provider)
    common = ["-q", "-p", "no:cacheprovider", "-p", "no:randomly"]
    if opts.no_hypothesis:
        common += ["-p", "no:hypothesispytest"]
    others = ["-p", "no:pytest_isolate"] if have_isolate else []
    inproc_args = [*others, "--no-gpu-isolate"]  # marked (cuda) tests in-process too
    configs = [
        Config("in-process", "pytest", inproc_args),
        Config(
            "spawn, prewarm off",
            "pytest",
            [*others, "--gpu-isolate", "--gpu-isolate-start=spawn", "--gpu-isolate-prewarm=0"],
            isolated=True,
            spawn=True,
        ),
        Config(
            "spawn, prewarm 1",
            "pytest",
            [*others, "--gpu-isolate", "--gpu-isolate-start=spawn"],
            isolated=True,
            spawn=True,
        ),
        Config(
            "spawn, prewarm 2",
            "pytest",
            [*others, "--gpu-isolate", "--gpu-isolate-start=spawn", "--gpu-isolate-prewarm=2"],
            isolated=True,
            spawn=True,
        ),
        Config(
            "forkserver (default), prewarm 1",
            "pytest",
            [*others, "--gpu-isolate"],
            isolated=True,
        ),
        Config(
            "forkserver, no pre-collect",
            "pytest",
            [
                *others,
                "--gpu-isolate",
                "--gpu-isolate-start=forkserver",
                "--gpu-isolate-no-precollect",
            ],
            isolated=True,
        ),
        Config("naive: pytest per test", "naive", inproc_args, isolated=True),
    ]
    isolate = Config(
        "pytest-isolate --isolate",
        "pytest",
        ["--isolate", "--no-gpu-isolate", *(["-p", "no:timeout"] if have_timeout else [])],
        isolated=True,
    )
    if have_isolate:
        configs.append(isolate)
    bare = Config('python -c "import pytest, torch"', "bare")
    configs.append(bare)
    if naive_n == 0:
        configs = [c for c in configs if c.kind != "naive"]
    if opts.only:
        words = [w.strip() for w in opts.only.split(",") if w.strip()]
        keep = [configs[0], bare, *(c for c in configs if any(w in c.label for w in words))]
        configs = [c for c in configs if c in keep]
        have_isolate = have_isolate and isolate in keep

    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    names = [f"test_{i}" for i in range(naive_n)]
    print(machine_line())
    print(plugins_line())
    print(
        f"{n} tiny torch tests on {opts.device}"
        + (f", each sleeping {opts.sleep:g} s" if opts.sleep else "")
        + f", best of {opts.repeat} round"
        f"{'s' if opts.repeat != 1 else ''}; every pytest run: "
        f"python -m pytest {shlex.join(common)} ...",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="gpuiso-overhead-") as tmp:
        cwd = Path(tmp)
        write_suite(cwd, n, opts.device, opts.sleep)
        # Untimed warm-up: the page cache, and a first check that the suite passes.
        measure(bare, common, names, cwd, env, opts)
        measure(configs[0], common, names, cwd, env, opts)
        if have_isolate:  # a broken reference is reported, not timed
            measure(isolate, common, names, cwd, env, opts)
            if isolate.failed:
                configs.remove(isolate)
        for r in range(opts.repeat):
            k = r % len(configs)
            for cfg in configs[k:] + configs[:k]:
                cfg.times.append(measure(cfg, common, names, cwd, env, opts))
            print(f"  round {r + 1}/{opts.repeat} done", file=sys.stderr, flush=True)

    inproc = min(configs[0].times)
    start_up = min(bare.times)
    rows = [c for c in configs if c is not bare and c is not isolate] + [isolate, bare]
    print()
    print(
        f"{'configuration':<34}{'wall s':>9}{'worst s':>9}{'x in-proc':>11}"
        f"{'overhead/test':>15}{'/ start-up':>12}"
    )
    result: dict[str, float] = {}  # label -> overhead per test, s
    for cfg in rows:
        label = cfg.label
        if not have_isolate and cfg is isolate:
            print(f"{label:<34}not installed (pip install pytest-isolate)")
            continue
        if cfg.failed:
            print(f"{label:<34}failed: {cfg.error}")
            continue
        wall, worst = min(cfg.times), max(cfg.times)
        if cfg.kind == "naive" and naive_n < n:
            wall, worst = wall / naive_n * n, worst / naive_n * n
            label += f" ({naive_n}->{n})*"
        line = f"{label:<34}{wall:>9.2f}{worst:>9.2f}{wall / inproc:>10.2f}x"
        if cfg is not configs[0] and cfg.kind != "bare":
            per_test = (wall - inproc) / n
            result[cfg.label] = per_test
            line += f"{per_test * 1000:>12.0f} ms"
            if cfg.spawn:
                line += f"{per_test / start_up:>11.2f}x"
        print(line)
    naive = next((c for c in configs if c.kind == "naive"), None)
    if naive is None:
        if naive_n == 0:
            print("naive: skipped (--naive-tests 0)")
    elif naive_n < n:
        print(
            f"* naive: measured on {naive_n} of the {n} tests ({min(naive.times) / naive_n:.2f} s "
            f"a test, best round), extrapolated x {n}"
        )
    if isolate.failed:
        why = isolate.failed.splitlines()
        print(f"pytest-isolate failed, not timed: {why[0]}\n{why[1]}\n  last line: {why[-1]}")

    print()
    if opts.sleep:
        print("targets: not judged with --sleep (they are set for the tiny tests alone)")
        return
    print("targets:")
    fork = next((c for c in configs if c.label.startswith("forkserver")), None)
    if fork is not None:
        ratio = min(fork.times) / inproc
        met = "met" if ratio <= FORKSERVER_TARGET else "NOT met"
        print(f"  forkserver wall <= {FORKSERVER_TARGET}x in-process: {ratio:.2f}x, {met}")
    parts = []
    for cfg in configs:
        if cfg.spawn:
            r = result[cfg.label] / start_up
            parts.append(f"{cfg.label} {r:.2f}x {'met' if r <= SPAWN_TARGET else 'NOT met'}")
    if parts:
        print(
            f"  spawn overhead/test <= {SPAWN_TARGET}x bare start-up ({start_up * 1000:.0f} ms): "
            + "; ".join(parts)
        )


if __name__ == "__main__":
    main()
