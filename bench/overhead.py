"""Per-test overhead of isolation, measured side by side in one run.

Builds a suite of N trivial tests in a temporary directory and times, on the
same machine and in the same run:

* in-process pytest,
* ``pytest --gpu-isolate`` (one spawned process per test),
* the bare interpreter start-up ``python -c "import pytest"`` as a reference,

each with and without the hypothesis plugin (it costs ~0.6 s a process when
installed). Prints wall times and ratios.

    python bench/overhead.py [--tests 20] [--repeat 3]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def timed(cmd: list[str], cwd: Path) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"command failed: {' '.join(cmd)}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return elapsed


def best(cmd: list[str], cwd: Path, repeat: int) -> float:
    return min(timed(cmd, cwd) for _ in range(repeat))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=3)
    opts = parser.parse_args()
    n = opts.tests
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        body = "\n".join(f"def test_{i}():\n    assert {i} == {i}\n" for i in range(n))
        (cwd / "test_trivial.py").write_text(body)
        py = sys.executable
        base = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_trivial.py"]
        rows = []
        for label, extra in (
            ("with hypothesis plugin", []),
            ("-p no:hypothesispytest", ["-p", "no:hypothesispytest"]),
        ):
            inproc = best(base + extra, cwd, opts.repeat)
            isolated = best(base + extra + ["--gpu-isolate"], cwd, opts.repeat)
            startup = best([py, "-c", "import pytest"], cwd, opts.repeat)
            per_test = (isolated - inproc) / n
            rows.append((label, inproc, isolated, per_test, startup))
        print(f"{n} trivial tests, best of {opts.repeat}, Python {sys.version.split()[0]}")
        print(
            f"{'plugins':<26}{'in-process':>12}{'isolated':>12}{'ratio':>8}"
            f"{'overhead/test':>15}{'python -c import pytest':>26}"
        )
        for label, inproc, isolated, per_test, startup in rows:
            print(
                f"{label:<26}{inproc:>11.2f}s{isolated:>11.2f}s{isolated / inproc:>7.1f}x"
                f"{per_test * 1000:>12.0f} ms{startup * 1000:>23.0f} ms"
            )


if __name__ == "__main__":
    main()
