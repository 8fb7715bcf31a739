"""pytest-rerunfailures with isolated tests: every attempt in a fresh process.

fixtures/programs/plugins/plugin_rerun/test_rerun.py logs each attempt's pid and time: a
test that fails twice then passes, a crash, a timeout, a failure its ``flaky``
marker's ``only_rerun`` rules out, and an in-process test that rerunfailures
reruns itself. Both start methods; the fork server's template pre-collects with
rerunfailures and xdist installed (its status server thread is not started there).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import pytest

from pytest_gpuiso.reports import report
from tests.helpers import make_gpuiso
from tests.helpers.output import Terminal

# Another plugin's API: the runs load it beside ours
pytestmark = [pytest.mark.plugins("rerunfailures"), pytest.mark.versions]

try:
    RERUNFAILURES = tuple(int(n) for n in version("pytest-rerunfailures").split(".")[:2])
except PackageNotFoundError:
    RERUNFAILURES = (0, 0)
installed = pytest.mark.skipif(RERUNFAILURES == (0, 0), reason="no pytest-rerunfailures")
# The adapter's lowest release: older ones run isolated tests once, with a warning.
supported = pytest.mark.skipif(RERUNFAILURES < (14, 0), reason="needs pytest-rerunfailures >= 14.0")

PROGRAM = "plugin_rerun"
MODULE = f"{PROGRAM}/test_rerun.py"
# isolated attempts: flaky 3 (fails twice), abort 3, hang 3, only_value_errors 1
PROCESSES = 10
LOGS = {"test_flaky": "flaky", "test_abort": "abort", "test_hang": "hang"}
LOGS["test_only_value_errors"] = "only"  # where each test logs its attempts


def _attempts(gpuiso, name: str) -> list[tuple[int, float]]:
    """(pid, time) of each attempt of one fixture test, in order."""
    path = gpuiso.path / PROGRAM / f"{name}.attempts"
    if not path.exists():
        return []
    return [
        (int(pid), float(t)) for pid, t in (line.split() for line in path.read_text().splitlines())
    ]


def _records(gpuiso) -> dict[str, list[dict]]:
    """Each test's records, one per attempt, in order."""
    by_test: dict[str, list[dict]] = {}
    for record in gpuiso.report()["tests"]:
        by_test.setdefault(record["nodeid"].rsplit("::", 1)[1], []).append(record)
    return by_test


def _check_run(gpuiso, result: pytest.RunResult) -> None:
    out = result.stdout.str()
    outcomes = result.parseoutcomes()
    assert (outcomes.get("passed"), outcomes.get("failed"), outcomes.get("rerun")) == (2, 3, 7), out
    assert "INTERNALERROR" not in out
    in_process = {pid for pid, _ in _attempts(gpuiso, "in_process")}
    assert len(_attempts(gpuiso, "in_process")) == 2 and len(in_process) == 1  # rerunfailures'
    records = _records(gpuiso)
    expected = {
        "test_flaky": ["rerun", "rerun", "passed"],
        "test_abort": ["rerun", "rerun", "failed"],
        "test_hang": ["rerun", "rerun", "failed"],
        "test_only_value_errors": ["failed"],
    }
    assert {name: [r["outcome"] for r in rs] for name, rs in records.items()} == expected
    for name, rs in records.items():
        assert [r["attempt"] for r in rs] == list(range(1, len(rs) + 1))
        pids = [pid for pid, _ in _attempts(gpuiso, LOGS[name])]
        assert [r["pid"] for r in rs] == pids, name  # the record of each attempt's process
        assert len(set(pids)) == len(pids) and not set(pids) & in_process  # each a fresh one
    assert all(r["exit"]["signal"] == "SIGABRT" for r in records["test_abort"])
    assert all(r["exit"]["timed_out"] for r in records["test_hang"])
    # the summary counts a test once, its attempts' processes each
    result.stdout.fnmatch_lines(
        [
            "gpu-isolate: 4 isolated, 6 rerun, 3 timed out, 3 crashed",
            "  TIMEOUT *::test_hang (attempt 3) (after 1 s)",
            "  CRASHED *::test_abort (attempt 1) (SIGABRT)",
        ]
    )
    if gpuiso.start == "forkserver":  # the template forked every attempt, pre-collected
        result.stdout.fnmatch_lines(
            [f"gpu-isolate: started {PROCESSES} forkserver; * prewarmed; {PROCESSES} pre-collected"]
        )


@supported
def test_each_attempt_runs_in_a_fresh_process(gpuiso) -> None:
    gpuiso.copy(PROGRAM)
    result = gpuiso.run("-v", "--reruns=2", "--gpu-isolate-report=report.json", MODULE)
    _check_run(gpuiso, result)


@supported
def test_under_xdist(gpuiso) -> None:
    pytest.importorskip("xdist")
    gpuiso.copy(PROGRAM)
    result = gpuiso.run("-v", "-n", "2", "--reruns=2", "--gpu-isolate-report=report.json", MODULE)
    _check_run(gpuiso, result)


@supported
def test_delay_and_fail_on_flaky(gpuiso_spawn) -> None:
    """--reruns-delay between attempts; --fail-on-flaky (pytest-rerunfailures >= 15.0)."""
    gpuiso_spawn.copy(PROGRAM)
    flaky = ["--fail-on-flaky"] if RERUNFAILURES >= (15, 0) else []
    result = gpuiso_spawn.run("--reruns=2", "--reruns-delay=0.5", *flaky, f"{MODULE}::test_flaky")
    outcomes = result.parseoutcomes()
    assert (outcomes.get("passed"), outcomes.get("rerun")) == (1, 2), result.stdout.str()
    assert result.ret == (7 if flaky else 0)  # --fail-on-flaky: it passed only when rerun
    times = [t for _, t in _attempts(gpuiso_spawn, "flaky")]
    assert len(times) == 3
    assert all(b - a >= 0.5 for a, b in zip(times, times[1:], strict=False))


@pytest.mark.skipif(RERUNFAILURES < (16, 5), reason="--max-suite-reruns: 16.5")
def test_max_suite_reruns(gpuiso_spawn) -> None:
    """The session's reruns are counted with isolated tests' attempts."""
    gpuiso_spawn.copy(PROGRAM)
    result = gpuiso_spawn.run(
        "--reruns=2", "--max-suite-reruns=1", "-k", "test_flaky or test_abort", MODULE
    )
    outcomes = result.parseoutcomes()
    assert (outcomes.get("failed"), outcomes.get("rerun")) == (2, 1), result.stdout.str()
    assert len(_attempts(gpuiso_spawn, "flaky")) == 2
    assert len(_attempts(gpuiso_spawn, "abort")) == 1


@installed
def test_in_process_fixture_teardown_after_an_isolated_test(gpuiso_spawn) -> None:
    """pytest tears down what an in-process test left up after the isolated test that
    ends the module; rerunfailures' makereport wrapper sees a report of that test there."""
    gpuiso_spawn.copy("plugin_rerun_teardown")
    result = gpuiso_spawn.run("plugin_rerun_teardown")
    assert "INTERNALERROR" not in result.stdout.str()
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*RuntimeError: module fixture teardown broke*"])


@installed
def test_a_release_without_what_the_adapter_needs(gpuiso_spawn) -> None:
    """One warning; the isolated tests run once, and nothing breaks (older releases
    are refused by their version as well)."""
    gpuiso_spawn.copy("plugin_rerun_unsupported")
    result = gpuiso_spawn.run("--reruns=1", "plugin_rerun_unsupported")
    result.assert_outcomes(failed=2)
    out = result.stdout.str()
    text = "reruns of isolated tests are not supported with this version (no get_reruns_condition"
    assert out.count(text) == 1, out
    assert out.count("they run once") == 1
    assert "rerun" not in result.parseoutcomes()


def _record(attempt: int, outcome: str, leaks: int) -> dict:
    return {
        "nodeid": "t.py::test_x",
        "outcome": outcome,
        "attempt": attempt,
        "pid": 4000 + attempt,  # each attempt in a process of its own
        "exit": {"code": 0, "signal": None, "timed_out": False, "expired": None},
        "leaks": [{"kind": "shm", "detail": f"/dev/shm/x{n}"} for n in range(leaks)],
        "escaped": [],
    }


def test_the_summaries_count_a_rerun_test_once() -> None:
    records = [_record(1, "rerun", 2), _record(2, "passed", 1)]
    tr = Terminal()
    report.terminal_summary(tr, records, None)
    assert "gpu-isolate: 1 isolated, 1 rerun, 0 timed out, 0 crashed" in tr.lines
    assert "gpu-isolate: 3 leaks in 1 test (3 shm, 0 process, 0 gpu_memory)" in tr.lines
    assert tr.lines.count("  t.py::test_x: 3 shm") == 1
    text = report.markdown(records)
    assert "**1 isolated tests** (1 passed, 1 rerun)" in text
    assert "| 3 in 1 tests |" in text


@installed
def test_the_template_reads_its_release_once_for_every_fork(pytester, monkeypatch) -> None:
    """Reading a distribution's metadata takes milliseconds: the template reads
    rerunfailures' release (for the payload's checks) before it forks, so no test's process
    reads it again."""
    gpuiso = make_gpuiso(pytester, monkeypatch, "forkserver", plugins=("rerunfailures",))
    pytester.makepyfile(
        test_release="""
        from pytest_gpuiso.adapters import rerunfailures

        def test_read_before_the_fork():
            assert rerunfailures._version.cache_info().currsize == 1
        """
    )
    result = gpuiso.run("--gpu-isolate", "test_release.py")
    result.assert_outcomes(passed=1)
