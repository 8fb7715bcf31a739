"""Exclusive GPU leases vs memory leases: N tests, each holding X GiB of one GPU for a while.

Builds a suite of N isolated tests that each declare ``gpu_memory=X GiB`` and then work
for --hold seconds, and runs it side by side in one run with ``pytest -n W`` under:

* exclusive: today's default, one test per GPU at a time (no ``gpu_memory``, slots 1);
* memory leases: tests packed onto the GPU while their leases fit its memory.

Without --cuda (CPU machines, CI) the GPU is declared (``--gpu-isolate-devices=0:SIZE``)
and each test sleeps: this measures the scheduling alone. With --cuda each test
allocates X GiB less 256 MiB on its GPU with torch (the rest of its lease is room for the
matmuls' buffers) and runs matmuls for --hold seconds, on the machine's GPU 0 (its size
from NVML); the lease caps torch's allocator, and a test over it fails the run. It first
checks, in a separate interpreter, that torch sees a CUDA device, and stops with one line
saying why not.

For each: the wall time, the most tests that held the GPU at once (from the tests' own
start/end times), and the throughput ratio memory/exclusive. Best of --repeat rounds.

    python bench/memory_leases.py [--tests 16] [--gib 4] [--workers 8] [--hold 1]
    python bench/memory_leases.py --cuda --tests 16 --gib 4 --workers 16   # on a GPU
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

from overhead import cuda_missing  # bench/ is this script's first import path

HEADROOM_GIB = 0.25  # of each lease left free with --cuda, for the matmuls' buffers

SUITE = """
import os
import time

import pytest

LOG = os.environ["BENCH_LOG"]


@pytest.mark.parametrize("i", range({tests}))
@pytest.mark.gpu_isolated({marker})
def test_holds_gpu_memory(i):
    start = time.time()
    if {cuda}:
        import torch

        block = torch.empty(int(({gib} - {headroom}) * (1 << 30)), dtype=torch.uint8, device="cuda")
        a = torch.randn(2048, 2048, device="cuda")
        while time.time() - start < {hold}:
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
        del block
    else:
        time.sleep({hold})
    with open(LOG, "a") as log:
        log.write(f"{{start}} {{time.time()}}\\n")
"""

CONFIGS = {"exclusive": "exclusive (whole GPU per test)", "memory": "memory leases"}


def most_at_once(log: Path) -> int:
    events = []
    for line in log.read_text().splitlines():
        start, end = map(float, line.split())
        events += [(start, 1), (end, -1)]
    level = peak = 0
    for _, step in sorted(events):
        level += step
        peak = max(peak, level)
    return peak


def run(directory: Path, args: argparse.Namespace, config: str) -> tuple[float, int, int]:
    """Wall seconds, most tests on the GPU at once, tests that passed."""
    suite = directory / f"test_{config}.py"
    marker = f'gpu_memory="{args.gib:g}GiB"' if config == "memory" else ""
    suite.write_text(
        SUITE.format(
            tests=args.tests,
            marker=marker,
            cuda=args.cuda,
            gib=args.gib,
            headroom=HEADROOM_GIB,
            hold=args.hold,
        )
    )
    log, report = directory / f"{config}.log", directory / f"report-{config}.json"
    log.unlink(missing_ok=True)
    devices = "auto" if args.cuda else f"0:{args.device_gib:g}GiB"
    command = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
        "-n", str(args.workers), f"--gpu-isolate-devices={devices}",
        f"--gpu-isolate-report={report}", suite.name,
    ]  # fmt: skip
    env = {**os.environ, "PYTEST_GPUISO_LEASE_REGION": str(directory / "leases")}
    env["BENCH_LOG"] = str(log)
    began = time.monotonic()
    done = subprocess.run(command, cwd=directory, env=env, capture_output=True, text=True)
    wall = time.monotonic() - began
    if done.returncode != 0:
        raise SystemExit(f"pytest failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    records = json.loads(report.read_text())["tests"]
    return wall, most_at_once(log), sum(r["outcome"] == "passed" for r in records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=int, default=16)
    parser.add_argument("--gib", type=float, default=4.0, help="GiB each test leases")
    parser.add_argument("--device-gib", type=float, default=80.0, help="declared GPU (no --cuda)")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--hold", type=float, default=1.0, help="seconds each test works")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--cuda", action="store_true", help="allocate and compute on GPU 0")
    args = parser.parse_args()
    if args.cuda and args.gib <= HEADROOM_GIB:
        parser.error(
            f"--gib must be over {HEADROOM_GIB:g} with --cuda (that much of each lease stays free)"
        )
    missing = cuda_missing() if args.cuda else ""
    if missing:
        raise SystemExit(f"memory_leases.py: --cuda: {missing}")
    where = "GPU 0 (NVML)" if args.cuda else f"a declared {args.device_gib:g} GiB GPU"
    print(
        f"# {platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d')}; {args.tests} tests x {args.gib:g} GiB on {where}, "
        f"{args.hold:g} s each, -n {args.workers}, best of {args.repeat}"
    )
    best: dict[str, tuple[float, int, int]] = {}
    with tempfile.TemporaryDirectory(prefix="gpuiso-bench-") as tmp:
        for _ in range(args.repeat):
            for config in CONFIGS:  # side by side, alternating
                result = run(Path(tmp), args, config)
                if config not in best or result[0] < best[config][0]:
                    best[config] = result
    print("| configuration | wall | most tests on the GPU at once | passed |")
    print("|---|---|---|---|")
    for config, label in CONFIGS.items():
        wall, most, passed = best[config]
        print(f"| {label} | {wall:.2f} s | {most} | {passed}/{args.tests} |")
    ratio = best["exclusive"][0] / best["memory"][0]
    print()
    print(f"memory leases vs exclusive: throughput {ratio:.2f}x")


if __name__ == "__main__":
    main()
