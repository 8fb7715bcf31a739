"""Running the scripts of bench/ from tests (tests/project/test_bench*.py): each as a
subprocess of this interpreter, from the repository's root."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT

BENCH = ROOT / "bench" / "overhead.py"


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCH), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )


def bench_table(*args: str) -> str:
    """The output of a benchmark run that must succeed."""
    done = bench(*args)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def overhead_module():
    """bench/overhead.py as a module (it is a script, not in a package)."""
    spec = importlib.util.spec_from_file_location("gpuiso_bench_overhead", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def row(out: str, label: str) -> list[str]:
    """The numbers of the table row that starts with ``label``."""
    for line in out.splitlines():
        if line.startswith(label):
            return line[len(label) :].split()
    raise AssertionError(f"no row {label!r} in:\n{out}")


def run_script(name: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run bench/NAME with this interpreter, from the repository's root."""
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def validation(
    out: Path, *steps: str, python: str = sys.executable, step_timeout: str | None = "120"
) -> subprocess.CompletedProcess:
    """Run bench/gpu_validation.sh; ``step_timeout`` None: each step's own bound."""
    env = {**os.environ, "OUT": str(out), "PYTHON": python}
    env.pop("STEP_TIMEOUT", None)
    if step_timeout is not None:
        env["STEP_TIMEOUT"] = step_timeout
    return subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_validation.sh"), *steps],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
