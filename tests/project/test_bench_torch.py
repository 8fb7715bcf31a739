"""The benchmarks whose suites import torch (bench/overhead.py, bench/ranks.py, the torch
step of bench/gpu_validation.sh) run to their end and print their tables (no timing
asserted). Without torch (the README's test command) they skip; CI's ML stage runs them.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT
from tests.helpers.benches import bench_table, overhead_module, row, validation

pytestmark = [
    pytest.mark.ml,
    pytest.mark.skipif(
        importlib.util.find_spec("torch") is None, reason="the benchmarks' suites import torch"
    ),
]


def test_overhead_prints_ratios_and_targets():
    out = bench_table("--tests", "3", "--repeat", "1", "--naive-tests", "1", "--only", "forkserver")
    assert "3 tiny torch tests on cpu, best of 1 round" in out
    inproc = row(out, "in-process")
    assert inproc[2] == "1.00x", inproc
    fork = row(out, "forkserver (default), prewarm 1")
    wall, worst, ratio = float(fork[0]), float(fork[1]), fork[2]
    assert 0 < wall <= worst
    # the ratio is the row's wall over in-process's, both printed rounded to 10 ms and the
    # ratio to 0.01: the difference is at most what that rounding explains
    shown, base = float(ratio.rstrip("x")), float(inproc[0])
    rounding = 0.005 + 0.005 * (1.005 + shown) / (base - 0.005) + 1e-9
    assert abs(shown - wall / base) <= rounding, (fork, inproc)
    assert re.search(r"^forkserver, no pre-collect\s+[\d.]+\s+[\d.]+\s+[\d.]+x", out, re.M), out
    assert "spawn" not in out.split("configuration", 1)[1].split("targets:")[0]  # --only kept out
    assert re.search(r"forkserver wall <= 1.3x in-process: [\d.]+x, (met|NOT met)", out), out


def test_overhead_with_sleeping_tests_judges_no_target():
    out = bench_table(
        "--tests", "2", "--repeat", "1", "--only", "forkserver (default)", "--sleep", "0.2"
    )
    assert "2 tiny torch tests on cpu, each sleeping 0.2 s, best of 1 round" in out
    assert float(row(out, "in-process")[0]) > 0.4  # two tests that sleep 0.2 s each
    assert float(row(out, "forkserver (default), prewarm 1")[0]) > 0.4
    assert "targets: not judged with --sleep" in out  # they are set for tiny tests alone
    assert "forkserver wall <=" not in out


@pytest.mark.parametrize(
    ("script", "args", "prefix"),
    [
        ("overhead.py", ("--device", "cuda", "--quick"), r"overhead\.py: --device cuda"),
        ("memory_leases.py", ("--cuda",), r"memory_leases\.py: --cuda"),
    ],
)
def test_a_cuda_bench_without_a_device_says_why_in_one_line(script, args, prefix):
    """Without a CUDA device (a CPU build of torch, or no GPU) it stops at once, in one line."""
    if not overhead_module().cuda_missing():  # a GPU machine: the bench would run (minutes)
        pytest.skip("a CUDA device is visible here")
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout == ""
    [line] = done.stderr.strip().splitlines()
    assert re.fullmatch(
        rf"{prefix}: torch \S+ sees no CUDA device \(built for CUDA: \S+\)", line
    ), line


def test_gpu_validation_torch_step_checks_that_import_torch_leaves_a_forkable_process(tmp_path):
    done = validation(tmp_path, "torch")
    log = (tmp_path / "torch.log").read_text()
    assert done.returncode == 0, log
    assert "forkable after import torch: yes" in log, log


def test_ranks_bench_prints_every_configuration_and_both_targets():
    """bench/ranks.py on 1 test a suite, at world size 2 (4 costs CI's ML stage 20 s
    more, and runs the same code): each configuration's row (every test of each passed,
    or the bench exits 1 with pytest's tail), then the two targets."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "ranks.py"), "--tests", "1", "--repeat", "1"]
        + ["--world", "2"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "1 test a suite, best of 1 round (wall seconds" in out, out
    for label in ("ranks=1 (one isolated process a test)", "ranks=2"):
        assert re.search(rf"^{re.escape(label)}\s+\d+\.\d\d\s+\d+ ms$", out, re.M), out
    assert "ranks=4" not in out and "spawn 4" not in out  # --world 2 only
    assert re.search(r"^spawn 2 ranks per test\s+\d+\.\d\d\s+\d+ ms$", out, re.M), out
    assert re.search(r"2 ranks: spawning per test / ranks=2: \d+\.\dx \(target >= 5x\)", out)
    assert re.search(r"2 ranks: each rank past the first adds -?\d+ ms", out), out
    assert re.search(r"^  (all met|NOT all met)$", out, re.M), out


@pytest.mark.parametrize(
    "args, said",
    [
        (("--tests", "0"), "--tests must be at least 1"),
        (("--repeat", "0"), "--repeat must be at least 1"),
        (("--world", "1,2"), "--world must be world sizes of 2 or more, such as 2,4: not 1,2"),
    ],
)
def test_ranks_bench_bad_arguments_are_one_line(args, said):
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "ranks.py"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.splitlines()[-1].endswith(f"error: {said}"), done.stderr
