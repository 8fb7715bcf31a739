"""pytest-benchmark with isolated tests: their timings are reported, saved and compared by
pytest, as for in-process benchmarks, and no test's process writes results of its own.

fixtures/programs/plugins/plugin_benchmark has two isolated benchmarks (one pedantic, in a group
of its own, with extra_info) and one in-process benchmark.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import GpuIso

# Another plugin's API: the runs load it beside ours
pytestmark = [pytest.mark.plugins("benchmark"), pytest.mark.versions]

pytest.importorskip("pytest_benchmark")

PROGRAM = "plugin_benchmark"
NAMES = {"test_isolated_sum", "test_isolated_pedantic", "test_in_process_sum"}
QUICK = ("--benchmark-max-time=0.02", "-W", "always")


def _run(gpuiso: GpuIso, *args: str) -> pytest.RunResult:
    return gpuiso.run(*QUICK, *args, PROGRAM)


def _saved(gpuiso: GpuIso) -> list:
    return sorted((gpuiso.path / ".benchmarks").rglob("*.json"))


def test_table_json_and_save_list_every_benchmark(gpuiso: GpuIso) -> None:
    gpuiso.copy(PROGRAM)
    result = _run(gpuiso, "--benchmark-json=out.json", "--benchmark-autosave")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["*- benchmark: 2 tests -*"])
    result.stdout.fnmatch_lines(["*- benchmark 'pedantic': 1 tests -*"])
    rows = {line.split()[0]: line for line in result.stdout.lines if line.startswith("test_")}
    assert set(rows) == NAMES
    assert rows["test_isolated_pedantic"].split()[-2:] == ["7", "3"]  # rounds, iterations
    out = result.stdout.str()
    assert "no benchmarks have been run" not in out
    by_name = {
        b["name"]: b for b in json.loads((gpuiso.path / "out.json").read_text())["benchmarks"]
    }
    assert set(by_name) == NAMES
    for bench in by_name.values():
        stats = bench["stats"]
        assert len(stats["data"]) == stats["rounds"] > 0 and stats["min"] == min(stats["data"])
    pedantic = by_name["test_isolated_pedantic"]
    assert (pedantic["group"], pedantic["extra_info"]) == ("pedantic", {"size": 300})
    assert (pedantic["stats"]["rounds"], pedantic["stats"]["iterations"]) == (7, 3)
    assert by_name["test_isolated_sum"]["options"]["timer"] == "perf_counter"
    # one saved run, pytest's, holding all three; no test's process saved or wrote JSON
    [saved] = _saved(gpuiso)
    assert {b["name"] for b in json.loads(saved.read_text())["benchmarks"]} == NAMES
    assert [p.name for p in gpuiso.path.rglob("*.json")] == ["out.json", saved.name]


def test_only_isolated_benchmarks(gpuiso_spawn: GpuIso) -> None:
    """pytest ran no benchmark itself: it still reports and writes those of its tests' processes."""
    gpuiso_spawn.copy(PROGRAM)
    result = _run(gpuiso_spawn, "-k", "isolated", "--benchmark-json=out.json")
    result.assert_outcomes(passed=2)
    assert "no benchmarks have been run" not in result.stdout.str() + result.stderr.str()
    benchmarks = json.loads((gpuiso_spawn.path / "out.json").read_text())["benchmarks"]
    assert {b["name"] for b in benchmarks} == NAMES - {"test_in_process_sum"}


def test_cprofile_of_isolated_benchmarks(gpuiso: GpuIso) -> None:
    gpuiso.copy(PROGRAM)
    result = _run(
        gpuiso,
        "--benchmark-cprofile=cumtime",
        "--benchmark-cprofile-dump",  # its prefix is made from the clock, when parsed
        "--benchmark-json=out.json",
    )
    result.assert_outcomes(passed=3)
    fullnames = [f"{PROGRAM}/test_benchmarks.py::{name}" for name in sorted(NAMES)]
    section = result.stdout.str().split("cProfile (time in s)", 1)[1]
    for fullname in fullnames:
        assert fullname in section
    for bench in json.loads((gpuiso.path / "out.json").read_text())["benchmarks"]:
        assert any("(_work)" in f["function_name"] for f in bench["cprofile"]), bench["name"]
    # each test's process wrote its own, under pytest's prefix
    dumped = [p.name.rsplit("-", 1) for p in gpuiso.path.glob("benchmark_*.prof")]
    assert sorted(name for _, name in dumped) == [f"{name}.prof" for name in sorted(NAMES)]
    assert len({prefix for prefix, _ in dumped}) == 1, dumped


def test_compare_fail_sees_isolated_benchmarks(gpuiso_spawn: GpuIso) -> None:
    gpuiso_spawn.copy(PROGRAM)
    _run(gpuiso_spawn, "--benchmark-save=base").assert_outcomes(passed=3)
    [saved] = _saved(gpuiso_spawn)
    run = json.loads(saved.read_text())
    for bench in run["benchmarks"]:
        if bench["name"] == "test_isolated_sum":  # the saved run was a second faster
            bench["stats"]["min"] -= 1.0
    saved.write_text(json.dumps(run))
    result = _run(gpuiso_spawn, "--benchmark-compare=0001", "--benchmark-compare-fail=min:0.5")
    assert result.ret != 0
    out = result.stdout.str() + result.stderr.str()
    assert "Performance has regressed" in out
    regressed = [line for line in out.splitlines() if "DifferenceRegressionCheck" in line]
    assert regressed and all("test_isolated_sum" in line for line in regressed), regressed


def test_under_xdist_as_in_process(gpuiso: GpuIso) -> None:
    """pytest-benchmark >= 5.1 disables itself under xdist, in the tests' processes too;
    before, the workers measured: either way isolated benchmarks go as in-process ones."""
    gpuiso.copy(PROGRAM)
    written = []
    for mode in ((), ("--no-gpu-isolate",)):
        result = _run(gpuiso, *mode, "-n", "2", "--benchmark-json=out.json")
        result.assert_outcomes(passed=3)
        out = gpuiso.path / "out.json"
        if out.exists():
            written.append(sorted(b["name"] for b in json.loads(out.read_text())["benchmarks"]))
            out.unlink()
        else:
            written.append(None)
        assert not _saved(gpuiso)
    assert written[0] == written[1]


def test_missing_internals_are_one_warning(gpuiso: GpuIso) -> None:
    gpuiso.copy(PROGRAM)
    gpuiso.pytester.makeconftest(
        "import pytest_gpuiso.adapters.benchmark as adapter\n"
        "adapter.missing_internals = lambda: ['Metadata.as_dict']\n"
    )
    result = _run(gpuiso, "--benchmark-json=out.json")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(
        [
            "*GpuIsoStartWarning: pytest-benchmark *: no Metadata.as_dict; "
            "isolated tests' benchmarks not reported"
        ]
    )
    assert result.stdout.str().count("GpuIsoStartWarning: pytest-benchmark") == 1
    benchmarks = json.loads((gpuiso.path / "out.json").read_text())["benchmarks"]
    assert [b["name"] for b in benchmarks] == ["test_in_process_sum"]
    assert [p.name for p in gpuiso.path.rglob("*.json")] == ["out.json"]
