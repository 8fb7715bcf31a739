"""A chatty test, isolated and in-process, side by side: what writing a lot to a captured
stdout costs pytest (wall time, and the peak memory of pytest's own process).

The test writes ``--mb`` MiB to stdout (captured, as by default) and passes. Each mode
runs ``--repeat`` times in a fresh pytest; the table shows the medians and the ratios
isolated / in-process. An isolated test's captured output reaches pytest cut to its
last 16 Mi characters per section (docs/semantics.md, "Differences, by design"), so
pytest's memory stays flat while in-process it holds the whole output (twice, briefly).

    python bench/chatty.py [--mb 1024] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

TEST = """
import os, sys, pytest

@pytest.mark.gpu_isolated(timeout=600)
def test_chatty():
    chunk = "y" * (1 << 20)
    for _ in range(int(os.environ["CHATTY_MB"])):
        sys.stdout.write(chunk)
"""

CONFTEST = """
def pytest_unconfigure(config):
    if not config.pluginmanager.has_plugin("gpuiso-child"):
        with open("/proc/self/status") as f:
            hwm = next(line for line in f if line.startswith("VmHWM")).split()[1]
        with open("peak_kib.txt", "w") as f:
            f.write(hwm)
"""


def run(directory: Path, mb: int, isolated: bool) -> tuple[float, float]:
    """One pytest run: its wall seconds and its own peak RSS in MiB."""
    # shuffling one test means nothing here, and pytest-randomly before 3.11 fails at
    # configure without the cache plugin
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly"]
    args += ["-p", "no:xdist"]
    args += ["--gpu-isolate-preload=none", "--gpu-isolate-devices=none"]
    if not isolated:
        args.append("--no-gpu-isolate")
    env = {**os.environ, "CHATTY_MB": str(mb)}
    began = time.perf_counter()
    done = subprocess.run([*args, "test_chatty.py"], cwd=directory, env=env, capture_output=True)
    wall = time.perf_counter() - began
    if done.returncode != 0:
        said = (done.stdout + done.stderr).decode()[-2000:]
        sys.exit(f"chatty: pytest failed (exit {done.returncode}):\n{said}")
    return wall, int((directory / "peak_kib.txt").read_text()) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=1024, help="MiB the test writes (1024)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each mode (3)")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="chatty-") as tmp:
        directory = Path(tmp)
        (directory / "test_chatty.py").write_text(textwrap.dedent(TEST))
        (directory / "conftest.py").write_text(textwrap.dedent(CONFTEST))
        results: dict[str, list[tuple[float, float]]] = {"isolated": [], "in-process": []}
        for _ in range(options.repeat):  # alternated: load changes hit both modes alike
            results["isolated"].append(run(directory, options.mb, True))
            results["in-process"].append(run(directory, options.mb, False))
    print(f"a test writing {options.mb} MiB to captured stdout, {options.repeat} runs each")
    print(f"{'mode':<12}{'wall s':>10}{'pytest peak MiB':>18}")
    medians = {}
    for mode, runs in results.items():
        wall = statistics.median(r[0] for r in runs)
        peak = statistics.median(r[1] for r in runs)
        medians[mode] = (wall, peak)
        print(f"{mode:<12}{wall:>10.2f}{peak:>18.0f}")
    (iso_wall, iso_peak), (in_wall, in_peak) = medians["isolated"], medians["in-process"]
    print(
        f"{'ratio':<12}{iso_wall / in_wall:>9.2f}x{iso_peak / in_peak:>17.2f}x"
        "  (isolated / in-process)"
    )


if __name__ == "__main__":
    main()
