"""syrupy with isolated tests: their snapshots are written, counted and kept as in-process.

fixtures/programs/plugins/plugin_syrupy has two isolated tests (one asserting twice, once with a
named snapshot) and one in-process test sharing one .ambr file, and an isolated test whose
JSON snapshot is a file of its own: five snapshots. The snapshot report must count all
five, ``--snapshot-update`` must keep all five (a test's
process, running one test, must not delete the others', and pytest must know the
isolated tests used theirs) while still deleting a snapshot no test uses. Under both
start methods, and under xdist (where syrupy, from 6.1, locks the file its workers
share): the two tests that run every way take each (start method, workers) pair once
between them, as the start method and xdist change different things (the test's
process; the shared file).
"""

from __future__ import annotations

import importlib.metadata
import re

import pytest

from tests.helpers import GpuIso, make_gpuiso

# Another plugin's API: the runs load it beside ours
pytestmark = [pytest.mark.plugins("syrupy"), pytest.mark.versions]

pytest.importorskip("syrupy")

PROGRAM = "plugin_syrupy"
AMBR = f"{PROGRAM}/__snapshots__/test_snapshots.ambr"
JSON = f"{PROGRAM}/__snapshots__/test_snapshots/test_isolated_json.json"
NAMES = ["test_in_process", "test_isolated_one", "test_isolated_two", "test_isolated_two[named]"]
STALE = "# name: test_stale\n  'no test asserts this'\n# ---\n"


def _locks() -> bool:
    """Whether syrupy locks a snapshot file its xdist workers write (6.1 on): 6.0's workers
    each rewrite a file they share with what they hold, and one's snapshots can be lost,
    in-process as well (CI's lowest-versions stage once lost test_in_process's)."""
    release = importlib.metadata.version("syrupy").split(".")[:2]
    return tuple(int(part) for part in release if part.isdigit()) >= (6, 1)


def _writers(workers: int) -> int:
    """The workers an ``--snapshot-update`` run takes: serial where syrupy cannot share."""
    return workers if _locks() else 0


def _names(gpuiso: GpuIso) -> list[str]:
    """The .ambr file's snapshots; the JSON snapshot's file must be there too."""
    assert (gpuiso.path / JSON).is_file()
    return re.findall(r"^# name: (.*)$", (gpuiso.path / AMBR).read_text(), re.MULTILINE)


@pytest.fixture
def make(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch):
    """A ``GpuIso`` of the given start method that loads syrupy."""
    return lambda start: make_gpuiso(pytester, monkeypatch, start, plugins=("syrupy",))


def _run(gpuiso: GpuIso, workers: int, *args: str) -> pytest.RunResult:
    return gpuiso.run(*(("-n", str(workers)) if workers else ()), *args, PROGRAM)


def _summary(result: pytest.RunResult) -> str:
    """The snapshot report's counts line."""
    lines = result.stdout.lines
    at = next(i for i, line in enumerate(lines) if "snapshot report summary" in line)
    return lines[at + 1].strip()


@pytest.mark.parametrize(
    ("start", "workers"),
    [("spawn", 0), ("forkserver", 2)],
    ids=["spawn-serial", "forkserver-xdist"],
)
def test_update_keeps_every_snapshot_and_a_plain_run_passes(make, start: str, workers: int) -> None:
    gpuiso = make(start)
    gpuiso.copy(PROGRAM)
    result = _run(gpuiso, _writers(workers), "--snapshot-update")
    result.assert_outcomes(passed=4)
    assert _summary(result) == "5 snapshots generated."
    assert _names(gpuiso) == NAMES
    written = (gpuiso.path / AMBR).read_text()
    result = _run(gpuiso, _writers(workers), "--snapshot-update")  # stable: nothing changes
    assert result.ret == 0
    assert _summary(result) == "5 snapshots passed."
    assert (gpuiso.path / AMBR).read_text() == written
    result = _run(gpuiso, workers)
    assert result.ret == 0
    assert _summary(result) == "5 snapshots passed."
    # the lock files syrupy uses under xdist were cleaned up, those of the tests' processes too
    snapshots = (gpuiso.path / AMBR).parent.rglob("*")
    files = {str(p.relative_to(gpuiso.path)) for p in snapshots if p.is_file()}
    assert files == {AMBR, JSON}


@pytest.mark.parametrize(
    ("start", "workers"),
    [("spawn", 2), ("forkserver", 0)],
    ids=["spawn-xdist", "forkserver-serial"],
)
def test_unused_snapshots_are_still_found(make, start: str, workers: int) -> None:
    gpuiso = make(start)
    gpuiso.copy(PROGRAM)
    assert _run(gpuiso, _writers(workers), "--snapshot-update").ret == 0
    with open(gpuiso.path / AMBR, "a") as f:
        f.write(STALE)
    stale_json = gpuiso.path / JSON.replace("test_isolated_json", "test_gone")
    stale_json.write_text("{}\n")
    result = _run(gpuiso, workers)
    assert result.ret != 0  # syrupy fails a session with unused snapshots, as in-process
    assert _summary(result) == "5 snapshots passed. 2 snapshots unused."
    result = _run(gpuiso, _writers(workers), "--snapshot-update")
    assert result.ret == 0
    assert _summary(result) == "5 snapshots passed. 2 unused snapshots deleted."
    result.stdout.fnmatch_lines([f"Deleted test_stale ({AMBR})"], consecutive=False)
    assert _names(gpuiso) == NAMES and not stale_json.exists()


def test_a_changed_snapshot_fails_then_updates(gpuiso: GpuIso) -> None:
    """As in-process: the failed assertion ends its test, whose named snapshot then goes
    unused; ``--snapshot-update`` rewrites the changed one."""
    gpuiso.copy(PROGRAM)
    assert _run(gpuiso, 0, "--snapshot-update").ret == 0
    path = gpuiso.path / AMBR
    changed = path.read_text().replace("'isolated two'", "'changed by hand'")
    summaries = []
    for mode in ((), ("--no-gpu-isolate",)):
        path.write_text(changed)
        result = _run(gpuiso, 0, *mode)
        result.assert_outcomes(passed=3, failed=1)
        result.stdout.fnmatch_lines(["FAILED *test_isolated_two*"])
        summaries.append(_summary(result))
        result = _run(gpuiso, 0, *mode, "--snapshot-update")
        result.assert_outcomes(passed=4)
        summaries.append(_summary(result))
        assert _names(gpuiso) == NAMES and "'isolated two'" in path.read_text()
    expected = ["1 snapshot failed. 3 snapshots passed. 1 snapshot unused."]
    expected.append("4 snapshots passed. 1 snapshot updated.")
    assert summaries == expected * 2


def test_missing_internals_are_one_warning_and_delete_nothing(gpuiso: GpuIso) -> None:
    """Another syrupy without what the adapter reads: the session warns once, its isolated
    tests' snapshots are written but not counted, and nothing is deleted as unused."""
    gpuiso.copy(PROGRAM)
    assert _run(gpuiso, 0, "--snapshot-update").ret == 0
    gpuiso.pytester.makeconftest(
        "import pytest_gpuiso.adapters.syrupy as adapter\n"
        "adapter.missing_internals = lambda: ['SnapshotSession._assertions']\n"
    )
    result = _run(gpuiso, 0, "--snapshot-update", "-W", "always")
    result.assert_outcomes(passed=4)
    warning = (
        "*GpuIsoStartWarning: syrupy *: no SnapshotSession._assertions; isolated tests' "
        "snapshots not reported, unused snapshot detection turned off"
    )
    result.stdout.fnmatch_lines([warning])
    assert result.stdout.str().count("GpuIsoStartWarning: syrupy") == 1
    assert _names(gpuiso) == NAMES
