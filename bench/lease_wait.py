"""A GPU-bound suite under xdist with one GPU: how long the leased GPU sits idle.

Builds a suite of N isolated tests that each hold the (declared, fake) GPU 0 for
--hold seconds, in a module whose import takes --import-s seconds (as torch's
does), and runs it side by side in one run with ``pytest -n W
--gpu-isolate-devices=0`` under:

* prewarm 0: a test's process starts only once it holds its lease, so the GPU
  waits for an interpreter, pytest and the module's import each time;
* prewarm 1 (the default): the next test's process is started while a test runs,
  and a test that waits for its lease has its process started while it waits; it
  collects the test's module then too, so the lease is not spent importing it;
* forkserver: each test's process is forked from a template that collected the
  module once (per xdist worker).

For each: the wall time, the ideal (N x hold: the GPU never idle), and the
leased-but-idle time summed over tests (the JSON record's ``startup``: from the
test's turn, just after its lease, until it began). Best of --repeat rounds.

    python bench/lease_wait.py [--quick] [--tests 16] [--workers 4] [--hold 1.0]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SUITE = """
import time

import pytest

time.sleep({import_s})  # a heavy import (torch, a model library)


@pytest.mark.gpu_isolated(gpus=1)
@pytest.mark.parametrize("i", range({tests}))
def test_holds_the_gpu(i):
    time.sleep({hold})
"""


CONFIGS = {
    ("spawn", 0): "spawn, prewarm 0 (cold after the lease)",
    ("spawn", 1): "spawn, prewarm 1",
    ("forkserver", 1): "forkserver, prewarm 1 (default)",
}


def run(directory: Path, workers: int, start: str, prewarm: int) -> tuple[float, float, int]:
    """Wall seconds, summed leased-idle seconds, tests that passed."""
    report = directory / f"report-{start}-{prewarm}.json"
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:randomly",
        "-n",
        str(workers),
        "--gpu-isolate-devices=0",
        f"--gpu-isolate-start={start}",
        f"--gpu-isolate-prewarm={prewarm}",
        f"--gpu-isolate-report={report}",
        "test_gpu_bound.py",
    ]
    env = {**os.environ, "PYTEST_GPUISO_LEASE_REGION": str(directory / "leases")}
    began = time.monotonic()
    done = subprocess.run(command, cwd=directory, env=env, capture_output=True, text=True)
    wall = time.monotonic() - began
    if done.returncode != 0:
        raise SystemExit(f"pytest failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    records = json.loads(report.read_text())["tests"]
    idle = sum(r["startup"] or 0.0 for r in records)
    return wall, idle, sum(r["outcome"] == "passed" for r in records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 tests, 1 round")
    parser.add_argument("--tests", type=int, default=16)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--hold", type=float, default=1.0, help="seconds each test holds the GPU")
    parser.add_argument("--import-s", type=float, default=1.0, help="seconds of module import")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    if args.quick:
        args.tests, args.repeat = 8, 1
    print(
        f"# {platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d')}; {args.tests} tests holding 1 GPU for {args.hold:g} s, "
        f"import {args.import_s:g} s, -n {args.workers}, best of {args.repeat}"
    )
    ideal = args.tests * args.hold
    best: dict[tuple[str, int], tuple[float, float, int]] = {}
    with tempfile.TemporaryDirectory(prefix="gpuiso-bench-") as tmp:
        directory = Path(tmp)
        (directory / "test_gpu_bound.py").write_text(
            SUITE.format(import_s=args.import_s, tests=args.tests, hold=args.hold)
        )
        for _ in range(args.repeat):
            for config in CONFIGS:  # side by side, alternating
                result = run(directory, args.workers, *config)
                if config not in best or result[0] < best[config][0]:
                    best[config] = result
    print("| configuration | wall | × ideal | leased GPU idle (sum) | passed |")
    print("|---|---|---|---|---|")
    for config, label in CONFIGS.items():
        wall, idle, passed = best[config]
        print(
            f"| {label} | {wall:.2f} s | {wall / ideal:.2f}× | {idle:.2f} s | "
            f"{passed}/{args.tests} |"
        )
    cold = best[("spawn", 0)]
    print()
    for config, name in ((("spawn", 1), "prewarm 1 vs 0"), (("forkserver", 1), "forkserver vs 0")):
        warm = best[config]
        print(
            f"{name}: wall {warm[0] / cold[0]:.2f}×, leased-idle "
            f"{warm[1] / cold[1] if cold[1] else float('nan'):.2f}× (ideal wall {ideal:.1f} s)"
        )


if __name__ == "__main__":
    main()
