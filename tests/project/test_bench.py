"""The scripts of bench/ without torch run to their end and print their tables (no timing
asserted), and a bad argument is one line. Those whose suites import torch are in
test_bench_torch.py."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT
from tests.helpers.benches import bench, run_script, validation


@pytest.mark.parametrize("value", ["-1", "61", "nan"])
def test_overhead_bad_sleep_is_a_usage_error(value):
    done = bench("--sleep", value)
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1].endswith(
        f"error: --sleep must be from 0 to 60 seconds, not {float(value):g}"
    ), done.stderr


def test_gpu_validation_unknown_step_is_one_line(tmp_path):
    done = validation(tmp_path, "facts", "tets")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "gpu_validation.sh: unknown step 'tets' "
        "(steps: facts build torch tests cuda-bench cpu-bench mem-bench health phases faults)"
    ]
    assert not (tmp_path / "facts.log").exists()  # nothing ran


def test_gpu_validation_logs_each_step_and_its_status(tmp_path):
    """A failing step is logged and summarised; the next still runs; the exit is 1."""
    # (not the tests step: on a GPU machine it would run tests/gpu beside this suite)
    done = validation(tmp_path, "facts")
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert [line.split()[:2] for line in summary] == [["facts", "0"]], summary
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"Python {sys.version.split()[0]}" in (tmp_path / "facts.log").read_text()
    # a step that fails: here the torch check, through a $PYTHON that fails on stdin scripts
    env_python = tmp_path / "python-failing-on-stdin"
    env_python.write_text(f'#!/bin/sh\n[ "$1" = - ] && exit 3\nexec {sys.executable} "$@"\n')
    env_python.chmod(0o755)
    done = validation(tmp_path / "b", "torch", "facts", python=str(env_python), step_timeout=None)
    assert done.returncode == 1, done.stdout + done.stderr
    summary = (tmp_path / "b" / "summary.txt").read_text().splitlines()
    assert [line.split()[:2] for line in summary] == [["torch", "3"], ["facts", "0"]], summary


def test_gpu_validation_step_over_its_bound_is_ended(tmp_path):
    slow_python = tmp_path / "slow-python"
    slow_python.write_text("#!/bin/sh\nsleep 30\n")
    slow_python.chmod(0o755)
    done = validation(tmp_path, "torch", python=str(slow_python), step_timeout="1")
    assert done.returncode == 1, done.stdout + done.stderr
    [line] = (tmp_path / "summary.txt").read_text().splitlines()
    name, status, seconds = line.split()
    assert (name, status) == ("torch", "124")  # timeout's status
    assert int(seconds.rstrip("s")) < 15


def test_lease_wait_bench_runs_and_prints_every_configuration() -> None:
    """bench/lease_wait.py on a tiny suite: every row, every test passed, the ratio lines."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "lease_wait.py"), "--tests", "4", "--hold", "0.1"]
        + ["--import-s", "0.1", "--workers", "2", "--repeat", "1"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for label in (
        "| spawn, prewarm 0 (cold after the lease) |",
        "| spawn, prewarm 1 |",
        "| forkserver, prewarm 1 (default) |",
    ):
        [line] = [line for line in done.stdout.splitlines() if line.startswith(label)]
        assert line.rstrip().endswith("| 4/4 |"), line
    for name in ("prewarm 1 vs 0", "forkserver vs 0"):
        assert re.search(rf"{name}: wall \d+\.\d\d×", done.stdout), done.stdout


def test_memory_leases_bench_packs_tests_and_prints_the_ratio() -> None:
    """bench/memory_leases.py on a tiny suite: both rows, every test passed, exclusive never
    more than one test on the GPU, the ratio line. (That memory leases do hold several at
    once is proven without timing in tests/sessions/gpus/test_memory_leases.py.)"""
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "memory_leases.py"), "--tests", "4", "--gib", "1"]
        + ["--device-gib", "4", "--workers", "2", "--hold", "0.5"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {
        line.split("|")[1].strip(): line.split("|")[3:5]
        for line in done.stdout.splitlines()
        if line.startswith("| exclusive") or line.startswith("| memory")
    }
    assert rows["exclusive (whole GPU per test)"] == [" 1 ", " 4/4 "], done.stdout
    most, passed = rows["memory leases"]
    assert int(most) >= 1 and passed.strip() == "4/4", done.stdout
    assert re.search(r"memory leases vs exclusive: throughput \d+\.\d\dx", done.stdout)


def test_chatty_bench_prints_both_modes_and_their_ratio() -> None:
    done = run_script("chatty.py", "--mb", "1", "--repeat", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "a test writing 1 MiB to captured stdout, 1 runs each"
    assert [line.split()[0] for line in lines[2:]] == ["isolated", "in-process", "ratio"]


def test_health_bench_prints_both_parts_and_the_target_ratio() -> None:
    """bench/health_cost.py on the simulated GPU (no driver here): the NVML part with its
    ratio to the 10 ms target, and the driver part; the healthy GPU shows no problem."""
    done = run_script("health_cost.py", "--repeat", "5", "--sim")
    if done.returncode == 2 and "no gcc" in done.stdout:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(
        r"NVML part of the probe: median \d+\.\d+ ms, p95 \d+\.\d+ ms; \d+\.\d+x the 10 ms "
        r"target, .*; found: nothing",
        done.stdout,
    ), done.stdout
    assert re.search(r"driver part \(a fresh process\): \d+ ms; .*found: nothing", done.stdout)


def test_page_faults_bench_prints_each_cost_and_its_ratios() -> None:
    """bench/page_faults.py runs and prints every row (no timing asserted)."""
    done = run_script("page_faults.py", "--pages", "64", "--repeat", "1", timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    for row in ("copy-on-write write in a fork", "zero-fill write", "write to a private page"):
        assert re.search(rf"{row}\s+\d+\.\d+ us a page", done.stdout), done.stdout
    assert re.search(r"fork \+ _exit \+ waitpid\s+\d+\.\d+ ms", done.stdout), done.stdout
    assert "ratios: copy-on-write / rewrite" in done.stdout
    bad = run_script("page_faults.py", "--import", "no_such_mod_xyz", timeout=60)
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines() == [
        "page_faults.py: cannot import no_such_mod_xyz: No module named 'no_such_mod_xyz'"
    ]


@pytest.mark.parametrize(
    "args, said",
    [
        (("--suite", "nope"), "error: --suite: unknown nope; known: iniconfig, "),
        (("--fastest", "0"), "error: --fastest must be at least 1"),
        (("--modes", "forkserver,fast"), "error: --modes: unknown fast; known: "),
        (("--suite", "pluggy", "--fastest", "2"), "error: --suite and --fastest exclude"),
    ],
)
def test_fidelity_bad_arguments_are_one_line(args, said):
    """bench/fidelity.py (CI's last stage runs its three fastest suites, downloading them):
    a bad argument is one line, before anything is downloaded."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "fidelity.py"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 2
    assert said in done.stderr.strip().splitlines()[-1], done.stderr
