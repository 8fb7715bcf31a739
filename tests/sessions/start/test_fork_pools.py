"""The fork server in an ML environment: numpy's OpenBLAS (and torch's OpenMP) threads.

numpy's OpenBLAS starts nproc - 1 worker threads at import; a fork server that imported
numpy (as ``import torch`` does) used to refuse every fork for them. It now stops that
pool before forking (OpenBLAS's own before-fork handler), and each test starts the pool
it would have had in-process: the same thread counts, the user's OPENBLAS_NUM_THREADS
still winning, no deadlock in a threaded matmul or a torch CPU op. A thread that no
library stops still makes it refuse, with the import that started it named once.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

import pytest

from tests.helpers import REPORT, GpuIso, make_gpuiso

# what changes with torch and numpy beside the plugin: CI's ML stage runs these again there
pytestmark = pytest.mark.ml
pytest.importorskip("numpy")  # both are in the test extras
pytest.importorskip("threadpoolctl")
# torch is looked for, never imported here: pytester takes the modules a test imported out
# of sys.modules again, and torch cannot be imported twice in one process.
needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="torch is not installed"
)

POOLS = "test_fork_pools.py"
BOUND = "--gpu-isolate-timeout=120"  # a deadlocked pool would hang: fail instead


@pytest.fixture
def iso(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> GpuIso:
    iso = make_gpuiso(pytester, monkeypatch, "forkserver")
    iso.copy(POOLS)
    return iso


@pytest.fixture
def pools_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    log = tmp_path / "pools.jsonl"
    monkeypatch.setenv("GPUISO_POOLS_LOG", str(log))
    return log


def _seen(log: Path) -> dict[str, dict]:
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    log.unlink()
    return {row.pop("test"): row for row in rows}


def _start_warnings(result: pytest.RunResult) -> list[str]:
    return [line for line in result.outlines if ": GpuIsoStartWarning: " in line]


def _in_process(iso: GpuIso, log: Path) -> dict[str, dict]:
    result = iso.pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "no:randomly", POOLS, timeout=300
    )
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) + outcomes.get("skipped", 0) == 4, result.stdout.str()
    return _seen(log)


@pytest.mark.parametrize("preload", ["numpy", "none"], ids=["server-imports", "template"])
@pytest.mark.parametrize("user_threads", [None, "1"], ids=["default", "OPENBLAS_NUM_THREADS=1"])
def test_forked_tests_get_the_pools_they_would_have_had_in_process(
    iso: GpuIso, pools_log: Path, monkeypatch: pytest.MonkeyPatch, preload, user_threads
) -> None:
    """numpy imported by the server (preload) or by the template collecting the module:
    every test is forked, none falls back to spawn, and each sees the BLAS/OpenMP
    thread counts an in-process run sees (threadpoolctl), the user's setting included."""
    if user_threads is not None:
        monkeypatch.setenv("OPENBLAS_NUM_THREADS", user_threads)
        monkeypatch.setenv("OMP_NUM_THREADS", user_threads)
    expected = _in_process(iso, pools_log)
    result = iso.run(
        "-v", "--gpu-isolate", f"--gpu-isolate-preload={preload}", BOUND, REPORT, POOLS
    )
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) + outcomes.get("skipped", 0) == 4, result.stdout.str()
    assert not _start_warnings(result)
    result.stdout.fnmatch_lines(["gpu-isolate: started 4 forkserver; *; 4 pre-collected"])
    records = iso.records()
    assert {r["start"]["method"] for r in records.values()} == {"forkserver"}
    seen = _seen(pools_log)
    assert len({row["pid"] for row in seen.values()}) == len(seen)  # one process each
    for name, row in seen.items():
        assert row["pools"] == expected[name]["pools"], (name, row, expected[name])
        assert row.get("torch") == expected[name].get("torch"), (name, row, expected[name])
    if user_threads is not None:
        assert seen["blas0"]["pools"]["openblas"] == 1


def test_forked_pools_hold_under_xdist(iso: GpuIso, pools_log: Path) -> None:
    """-n 2: each worker's server imported numpy; every test forked, same pools."""
    expected = _in_process(iso, pools_log)
    result = iso.run("--gpu-isolate", "-n", "2", "--gpu-isolate-preload=numpy", BOUND, POOLS)
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) + outcomes.get("skipped", 0) == 4, result.stdout.str()
    assert not _start_warnings(result)
    seen = _seen(pools_log)
    assert {name: row["pools"] for name, row in seen.items()} == {
        name: row["pools"] for name, row in expected.items()
    }


def test_a_thread_no_library_stops_makes_the_server_refuse_once(iso: GpuIso) -> None:
    """A preload module starts a Python thread at import: the server refuses to fork, the
    tests run with spawn, and one warning (of the session, not under a test) names the
    import and the thread."""
    iso.copy("start_thread_mod.py")
    iso.pytester.makepyfile(test_two="def test_one():\n    pass\n\n\ndef test_two():\n    pass\n")
    result = iso.run(
        "--gpu-isolate", "--gpu-isolate-preload=start_thread_mod", REPORT, "test_two.py"
    )
    result.assert_outcomes(passed=2, warnings=1)
    [warning] = _start_warnings(result)
    # located at the line of ours that issued it (a file, not a made-up name)
    assert re.match(r".*/pytest_gpuiso/[\w/]+\.py:\d+: GpuIsoStartWarning: ", warning), warning
    assert (
        "the fork server refused to fork: the fork server has 2 threads (importing "
        "start_thread_mod started 1; gpuiso-test-poller); a fork could deadlock; isolated "
        "tests are started with spawn instead"
    ) in warning
    assert "test_two.py" not in warning
    assert {r["start"]["method"] for r in iso.records().values()} == {"spawn"}


@needs_torch
def test_openmp_threads_started_at_import_are_named(iso: GpuIso) -> None:
    """A preload module runs a torch op at import: GNU OpenMP's threads are running, and
    they cannot be stopped before a fork. The server refuses, naming the import and the
    runtime."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("OpenMP starts no thread on one CPU")
    iso.copy("start_omp_mod.py")
    iso.pytester.makepyfile(test_one="def test_one():\n    pass\n")
    result = iso.run("--gpu-isolate", "--gpu-isolate-preload=start_omp_mod", "test_one.py")
    [warning] = _start_warnings(result)
    assert "the fork server refused to fork: the fork server has" in warning
    assert "importing start_omp_mod started" in warning
    assert "native threads, of GNU OpenMP" in warning


@needs_torch
def test_forty_tiny_torch_tests_are_all_forked(iso: GpuIso) -> None:
    """The issue's measure: torch and numpy installed, the server preloading torch, 40
    tiny torch tests: every one forked from the server (none falls back to spawn)."""
    tests = "".join(
        f"\n\ndef test_{i}():\n    assert torch.arange(4).mul({i}).sum().item() == {6 * i}\n"
        for i in range(40)
    )
    iso.pytester.makepyfile(test_tiny_torch="import torch" + tests)
    result = iso.run("-v", "--gpu-isolate", "--gpu-isolate-preload=torch", "test_tiny_torch.py")
    result.assert_outcomes(passed=40)
    assert not _start_warnings(result)
    result.stdout.fnmatch_lines(["gpu-isolate: started 40 forkserver; *"])


@pytest.mark.parametrize("openblas", [True, False])
def test_threads_a_shutdown_joined_are_waited_for_until_they_are_gone(
    monkeypatch: pytest.MonkeyPatch, openblas: bool
) -> None:
    """pthread_join returns a moment before a joined thread leaves /proc/self/task: after
    OpenBLAS's shutdown, quiesce waits (briefly) for the count to fall; without one, a
    thread is reported at once."""
    from pytest_gpuiso.forkserver import pools

    counts = iter([3, 3, 2, 1])
    shut: list[str] = []
    library = type("Library", (), {pools.SHUTDOWN: lambda self: shut.append("down")})()
    monkeypatch.setattr(pools, "threads", lambda: next(counts))
    kind = "OpenBLAS" if openblas else "GNU OpenMP"
    monkeypatch.setattr(pools, "loaded_pools", lambda: [("/lib/libpool.so", kind)])
    monkeypatch.setattr(pools.ctypes, "CDLL", lambda path, mode: library)
    assert pools.quiesce() == (1 if openblas else 3)
    assert shut == (["down"] if openblas else [])
