"""Distributed tests: ``ranks=N`` against spawning N ranks per test, side by side in one run.

Builds, in a temporary directory, suites of --tests tests (20 by default) whose every
test runs a gloo ``all_reduce`` over N ranks (torch's CPU build is enough), and times,
on the same machine and in the same run, each whole pytest run:

* ``ranks=N``: ``@pytest.mark.gpu_isolated(ranks=N)`` (the default start method: each
  rank forked from the fork server's template), for N = 2 and 4;
* the peers' way: a plain test that spawns its N ranks with
  ``torch.multiprocessing.spawn`` (what ``MultiProcessTestCase`` does: N fresh
  interpreters a test), run in-process, for N = 2 and 4;
* ``ranks=1``: the same tests as single isolated processes (each does its op alone),
  the reference for what one more rank costs.

Every configuration runs once per round, in an order rotated from round to round, and
the best of --repeat rounds is kept. A run whose tests do not all pass ends the bench
with its output's tail. Prints each wall time, the per-test time, the spawn-per-test
time as a multiple of ``ranks=N`` (target: at least 5x) and what each rank past the
first adds to a test, against a whole single-process isolated test (target: less).

    python bench/ranks.py [--tests N] [--repeat R] [--timeout S] [--world 2,4]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BODY = """
import os

import pytest
import torch
import torch.distributed as dist


def all_reduce():
    dist.init_process_group("gloo", init_method="env://")
    world = dist.get_world_size()
    t = torch.ones(4) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    assert t[0].item() == world * (world + 1) / 2
    dist.destroy_process_group()
"""

OURS = (
    BODY
    + """

@pytest.mark.parametrize("i", range({tests}))
@pytest.mark.gpu_isolated(ranks={ranks})
def test_all_reduce(i):
    if {ranks} == 1:
        assert (torch.ones(4) * 2).sum().item() == 8  # alone: no group to reduce over
    else:
        all_reduce()
"""
)

SPAWNED = (
    BODY
    + """
import socket

import torch.multiprocessing as mp


def rank_main(rank, world, port):
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    all_reduce()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("i", range({tests}))
def test_all_reduce(i):
    mp.spawn(rank_main, args=({ranks}, free_port()), nprocs={ranks}, join=True)
"""
)


def tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def timed(cmd: list[str], cwd: Path, timeout: float) -> tuple[float, int, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    start = time.perf_counter()
    proc = subprocess.run(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout
    )
    return time.perf_counter() - start, proc.returncode, proc.stdout.decode(errors="replace")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument(
        "--world", default="2,4", help="the world sizes to time, each >= 2 (default: 2,4)"
    )
    opts = parser.parse_args()
    for name in ("tests", "repeat"):
        if getattr(opts, name) < 1:
            parser.error(f"--{name} must be at least 1")
    try:
        worlds = sorted({int(w) for w in opts.world.split(",")})
    except ValueError:
        worlds = []
    if not worlds or worlds[0] < 2:
        parser.error(f"--world must be world sizes of 2 or more, such as 2,4: not {opts.world}")
    try:
        import torch.distributed  # noqa: F401  (in this interpreter: the suites need it)
    except ImportError as exc:
        print(f"ranks bench: needs torch with torch.distributed ({exc})", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="gpuiso-ranks-bench-"))
    configs: dict[str, list[str]] = {}
    runs = [("ranks=1 (one isolated process a test)", OURS, 1)]
    runs += [(f"ranks={w}", OURS, w) for w in worlds]
    runs += [(f"spawn {w} ranks per test", SPAWNED, w) for w in worlds]
    for label, source, ranks in runs:
        name = f"test_{label.split()[0].replace('=', '')}_{ranks}.py"
        (work / name).write_text(source.format(tests=opts.tests, ranks=ranks))
        isolate = ["--gpu-isolate-timeout=300"] if source is OURS else ["-p", "no:gpuiso"]
        configs[label] = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", name]
        configs[label] += isolate
    best: dict[str, float] = {}
    labels = list(configs)
    for round_ in range(opts.repeat):
        shift = round_ % len(labels)
        for label in labels[shift:] + labels[:shift]:
            seconds, code, out = timed(configs[label], work, opts.timeout)
            if code != 0:
                print(f"ranks bench: {label}: pytest exited {code}\n{tail(out)}", file=sys.stderr)
                return 1
            best[label] = min(best.get(label, seconds), seconds)
        print(f"  round {round_ + 1}/{opts.repeat} done", file=sys.stderr)
    n = opts.tests
    tests = f"{n} test{'s' if n != 1 else ''} a suite"
    rounds = f"best of {opts.repeat} round{'s' if opts.repeat != 1 else ''}"
    print(f"\n{tests}, {rounds} (wall seconds of the whole run)\n")
    print(f"{'configuration':40} {'wall s':>8} {'per test':>10}")
    for label in labels:
        print(f"{label:40} {best[label]:8.2f} {best[label] / n * 1000:8.0f} ms")
    one = best[labels[0]] / n
    print("\ntargets:")
    met = True
    for ranks in worlds:
        ours, spawned = best[f"ranks={ranks}"], best[f"spawn {ranks} ranks per test"]
        ratio = spawned / ours
        met &= ratio >= 5
        print(f"  {ranks} ranks: spawning per test / ranks={ranks}: {ratio:.1f}x (target >= 5x)")
        extra = (ours / n - one) / (ranks - 1)
        met &= extra <= one
        print(
            f"  {ranks} ranks: each rank past the first adds {extra * 1000:.0f} ms to a test, "
            f"a single-process isolated test costs {one * 1000:.0f} ms (target: less)"
        )
    print("  all met" if met else "  NOT all met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
