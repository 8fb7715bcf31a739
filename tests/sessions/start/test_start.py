"""Start methods: the fork server, preloading, prewarming and their fallbacks.

The sessions run the programs in fixtures/programs/ (test_start_*.py, start_*.py).
Their tests log how their process was started (``start_log``: pid, parent,
creation time on the boot clock, whether the preload module was there and who
imported it) as JSON lines; the tests here check those lines, the outcomes, the
JSON report's ``start`` records, the warnings summary and the processes left.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import (
    REPORT,
    USAGE_ERROR,
    GpuIso,
    kill_quietly,
    make_gpuiso,
    program,
    wait_gone,
)

PRELOAD = "start_preload_mod"
TICK = 1 / os.sysconf("SC_CLK_TCK")  # resolution of a process's creation time
HOW_TO_CHOOSE = "(--gpu-isolate-start=spawn chooses it from the start)"

PROCS = "test_start_procs.py"
LOGGERS = [f"{PROCS}::test_logs_its_process[{i}]" for i in range(3)]
IMPORTER = f"{PROCS}::test_imports_the_preload_module_itself"


# --------------------------------------------------------------------------- helpers


@pytest.fixture
def forkserver_iso(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> GpuIso:
    return make_gpuiso(pytester, monkeypatch, "forkserver")


@pytest.fixture
def spawn_iso(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> GpuIso:
    return make_gpuiso(pytester, monkeypatch, "spawn")


class Logs:
    """The files the programs append to, named through environment variables."""

    def __init__(self, directory: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tests = directory / "tests.jsonl"  # start_log.log(): one line per test
        self.preload = directory / "preload.log"  # start_preload_mod: one pid per import
        self.imports = directory / "imports.jsonl"  # start_cuda_conftest: one line per import
        monkeypatch.setenv("GPUISO_START_LOG", str(self.tests))
        monkeypatch.setenv("GPUISO_START_PRELOAD_LOG", str(self.preload))
        monkeypatch.setenv("GPUISO_START_IMPORTS", str(self.imports))

    def by_test(self) -> dict[str, dict]:
        rows = _json_lines(self.tests)
        by_test = {row["test"]: row for row in rows}
        assert len(by_test) == len(rows), rows  # each test ran (and logged) once
        return by_test

    def preloaded_by(self) -> list[int]:
        if not self.preload.exists():
            return []
        return [int(pid) for pid in self.preload.read_text().split()]

    def conftest_imports(self) -> list[dict]:
        return _json_lines(self.imports)


def _json_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture
def logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Logs:
    directory = tmp_path / "logs"
    directory.mkdir()
    return Logs(directory, monkeypatch)


def _cuda_conftest(iso: GpuIso, monkeypatch: pytest.MonkeyPatch, lib: Path | None) -> None:
    """A conftest.py that loads ``lib`` (the fake driver) at import, in every process."""
    shutil.copy(program("start_cuda_conftest.py"), iso.path / "conftest.py")
    if lib is None:
        monkeypatch.delenv("GPUISO_FAKE_LIBCUDA", raising=False)
    else:
        monkeypatch.setenv("GPUISO_FAKE_LIBCUDA", str(lib))


def _starts(iso: GpuIso, *more: str) -> dict[str, dict]:
    """How each test's process started: method and prewarmed, and the ``more`` keys."""
    return {
        nodeid: {key: record["start"][key] for key in ("method", "prewarmed", *more)}
        for nodeid, record in iso.records().items()
    }


def _start_warnings(result: pytest.RunResult) -> list[str]:
    return [line for line in result.outlines if ": GpuIsoStartWarning: " in line]


# --------------------------------------------------------------------------- the default


def test_the_default_start_method_is_the_fork_server(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, logs: Logs
) -> None:
    """No start method named: the header says forkserver, and every test was forked."""
    iso = make_gpuiso(pytester, monkeypatch, None)
    iso.copy("start_log.py", "start_preload_mod.py", PROCS)
    result = iso.run("-v", "--gpu-isolate", REPORT, PROCS)
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(
        [
            "gpu-isolate: start forkserver (a server per pytest process *), preload none, *",
            "gpu-isolate: started 4 forkserver; *",
        ]
    )
    assert {start["method"] for start in _starts(iso).values()} == {"forkserver"}
    assert not _start_warnings(result)


def test_the_default_is_spawn_where_the_fork_server_is_not_safe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not Linux, or a sanitizer's runtime mapped: spawn, and the reason for the header."""
    from pytest_gpuiso.header import _start_header
    from pytest_gpuiso.settings import Settings
    from pytest_gpuiso.values import default_start

    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f10 r-xp 00000000 08:01 12 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
        "7f20-7f30 r-xp 00000000 08:01 13 /usr/lib/x86_64-linux-gnu/libasan.so.8.0.0\n"
    )
    method, why = default_start(str(maps))
    assert (method, why) == ("spawn", "a sanitizer's runtime is loaded (libasan.so.8.0.0)")
    settings = Settings("all", 900.0, "", 5.0, None, start=method, start_why=why)
    header = _start_header(settings)
    assert header.startswith(f"gpu-isolate: start spawn ({why}), preload")
    maps.write_text("7f00-7f10 r-xp 00000000 08:01 12 /usr/lib/libtsan_like_name.txt\n")
    assert default_start(str(maps)) == ("forkserver", "")  # only a runtime library counts
    monkeypatch.setattr(sys, "platform", "darwin")
    method, why = default_start(str(maps))
    assert method == "spawn" and "needs Linux" in why and "darwin" in why


def test_a_start_method_chosen_in_the_ini_file_is_kept(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, logs: Logs
) -> None:
    iso = make_gpuiso(pytester, monkeypatch, None)
    iso.copy("start_log.py", "start_preload_mod.py", PROCS)
    pytester.makeini("[pytest]\ngpu_isolate_start = spawn\n")
    result = iso.run("-v", "--gpu-isolate", "--gpu-isolate-prewarm=0", REPORT, PROCS)
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["gpu-isolate: start spawn, preload none, prewarm off"])
    assert {start["method"] for start in _starts(iso).values()} == {"spawn"}


# --------------------------------------------------------------------------- the fork server


@pytest.mark.ml
@pytest.mark.parametrize("seed", ["", "7"], ids=["unseeded", "seeded-at-import"])
def test_forked_tests_draw_their_own_torch_random_numbers(
    forkserver_iso: GpuIso, monkeypatch: pytest.MonkeyPatch, seed: str
) -> None:
    """torch's and numpy's global generators are reseeded in each fork, as a spawned
    process seeds them: unseeded, three forked tests draw three different numbers; a
    module that seeded torch at import gives each test that seed's first draw, as in a
    process that imported it itself."""
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("numpy") is None:
        pytest.skip("needs torch and numpy (CI's ML stage)")
    iso = forkserver_iso
    iso.copy("test_torch_draws.py")
    log = iso.path / "draws.log"
    monkeypatch.setenv("GPUISO_DRAWS_LOG", str(log))
    monkeypatch.setenv("GPUISO_TORCH_SEED", seed)
    result = iso.run("--gpu-isolate", "--gpu-isolate-preload=torch", REPORT, "test_torch_draws.py")
    result.assert_outcomes(passed=3)
    assert {start["method"] for start in _starts(iso).values()} == {"forkserver"}
    rows = [line.split() for line in log.read_text().splitlines()]
    assert len({pid for pid, _, _ in rows}) == 3, rows
    torch_draws = [float(value) for _, value, _ in rows]
    numpy_draws = {float(value) for _, _, value in rows}
    assert len(numpy_draws) == 3, rows
    if seed:  # what a fresh process that ran torch.manual_seed(7) draws first
        [first] = subprocess.run(
            [
                sys.executable,
                "-c",
                "import torch; torch.manual_seed(7); print(torch.rand(1).item())",
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout.split()
        assert torch_draws == [float(first)] * 3, rows
    else:
        assert len(set(torch_draws)) == 3, rows


@pytest.mark.parametrize(
    ("start", "prewarm"),
    [("forkserver", 1), ("spawn", 0), ("spawn", 1)],
    ids=["forkserver", "spawn-no-prewarm", "spawn-prewarm"],
)
def test_preload_and_where_the_processes_come_from(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, logs: Logs, start, prewarm
) -> None:
    """forkserver: every test runs in its own process forked from one server, which
    imported the preload module once; each process is pytest's own child. spawn without
    prewarming imports the preload module nowhere ahead of the tests; a prewarmed spawned
    process imports it itself while it waits."""
    iso = make_gpuiso(pytester, monkeypatch, start)
    iso.copy("start_log.py", "start_preload_mod.py", PROCS)
    preload, prewarming = f"--gpu-isolate-preload={PRELOAD}", f"--gpu-isolate-prewarm={prewarm}"
    result = iso.run("-v", "--gpu-isolate", preload, prewarming, REPORT, PROCS)
    result.assert_outcomes(passed=4)
    runs = logs.by_test()
    records = iso.records()
    assert sorted(runs) == sorted([*LOGGERS, IMPORTER])
    pids = [run["pid"] for run in runs.values()]
    assert len(set(pids)) == 4, runs  # a fresh process for every test
    for nodeid, run in runs.items():
        assert records[nodeid]["pid"] == run["pid"]
        # The test's parent is the pytest process this test started, under both methods.
        assert run["grandparent"] == os.getpid(), run
    [pytest_pid] = {run["ppid"] for run in runs.values()}
    prewarmed = {nodeid: nodeid != LOGGERS[0] and prewarm > 0 for nodeid in runs}
    assert _starts(iso) == {
        nodeid: {"method": start, "prewarmed": prewarmed[nodeid]} for nodeid in runs
    }
    preloaded_by = logs.preloaded_by()
    if start == "forkserver":
        result.stdout.fnmatch_lines(
            [
                f"gpu-isolate: start forkserver (*), preload {PRELOAD}, prewarm next 1 test",
                "gpu-isolate: started 4 forkserver; 3 prewarmed*",
            ]
        )
        # Imported once, by the server: neither pytest nor any test's process imported it,
        # yet every test found it imported (inherited through the fork), and the objects
        # the server froze for the garbage collector.
        [server] = preloaded_by
        assert server not in pids and server != pytest_pid
        for run in runs.values():
            assert run["before"] and run["preloaded_in"] == server, run
            assert run["frozen"] > 0, run
    elif prewarm == 0:
        result.stdout.fnmatch_lines(
            [f"gpu-isolate: start spawn, preload {PRELOAD}, prewarm off", "*started 4 spawn; 0*"]
        )
        # Nobody imported it ahead; the test that imports it did so in its own process.
        assert preloaded_by == [runs[IMPORTER]["pid"]]
        for run in runs.values():
            assert not run["before"], run
        assert runs[IMPORTER]["preloaded_in"] == runs[IMPORTER]["pid"]
        assert all(runs[nodeid]["preloaded_in"] is None for nodeid in LOGGERS)
    else:
        result.stdout.fnmatch_lines(["*started 4 spawn; 3 prewarmed; 3 pre-collected"])
        # Each prewarmed process imported it itself, while waiting for its go.
        ahead = [run for nodeid, run in runs.items() if prewarmed[nodeid]]
        assert sorted(preloaded_by) == sorted(run["pid"] for run in ahead)
        for run in ahead:
            assert run["before"] and run["preloaded_in"] == run["pid"], run
        assert not runs[LOGGERS[0]]["before"]


@pytest.mark.parametrize("prewarm", [1, 0])
def test_server_with_cuda_refuses_to_fork_and_tests_start_with_spawn(
    forkserver_iso: GpuIso, logs: Logs, fake_libcuda: Path, monkeypatch, prewarm
) -> None:
    """A conftest initialises the CUDA driver at import, so the fork server has too when
    asked to fork: it refuses, every test still passes (started with spawn), and the
    reason is said once."""
    iso = forkserver_iso
    iso.copy("start_log.py", "start_preload_mod.py", PROCS)
    _cuda_conftest(iso, monkeypatch, fake_libcuda)
    result = iso.run("-v", "--gpu-isolate", f"--gpu-isolate-prewarm={prewarm}", REPORT, PROCS)
    result.assert_outcomes(passed=4, warnings=1)
    [warning] = _start_warnings(result)
    assert "the fork server refused to fork: the CUDA driver is initialised" in warning
    assert f"{fake_libcuda}); isolated tests are started with spawn instead" in warning
    assert {start["method"] for start in _starts(iso).values()} == {"spawn"}
    result.stdout.fnmatch_lines(["gpu-isolate: started 4 spawn; *"])


def test_a_driver_only_mapped_keeps_the_fork_server_forking(
    forkserver_iso: GpuIso, logs: Logs, fake_libcuda: Path, monkeypatch
) -> None:
    """A conftest maps the CUDA driver at import without initialising it (as importing
    torch's CUDA 13 build does): the fork server, its template and prewarmed processes
    go on forking, with no warning."""
    iso = forkserver_iso
    iso.copy("start_log.py", "start_preload_mod.py", PROCS)
    _cuda_conftest(iso, monkeypatch, fake_libcuda)
    monkeypatch.setenv("GPUISO_FAKE_LIBCUDA_MAPPED", "1")
    result = iso.run("-v", "--gpu-isolate", "--gpu-isolate-prewarm=1", REPORT, PROCS)
    result.assert_outcomes(passed=4)
    assert _start_warnings(result) == []
    assert {start["method"] for start in _starts(iso).values()} == {"forkserver"}
    result.stdout.fnmatch_lines(["gpu-isolate: started 4 forkserver; * 4 pre-collected"])


def test_server_that_queried_nvml_refuses_to_fork(
    forkserver_iso: GpuIso, logs: Logs, fake_libnvml: Path, monkeypatch
) -> None:
    """NVML loaded at import (torch.cuda.device_count() does that) counts like the driver:
    its answer describes pytest's GPUs, not a test's lease. The server refuses, once."""
    iso = forkserver_iso
    iso.copy("start_log.py", "start_preload_mod.py", PROCS)
    _cuda_conftest(iso, monkeypatch, fake_libnvml)
    result = iso.run("--gpu-isolate", "--gpu-isolate-prewarm=0", REPORT, PROCS)
    result.assert_outcomes(passed=4, warnings=1)
    [warning] = _start_warnings(result)
    assert "refused to fork: the NVIDIA management library is loaded" in warning
    assert str(fake_libnvml) in warning and warning.endswith(f"spawn instead {HOW_TO_CHOOSE}")
    assert {start["method"] for start in _starts(iso).values()} == {"spawn"}


def test_our_processes_are_not_in_active_children(spawn_iso: GpuIso) -> None:
    """An in-process test that cleans up multiprocessing's children sees neither the fork
    server nor a prewarmed process (and so cannot kill one)."""
    spawn_iso.pytester.makepyfile(
        test_children="""
        import multiprocessing
        import pytest

        @pytest.mark.gpu_isolated
        def test_isolated_first():
            pass

        def test_in_process_sees_no_children():
            assert multiprocessing.active_children() == []

        @pytest.mark.gpu_isolated
        def test_isolated_after():
            pass
        """
    )
    for start in ("spawn", "forkserver"):
        result = spawn_iso.run("-v", f"--gpu-isolate-start={start}", "--gpu-isolate-prewarm=2")
        result.assert_outcomes(passed=3)
        result.stdout.fnmatch_lines([f"gpu-isolate: started 2 {start}; 1 prewarmed*"])


DRIVER_STATES = ["initialised", "mapped", "clean"]


@pytest.mark.parametrize("driver", DRIVER_STATES)
def test_a_fork_of_a_process_that_initialised_the_driver_counts_as_touched(
    fake_libcuda: Path, driver: str
) -> None:
    """cuda_state.touched() in a forked child names the driver its parent initialised; a
    driver only mapped (as torch's CUDA 13 build leaves it at import) is not CUDA state
    (in a subprocess: this process never maps the fake driver)."""
    seen = _probe("touched", fake_libcuda, driver)
    if driver == "initialised":
        expected = f"the CUDA driver is initialised ({fake_libcuda})"
        assert seen == {"parent": expected, "child": expected}
    else:
        assert seen == {"parent": None, "child": None}


def test_an_open_gpu_device_file_counts_as_touched(tmp_path: Path, monkeypatch) -> None:
    """cuInit and nvmlInit open /dev/nvidia*: a process holding one has touched CUDA (the
    device prefix points at a file of this test's, in this process)."""
    from pytest_gpuiso.child import cuda_state

    device = tmp_path / "nvidia0"
    device.write_bytes(b"")
    monkeypatch.setattr(cuda_state, "DEVICES", str(tmp_path / "nvidia"))
    assert cuda_state.open_device() is None
    with open(device, "rb"):
        assert cuda_state.open_device() == str(device)
        if cuda_state.loaded(cuda_state.NVML) is None:  # NVML would be named first
            assert cuda_state.touched() == f"a GPU device file is open ({device})"
    assert cuda_state.open_device() is None


@pytest.mark.parametrize("driver", DRIVER_STATES)
def test_an_isolated_process_with_cuda_state_refuses_to_run(
    fake_libcuda: Path, driver: str
) -> None:
    """child.main, started in a fork of a process that initialised the driver, sends an
    error naming libcuda and runs nothing; from a clean process, or one where the driver
    is only mapped, it runs its job, and says it is exiting last."""
    seen = _probe("child-main", fake_libcuda, driver)
    kinds = [kind for kind, _ in seen["frames"]]
    if driver == "initialised":
        assert (kinds, seen["status"]) == (["error"], 1), seen
        message = seen["frames"][0][1]
        assert "started with CUDA state it must not have" in message
        assert f"the CUDA driver is initialised ({fake_libcuda})" in message
    else:
        expected = ["ready", "begin", "end", "result", "done", "exiting"]
        assert (kinds, seen["status"]) == (expected, 0), seen
        assert seen["frames"][3][1] == seen["child"]  # the job ran, in the forked child


def test_unsafe_to_fork_reports_a_running_thread() -> None:
    """forkserver.fork.unsafe_to_fork() names the threads of a process that has more than one
    (in a subprocess: this process may have threads of its own, e.g. xdist's); a fork
    the template refuses for it names the template, not the server."""
    seen = _probe("threads", None)
    assert seen["alone"] is None, seen
    assert seen["with_thread"] == (
        "the fork server has 2 threads (start-probe-sleeper); a fork could deadlock"
    )
    assert seen["template_fork"] == [
        "refused",
        "the template refused to fork: the template has 2 threads (start-probe-sleeper); "
        "a fork could deadlock",
    ]
    assert seen["after"] is None, seen


def _probe(mode: str, lib: Path | None, driver: str = "clean") -> dict:
    """Run start_fork_probe.py's ``mode``; ``lib`` is loaded unless ``driver`` is
    "clean", and initialised where it is "initialised"."""
    args = [sys.executable, str(program("start_fork_probe.py")), mode]
    if driver != "clean":
        args += [str(lib)] + (["init"] if driver == "initialised" else [])
    done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_preload_module_failing_at_import_falls_back_to_spawn(
    forkserver_iso: GpuIso, logs: Logs
) -> None:
    """A preload module that raises at import stops the fork server from starting: the
    session still passes, started with spawn, and says why once."""
    iso = forkserver_iso
    iso.copy("start_log.py", "start_preload_mod.py", "start_preload_broken.py", PROCS)
    result = iso.run(
        "-v", "--gpu-isolate", "--gpu-isolate-preload=start_preload_broken", REPORT, PROCS
    )
    result.assert_outcomes(passed=4, warnings=1)
    [warning] = _start_warnings(result)
    assert "the fork server could not start:" in warning
    assert "importing start_preload_broken failed" in warning
    assert "RuntimeError('start_preload_broken refuses to be imported')" in warning
    assert warning.endswith(f"; isolated tests are started with spawn instead {HOW_TO_CHOOSE}")
    assert {start["method"] for start in _starts(iso).values()} == {"spawn"}
    result.stdout.fnmatch_lines(["gpu-isolate: started 4 spawn; 3 prewarmed*"])


def test_forkserver_under_xdist(forkserver_iso: GpuIso, logs: Logs) -> None:
    """-n 2: each worker has its own fork server, which imported the preload module once;
    every test passes in a process forked from its worker's server."""
    iso = forkserver_iso
    iso.copy("start_log.py", "start_preload_mod.py", PROCS)
    result = iso.run("-n", "2", "--gpu-isolate", f"--gpu-isolate-preload={PRELOAD}", REPORT, PROCS)
    result.assert_outcomes(passed=4)
    assert {start["method"] for start in _starts(iso).values()} == {"forkserver"}
    runs = logs.by_test()
    assert len(runs) == 4 and len({run["pid"] for run in runs.values()}) == 4
    servers = logs.preloaded_by()
    assert 1 <= len(servers) <= 2 and len(set(servers)) == len(servers), servers
    server_of: dict[int, set[int]] = {}
    for run in runs.values():
        assert run["before"] and run["preloaded_in"] in servers, run
        server_of.setdefault(run["ppid"], set()).add(run["preloaded_in"])
    # One server per worker: a worker's tests share it, two workers never do.
    assert all(len(found) == 1 for found in server_of.values()), server_of
    assert len(set.union(*server_of.values())) == len(server_of), server_of
    assert not set(servers) & ({run["pid"] for run in runs.values()} | set(server_of))


# --------------------------------------------------------------------------- prewarming


FIRST = "test_start_order.py::test_first_sleeps"
SECOND = "test_start_order.py::test_second"


@pytest.mark.parametrize("prewarm", [1, 0])
def test_prewarm_starts_the_next_process_while_a_test_runs(
    gpuiso: GpuIso, logs: Logs, prewarm, monkeypatch: pytest.MonkeyPatch
):
    """--gpu-isolate-prewarm=1: the second test's process exists (as pytest's child)
    while the first test runs; =0: it is created after the first test ended."""
    gpuiso.copy("start_log.py", "test_start_order.py")
    if prewarm:  # the first test waits for the second's process (a sleep would race it)
        monkeypatch.setenv("GPUISO_PREWARMED", "1")
    result = gpuiso.run(
        "-v", "--gpu-isolate", f"--gpu-isolate-prewarm={prewarm}", REPORT, "test_start_order.py"
    )
    result.assert_outcomes(passed=2)
    runs = logs.by_test()
    first, second = runs[FIRST], runs[SECOND]
    around_first = {sibling["pid"] for sibling in first["siblings"]}
    # The fork server's processes are forked from its collected session; a prewarmed
    # spawned process collects (imports) its test's module while it waits.
    collected = gpuiso.start == "forkserver" or bool(prewarm)
    if prewarm:
        assert second["created"] < first["ended"], (first, second)
        assert second["pid"] in around_first, (first, second)
    else:
        # Both on the boot clock; a creation time is rounded down to a clock tick.
        assert second["created"] > first["ended"] - TICK, (first, second)
        assert second["pid"] not in around_first, (first, second)
    if collected:
        assert second["imported"] < first["ended"], (first, second)
    else:
        assert second["imported"] > first["ended"], (first, second)
    assert _starts(gpuiso, "collected") == {
        FIRST: {"method": gpuiso.start, "prewarmed": False, "collected": gpuiso.start != "spawn"},
        SECOND: {"method": gpuiso.start, "prewarmed": bool(prewarm), "collected": collected},
    }
    result.stdout.fnmatch_lines([f"gpu-isolate: started 2 {gpuiso.start}; {prewarm} prewarmed*"])


GPU_TESTS = [f"test_start_gpus.py::test_gets_a_gpu[{i}]" for i in range(3)]


@pytest.mark.parametrize(
    "conftest", ["loads-libcuda", "reads-cvd", "clean"], ids=lambda c: f"conftest-{c}"
)
def test_prewarmed_process_that_touched_cuda_is_replaced(
    spawn_iso: GpuIso, logs: Logs, lease_region, monkeypatch, request, conftest
) -> None:
    """Fake GPUs 0,1; a prewarmed process sees CUDA_VISIBLE_DEVICES="" until its go.
    One whose conftest loaded the driver (or read CUDA_VISIBLE_DEVICES) at import cannot
    switch to its GPU: a fresh process runs the test, prewarming is turned off, and that
    is said once. Otherwise each test's module is collected ahead, too."""
    iso = spawn_iso
    lib = request.getfixturevalue("fake_libcuda") if conftest == "loads-libcuda" else None
    iso.copy("start_log.py", "test_start_gpus.py")
    _cuda_conftest(iso, monkeypatch, lib)
    if conftest == "reads-cvd":
        monkeypatch.setenv("GPUISO_CONFTEST_READS_CVD", "1")
    result = iso.run("-v", "--gpu-isolate-devices=0,1", REPORT, "test_start_gpus.py")
    runs = logs.by_test()
    assert sorted(runs) == GPU_TESTS
    assert {run["cvd"] for run in runs.values()} <= {"0", "1"}, runs
    test_pids = {run["pid"] for run in runs.values()}
    assert len(test_pids) == 3
    cvd_at_import = {row["pid"]: row["cvd"] for row in logs.conftest_imports()}
    starts = _starts(iso, "collected")
    if conftest != "clean":
        result.assert_outcomes(passed=3, warnings=1)
        [warning] = _start_warnings(result)
        if lib is not None:
            assert (
                "prewarming turned off: a process started ahead of its test initialised CUDA "
                f"before it was given its GPUs (the CUDA driver library was loaded ({lib}) while "
                "the GPUs were hidden, where a CUDA call leaves no other trace; "
            ) in warning
            assert (
                "before running plugins and conftests); a plugin or conftest uses CUDA or NVML "
                "at import (torch.cuda.is_available() and device_count() do): call them in "
                "fixtures or tests instead"
            ) in warning
            assert "PYTORCH_NVML_BASED_CUDA_CHECK" not in warning  # it loads NVML: stale too
        else:
            assert (
                "prewarming turned off: a process started ahead of its test read "
                "CUDA_VISIBLE_DEVICES before it was given its GPUs; a plugin or conftest "
                "reads it at import: read it in fixtures or tests instead"
            ) in warning
        fresh = {"method": "spawn", "prewarmed": False, "collected": False}
        assert starts == {nodeid: fresh for nodeid in runs}
        result.stdout.fnmatch_lines(["gpu-isolate: started 3 spawn; 0 prewarmed"])
        # The replaced process: started ahead (no GPU yet), never ran a test.
        replaced = [pid for pid, cvd in cvd_at_import.items() if pid not in test_pids]
        assert any(cvd_at_import[pid] == "" for pid in replaced), cvd_at_import
        for pid in test_pids:  # the fresh processes had their GPU from the start
            assert cvd_at_import[pid] in ("0", "1"), cvd_at_import
    else:
        result.assert_outcomes(passed=3)
        assert not _start_warnings(result)
        # Every one started ahead of its lease (the first while it waited for it), and
        # collected its module then.
        warm = {"method": "spawn", "prewarmed": True, "collected": True}
        assert starts == {nodeid: warm for nodeid in runs}
        result.stdout.fnmatch_lines(["gpu-isolate: started 3 spawn; 3 prewarmed; 3 pre-collected"])
        # No GPU while waiting, its GPU after the go (the tests saw "0" or "1", above).
        assert {cvd_at_import[pid] for pid in test_pids} == {""}, cvd_at_import


@pytest.mark.parametrize("how", ["spawn", "forkserver-server", "forkserver-template"])
def test_a_process_with_the_driver_mapped_before_user_code_keeps_prewarming(
    request, logs: Logs, lease_region, fake_libcuda: Path, monkeypatch, how: str
) -> None:
    """Fake GPUs 0,1 and a preload that maps the driver without initialising it (as
    importing torch's CUDA 13 build does), where a CUDA call made with the GPUs hidden
    would leave no trace. A process started ahead takes its go before any conftest runs
    (spawn, the fork server's own forks), or was forked from the template, which ran
    them with the GPUs visible: no process goes stale, prewarming stays on, no warning."""
    start, _, source = how.partition("-")
    iso = request.getfixturevalue(f"{start}_iso")
    iso.copy("start_log.py", "test_start_gpus.py", "start_map_driver.py")
    _cuda_conftest(iso, monkeypatch, fake_libcuda)
    with open(iso.path / "conftest.py", "a") as conftest:  # spawn preloads what it names
        conftest.write("\nimport start_map_driver  # noqa: E402, F401\n")
    monkeypatch.setenv("GPUISO_FAKE_LIBCUDA_MAPPED", "1")
    args = ["--gpu-isolate-devices=0,1", "--gpu-isolate-preload=start_map_driver", REPORT]
    if source == "server":
        args.append("--gpu-isolate-no-precollect")
    result = iso.run(*args, "test_start_gpus.py")
    result.assert_outcomes(passed=3)
    assert _start_warnings(result) == []
    runs = logs.by_test()
    assert {run["cvd"] for run in runs.values()} <= {"0", "1"}, runs
    starts = _starts(iso, "collected")
    assert {s["method"] for s in starts.values()} == {start}, starts
    assert all(s["prewarmed"] for s in starts.values()), starts
    assert all(s["collected"] == (source == "template") for s in starts.values()), starts
    if start == "spawn":  # its conftest ran after the go, seeing its GPU
        test_pids = {run["pid"] for run in runs.values()}
        cvd_at_import = {row["pid"]: row["cvd"] for row in logs.conftest_imports()}
        assert {cvd_at_import[pid] for pid in test_pids} <= {"0", "1"}, cvd_at_import


MODULE_GPU_TESTS = [
    f"test_start_module_gpus.py::test_sees_its_gpu_at_import[{i}]" for i in range(3)
]


@pytest.mark.parametrize("module", ["loads-libcuda", "reads-cvd"], ids=lambda m: f"module-{m}")
def test_module_that_looks_at_gpus_at_import_is_not_collected_ahead(
    spawn_iso: GpuIso, logs: Logs, lease_region, monkeypatch, request, module
) -> None:
    """A test module that loads the driver (as torch.cuda.is_available() in a skipif does)
    or reads CUDA_VISIBLE_DEVICES at import, collected ahead by prewarmed processes that
    see no GPU: those processes are replaced, every test sees its leased GPU at import
    (the module asserts it), and from then on prewarmed processes stop before collecting
    (prewarming itself stays on). Said once, naming the module."""
    iso = spawn_iso
    lib = request.getfixturevalue("fake_libcuda") if module == "loads-libcuda" else None
    if lib is None:
        monkeypatch.delenv("GPUISO_FAKE_LIBCUDA", raising=False)
    else:
        monkeypatch.setenv("GPUISO_FAKE_LIBCUDA", str(lib))
    iso.copy("start_log.py", "test_start_module_gpus.py")
    result = iso.run("--gpu-isolate-devices=0,1", REPORT, "test_start_module_gpus.py")
    result.assert_outcomes(passed=3, warnings=1)
    runs = logs.by_test()
    assert sorted(runs) == MODULE_GPU_TESTS
    assert all(run["at_import"] == run["cvd"] for run in runs.values()), runs
    [warning] = _start_warnings(result)
    what = (
        f"initialised CUDA (the CUDA driver library was loaded ({lib}) while the GPUs were hidden, "
        if lib
        else "read CUDA_VISIBLE_DEVICES before it was given its GPUs"
    )
    assert (
        "prewarmed processes no longer collect their test's module ahead of its turn: "
        f"importing test_start_module_gpus.py, one {what}"
    ) in warning
    starts = _starts(iso, "collected")
    # The first two were started collecting ahead (the second's while the first got its
    # go, before its process said it could not take its GPU): both replaced. The third
    # was prewarmed without collecting, and kept.
    assert [starts[nodeid] for nodeid in MODULE_GPU_TESTS] == [
        {"method": "spawn", "prewarmed": False, "collected": False},
        {"method": "spawn", "prewarmed": False, "collected": False},
        {"method": "spawn", "prewarmed": True, "collected": False},
    ]


# --------------------------------------------------------------------------- clean-up


def test_waiting_processes_do_not_outlive_the_session(gpuiso: GpuIso, logs: Logs) -> None:
    """-x ends the session at the first test while the next test's process waits (and,
    under forkserver, the server serves): none of pytest's other children lives on."""
    gpuiso.copy("start_log.py", "test_start_stop.py")
    result = gpuiso.run("--gpu-isolate", "-x", "test_start_stop.py", timeout=60)
    result.assert_outcomes(failed=1)
    [run] = logs.by_test().values()
    others = run["siblings"]
    # spawn: the prewarmed process; forkserver: the server and the process it forked.
    started = [s for s in others if "spawn_main" in s["cmdline"]]
    assert len(started) >= (2 if gpuiso.start == "forkserver" else 1), others
    left = wait_gone([run["pid"], *(s["pid"] for s in others)], timeout=10)
    kill_quietly(left)
    assert left == [], [s for s in others if s["pid"] in left]


# --------------------------------------------------------------------------- usage errors


@pytest.mark.parametrize(
    ("args", "ini", "culprit"),
    [
        (
            ["--gpu-isolate-start=fork"],
            "",
            "invalid value 'fork' for --gpu-isolate-start: expected spawn or forkserver",
        ),
        (
            [],
            "gpu_isolate_start = bogus",
            "invalid value 'bogus' for ini gpu_isolate_start: expected spawn or forkserver",
        ),
        (
            ["--gpu-isolate-preload=nosuchmodule_xyz"],
            "",
            "invalid value 'nosuchmodule_xyz' for --gpu-isolate-preload: expected none, or "
            "names of installed modules separated by commas or spaces (no module named "
            "'nosuchmodule_xyz')",
        ),
        (
            ["--gpu-isolate-preload=1bad"],
            "",
            "invalid value '1bad' for --gpu-isolate-preload: expected none, or names of "
            "installed modules separated by commas or spaces ('1bad' is not a module name)",
        ),
        (
            ["--gpu-isolate-prewarm=-1"],
            "",
            "invalid value '-1' for --gpu-isolate-prewarm: expected an integer from 0 to 16",
        ),
        (
            ["--gpu-isolate-prewarm=abc"],
            "",
            "invalid value 'abc' for --gpu-isolate-prewarm: expected an integer from 0 to 16",
        ),
        (
            [],
            "gpu_isolate_prewarm = 99",
            "invalid value '99' for ini gpu_isolate_prewarm: expected an integer from 0 to 16",
        ),
    ],
    ids=[
        "start-cli",
        "start-ini",
        "preload-missing",
        "preload-name",
        "prewarm-neg",
        "prewarm-text",
        "prewarm-ini",
    ],
)
def test_bad_start_settings_are_usage_errors(pytester: pytest.Pytester, args, ini, culprit):
    """One line naming the option (or ini key) and the value; no traceback."""
    pytester.makepyfile(test_one="def test_one():\n    pass\n")
    if ini:
        pytester.makeini(f"[pytest]\n{ini}\n")
    result = pytester.runpytest_subprocess("-p", "no:hypothesispytest", *args)
    assert result.ret == USAGE_ERROR
    errors = [line for line in result.errlines if line.startswith("ERROR")]
    assert errors == [f"ERROR: gpu-isolate: {culprit}"], result.errlines
    assert "Traceback" not in result.stderr.str() + result.stdout.str()


@pytest.mark.parametrize("how", ["script", "stdin"])
def test_a_script_calling_pytest_main_is_not_rerun(gpuiso: GpuIso, how: str):
    """A ``run_tests.py`` without a ``__name__`` guard, or one read from stdin, runs once.

    multiprocessing's spawn re-runs the parent's main script in its children; a test's
    process (and the fork server) must not: it would start pytest again, or fail to find
    ``<stdin>``.
    """
    gpuiso.copy("test_where.py")
    options = ", ".join(
        repr(o) for o in ("-p", "no:cacheprovider", "-p", "no:randomly", *gpuiso.start_options)
    )
    script = (
        "import sys, pytest\n"
        "print('MAIN SCRIPT RUN')\n"
        f"sys.exit(pytest.main([{options}, 'test_where.py']))\n"
    )
    (gpuiso.path / "run_tests.py").write_text(script)
    if how == "script":
        result = gpuiso.pytester.run(sys.executable, "run_tests.py", timeout=120)
    else:
        result = gpuiso.pytester.run(sys.executable, "-", stdin=script.encode(), timeout=120)
    assert result.ret == 0, result.stdout.str() + result.stderr.str()
    assert result.stdout.str().count("MAIN SCRIPT RUN") == 1
    result.assert_outcomes(passed=2)  # one test in pytest's process, one isolated
