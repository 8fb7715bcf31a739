"""Where a GPU-leasing isolated test's time goes, against the floor a fresh process pays.

For the GPU machine (``bash bench/gpu_validation.sh phases``); every part is bounded and
prints as it goes, so a run cut short still says what it measured. Parts:

* ``floor``: what any fresh process pays to use the GPU once, measured alone: a spawned
  interpreter (start, ``import torch``, ``torch.cuda.is_available()`` = cuInit, the first
  ``torch.ones(1, device="cuda")`` = the primary context and torch's CUDA state, a
  synchronize, ``os._exit`` until ``waitpid`` returns = the context's teardown), and the
  same from a ``fork()`` of a process that imported torch (what the fork server does), and
  a fork that only uses the CPU. Medians of ``--floor-runs``.
* ``suites``: ``--tests`` one-line tests ``torch.ones(1, device="cuda")`` and as many that
  never touch CUDA (``torch.zeros(1)``), each file run in-process, ``--gpu-isolate`` with
  spawn and with the fork server (every isolated test leases the GPU). Per run: the
  session's wall time, the overhead per test against in-process, and medians of the JSON
  report's ``lease_wait``, ``startup`` (the test's turn until its protocol began),
  ``duration``, ``after`` (its end until its process was gone) and, from the test itself,
  ``cuda`` (its first CUDA operation, inside ``duration``). The target (issue 46):
  overhead <= 1.2 x the floor + 15 ms for a CUDA test, <= 15 ms for one that never uses it.
* ``profile``: the fork-server run of the CUDA tests again under cProfile; the functions
  of ours (and the waits) that took the most time in pytest's process.
* ``real``: suites installed with their tests (``--pyargs opt_einsum``, ``einops``) in-process
  and under ``--gpu-isolate`` (fork server; every test leases the GPU), with the same medians.

    python bench/gpu_phases.py [--parts floor,suites,profile,real] [--tests 20]
                               [--floor-runs 5] [--out DIR] [--timeout S]

Needs torch with CUDA and a GPU; without one it says so in one line and exits 2
(``GPUPHASES_DEVICE=cpu`` runs it all on the CPU instead: a dry run of the script).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FLOOR_SPAWN = r"""
import os, sys, time
t0 = time.monotonic()
DEVICE = os.environ.get("GPUPHASES_DEVICE", "cuda")
import torch
t1 = time.monotonic()
ok = torch.cuda.is_available()
t2 = time.monotonic()
x = torch.ones(1, device=DEVICE)
t3 = time.monotonic()
torch.cuda.synchronize() if DEVICE == "cuda" else None
t4 = time.monotonic()
sys.stdout.write(f"{t0} {t1} {t2} {t3} {t4} {time.monotonic()}\n")
sys.stdout.flush()
os._exit(0)
"""

FLOOR_FORK = r"""
import os, sys, time, json
import torch
runs = int(sys.argv[1])
cuda = sys.argv[2] == "cuda" and os.environ.get("GPUPHASES_DEVICE", "cuda") == "cuda"
out = []
for _ in range(runs):
    r, w = os.pipe()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        a = time.monotonic()
        if cuda:
            torch.cuda.is_available()
            b = time.monotonic()
            torch.ones(1, device="cuda")
            c = time.monotonic()
            torch.cuda.synchronize()
        else:
            torch.zeros(1)
            b = c = time.monotonic()
        d = time.monotonic()
        os.write(w, f"{a} {b} {c} {d} {time.monotonic()}".encode())
        os._exit(0)
    os.close(w)
    a, b, c, d, e = map(float, os.read(r, 200).split())
    os.close(r)
    os.waitpid(pid, 0)
    end = time.monotonic()
    out.append({"start": a - t0, "cuinit": b - a, "context": c - b, "sync": d - c,
                "exit": end - e, "total": end - t0})
print(json.dumps(out))
"""

TEST_CUDA = """
import os, time
import torch

def _note(name, took):
    path = os.environ.get("GPUPHASES_NOTES")
    if path:
        with open(path, "a") as f:
            f.write(f"{name} {took}\\n")

{tests}
"""

ONE_CUDA = """
def test_cuda_{i}():
    t = time.monotonic()
    x = torch.ones(1, device=os.environ.get("GPUPHASES_DEVICE", "cuda"))
    assert x.item() == 1.0
    _note("cuda", time.monotonic() - t)
"""

ONE_CPU = """
def test_cpu_{i}():
    assert torch.zeros(1).sum().item() == 0.0
"""

CONFIGS = {
    "in-process": ["--no-gpu-isolate"],
    "spawn": ["--gpu-isolate", "--gpu-isolate-start=spawn"],
    "forkserver": ["--gpu-isolate", "--gpu-isolate-start=forkserver"],
}


def say(*args: object) -> None:
    print(*args, flush=True)


def med(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:8.1f}" if values else f"{'-':>8}"


def floor(runs: int, timeout: float) -> dict:
    """The floor: a spawned interpreter and a fork, each using CUDA once."""
    spawned = []
    for _ in range(runs):
        t = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-c", FLOOR_SPAWN], capture_output=True, text=True, timeout=timeout
        )
        end = time.monotonic()
        if proc.returncode:
            say("floor: the spawned probe failed:", proc.stderr.strip().splitlines()[-1:])
            return {}
        t0, t1, t2, t3, t4, t5 = map(float, proc.stdout.split())
        spawned.append(
            {
                "interpreter": t0 - t,
                "import torch": t1 - t0,
                "cuinit": t2 - t1,
                "context + first op": t3 - t2,
                "synchronize": t4 - t3,
                "exit": end - t5,
                "total": end - t,
                "cuda total": (t4 - t1) + (end - t5),
            }
        )
    result = {"spawn": spawned}
    for kind in ("cuda", "cpu"):
        proc = subprocess.run(
            [sys.executable, "-c", FLOOR_FORK, str(runs), kind],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode:
            say(f"floor: the {kind} fork probe failed:", proc.stderr.strip().splitlines()[-1:])
            continue
        result[f"fork {kind}"] = json.loads(proc.stdout)
    say(f"\n== floor (medians of {runs}, ms)")
    for name, rows in result.items():
        keys = list(rows[0]) if rows else []
        say(f"{name:>10}: " + "  ".join(f"{k} {med([r[k] for r in rows]).strip()}" for k in keys))
    return result


def make_suite(root: Path, n: int) -> dict[str, Path]:
    root.mkdir(parents=True, exist_ok=True)
    (root / "conftest.py").write_text("")
    files = {}
    for kind, one in (("cuda", ONE_CUDA), ("cpu", ONE_CPU)):
        tests = "".join(one.format(i=i) for i in range(n))
        path = root / f"test_{kind}.py"
        path.write_text(TEST_CUDA.replace("{tests}", tests))
        files[kind] = path
    return files


def run_pytest(args: list[str], cwd: Path, timeout: float, env: dict | None = None) -> tuple:
    t = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return None, time.monotonic() - t, out
    return proc.returncode, time.monotonic() - t, proc.stdout + proc.stderr


def records(path: Path) -> list[dict]:
    try:
        return [r for r in json.loads(path.read_text())["tests"] if r.get("outcome")]
    except (OSError, ValueError, KeyError):
        return []


def header_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("gpu-isolate:")][:8]


def summarise(
    name: str,
    code,
    wall: float,
    base: float | None,
    n: int,
    recs: list[dict],
    notes: list[float],
    out: str,
) -> dict:
    tail = out.strip().splitlines()[-1:] if out.strip() else []
    per = (wall - base) / n if base is not None else None
    row = {
        "config": name,
        "exit": code,
        "wall": wall,
        "overhead_per_test": per,
        "lease_wait": [r.get("lease_wait") or 0.0 for r in recs],
        "startup": [r["startup"] for r in recs if r.get("startup") is not None],
        "duration": [r["duration"] for r in recs],
        "after": [
            r["wall"] - r["startup"] - r["duration"] for r in recs if r.get("startup") is not None
        ],
        "cuda": notes,
        "methods": sorted({(r.get("start") or {}).get("method") for r in recs} - {None}),
        "last_line": tail,
    }
    say(
        f"{name:>12} exit {code}  {wall:7.2f} s  "
        + (f"{per * 1000:7.1f} ms/test over in-process  " if per is not None else " " * 30)
        + f"lease {med(row['lease_wait'])} start {med(row['startup'])} dur "
        f"{med(row['duration'])} cuda {med(notes)} after {med(row['after'])}  "
        f"{','.join(row['methods'])}  {' '.join(tail)}"
    )
    for line in header_lines(out):
        say(" " * 14 + line)
    return row


def suites(work: Path, n: int, timeout: float) -> list[dict]:
    files = make_suite(work / "suite", n)
    rows = []
    for kind, path in files.items():
        say(
            f"\n== {n} tests that {'use CUDA once' if kind == 'cuda' else 'never touch CUDA'}"
            " (ms: medians of the JSON report's fields)"
        )
        base = None
        for name, opts in CONFIGS.items():
            report = work / f"{kind}-{name}.json"
            notes_path = work / f"{kind}-{name}.notes"
            env = dict(os.environ, GPUPHASES_NOTES=str(notes_path))
            code, wall, out = run_pytest(
                [*opts, f"--gpu-isolate-report={report}", path.name], path.parent, timeout, env
            )
            notes = []
            if notes_path.exists():
                notes = [float(line.split()[1]) for line in notes_path.read_text().splitlines()]
            row = summarise(name, code, wall, base, n, records(report), notes, out)
            row["kind"] = kind
            rows.append(row)
            if name == "in-process":
                base = wall
    return rows


def profile(work: Path, n: int, timeout: float) -> None:
    files = make_suite(work / "suite", n)
    prof = work / "forkserver.prof"
    t = time.monotonic()
    try:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "cProfile",
                "-o",
                str(prof),
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                *CONFIGS["forkserver"],
                files["cuda"].name,
            ],
            cwd=files["cuda"].parent,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        say("profile: timed out")
        return
    say(
        f"\n== pytest's process under cProfile, {n} CUDA tests, fork server "
        f"({time.monotonic() - t:.2f} s with the profiler)"
    )
    import io
    import pstats

    for sort, pattern in (("cumulative", "pytest_gpuiso"), ("tottime", "")):
        buf = io.StringIO()
        stats = pstats.Stats(str(prof), stream=buf)
        stats.sort_stats(sort).print_stats(pattern, 25 if pattern else 12)
        lines = [line for line in buf.getvalue().splitlines() if line.strip()]
        start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
        say(f"-- by {sort}" + (f" ({pattern})" if pattern else ""))
        for line in lines[start : start + (26 if pattern else 13)]:
            say(line[:200])


def real(work: Path, timeout: float) -> list[dict]:
    rows = []
    for suite in ("opt_einsum", "einops"):
        probe = subprocess.run(
            [sys.executable, "-c", f"import {suite}.tests"], capture_output=True, timeout=60
        )
        if probe.returncode:
            say(f"\n== {suite}: its tests are not installed; skipped")
            continue
        say(f"\n== {suite} (--pyargs {suite}.tests)")
        base = None
        for name in ("in-process", "forkserver"):
            report = work / f"real-{suite}-{name}.json"
            code, wall, out = run_pytest(
                [*CONFIGS[name], f"--gpu-isolate-report={report}", "--pyargs", f"{suite}.tests"],
                work,
                timeout,
            )
            recs = records(report)
            n = len(recs) or max(1, _count(out))
            row = summarise(name, code, wall, base, n, recs, [], out)
            row["suite"] = suite
            rows.append(row)
            if name == "in-process":
                base = wall
    return rows


def _count(out: str) -> int:
    import re

    found = re.findall(r"(\d+) (?:passed|failed|skipped|xfailed|error)", out)
    return sum(int(x) for x in found)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="floor,suites,profile,real")
    parser.add_argument("--tests", type=int, default=20)
    parser.add_argument("--floor-runs", type=int, default=5)
    parser.add_argument("--out", default=os.environ.get("OUT") or None)
    parser.add_argument("--timeout", type=float, default=150.0, help="per pytest run")
    args = parser.parse_args()
    parts = args.parts.split(",")
    unknown = set(parts) - {"floor", "suites", "profile", "real"}
    if unknown:
        parser.error(f"unknown part(s): {', '.join(sorted(unknown))}")
    check = subprocess.run(
        [sys.executable, "-c", "import torch; assert torch.cuda.is_available()"],
        capture_output=True,
        timeout=120,
    )
    if check.returncode and os.environ.get("GPUPHASES_DEVICE", "cuda") == "cuda":
        say("gpu_phases: torch sees no CUDA device here; nothing to measure")
        return 2
    out_dir = Path(args.out) if args.out else None
    results: dict = {"tests": args.tests}
    with tempfile.TemporaryDirectory(prefix="gpuphases-") as tmp:
        work = Path(tmp)
        if "floor" in parts:
            results["floor"] = floor(args.floor_runs, 120)
        if "suites" in parts:
            results["suites"] = suites(work, args.tests, args.timeout)
        if "profile" in parts:
            profile(work, args.tests, args.timeout)
        if "real" in parts:
            results["real"] = real(work, args.timeout)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "gpu_phases.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
