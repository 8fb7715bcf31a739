"""``python -m pytest_gpuiso compare BASE HEAD``: what a pull request changed against its
base, from two JSON reports."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pytest_gpuiso.__main__ import main
from pytest_gpuiso.reports.record import SCHEMA_VERSION


def _record(nodeid: str, leaks=(), signal=None, timed_out=False, startup=0.5, peak=None, **more):
    return {
        "nodeid": nodeid,
        "outcome": "failed" if signal or timed_out else "passed",
        "attempt": 1,
        "exit": {"code": 0, "signal": signal, "timed_out": timed_out, "expired": None},
        "timeout": 900.0,
        "leaks": [{"kind": kind, "detail": detail} for kind, detail in leaks],
        "escaped": [],
        "startup": startup,
        "gpu_memory_peak": peak,
        **more,
    }


def _report(path: Path, *records: dict) -> str:
    path.write_text(json.dumps({"version": SCHEMA_VERSION, "tests": list(records)}))
    return str(path)


SHM_LEAK = ("shm", "segment /dev/shm/psm_1 (1048576 bytes) left in /dev/shm")
PROC = ("process", "process 12 still running after the test ended (killed): sleep 60")


@pytest.fixture
def pair(tmp_path: Path) -> tuple[str, str]:
    """A pull request-shaped pair: one leak new, one fixed, one known; a new crash, a start-up
    and a GPU memory peak that grew; a test removed and one added; an allowed leak."""
    base = _report(
        tmp_path / "base.json",
        _record("t.py::test_known", leaks=[SHM_LEAK]),
        _record("t.py::test_fixed", leaks=[PROC]),
        _record("t.py::test_clean"),
        _record("t.py::test_crash"),
        _record("t.py::test_slow", startup=1.0, peak=1 << 30),
        _record("t.py::test_removed"),
        _record("t.py::test_allowed"),
    )
    allowed = {"kind": "shm", "detail": SHM_LEAK[1], "allowed": True}
    head = _report(
        tmp_path / "head.json",
        _record("t.py::test_known", leaks=[SHM_LEAK]),
        _record("t.py::test_fixed"),
        _record("t.py::test_clean", leaks=[SHM_LEAK]),
        _record("t.py::test_crash", signal="SIGSEGV"),
        _record("t.py::test_slow", startup=4.5, peak=2 << 30),
        _record("t.py::test_added", leaks=[PROC]),
        _record("t.py::test_allowed") | {"leaks": [allowed]},  # its marker allows it
    )
    return base, head


def test_a_pull_request_shaped_pair(pair, tmp_path: Path, capsys) -> None:
    base, head = pair
    markdown = tmp_path / "compare.md"
    assert main(["compare", base, head, "--markdown", str(markdown)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"NEW    t.py::test_added: leak process: {PROC[1]} (a test only in head)",
        f"NEW    t.py::test_clean: leak shm: {SHM_LEAK[1]}",
        "NEW    t.py::test_crash: crash: ended by SIGSEGV",
        "NEW    t.py::test_slow: start-up: 1.00 s -> 4.50 s",
        "NEW    t.py::test_slow: GPU memory peak: 1024 MiB -> 2048 MiB",
        "FIXED  t.py::test_fixed: leak process",
        "ONLY IN BASE t.py::test_removed",
        "ONLY IN HEAD t.py::test_added",
        "compared 6 tests: 5 new, 1 fixed; 1 only in base, 1 only in head",
    ]
    text = markdown.read_text()
    assert "### New" in text and "| `t.py::test_clean` | leak shm |" in text
    assert "### Fixed" in text and "### Only in head" in text and "t.py::test_known" not in text


def test_new_tests_that_leak_or_crash_are_new(tmp_path: Path, capsys) -> None:
    """Base: 4 clean tests; head: the same and 3 new ones: two that leak, one that crashes,
    and one clean. Before: listed "ONLY IN HEAD", "0 new", "Nothing new", exit 0: a pull
    request adding a leaking test passed the required check. A test only in base stays
    informational."""
    clean = [_record(f"t.py::test_{n}") for n in range(4)]
    base = _report(tmp_path / "base.json", *clean, _record("t.py::test_gone", leaks=[PROC]))
    head = _report(
        tmp_path / "head.json",
        *clean,
        _record("t.py::test_new_shm", leaks=[SHM_LEAK]),
        _record("t.py::test_new_proc", leaks=[PROC]),
        _record("t.py::test_new_crash", signal="SIGSEGV"),
        _record("t.py::test_new_clean"),
        _record("t.py::test_new_allowed", leaks=[]) | {"leaks": [SHM_LEAK_ALLOWED]},
    )
    markdown = tmp_path / "compare.md"
    assert main(["compare", base, head, "--markdown", str(markdown)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if line.startswith("NEW")] == [
        "NEW    t.py::test_new_crash: crash: ended by SIGSEGV (a test only in head)",
        f"NEW    t.py::test_new_proc: leak process: {PROC[1]} (a test only in head)",
        f"NEW    t.py::test_new_shm: leak shm: {SHM_LEAK[1]} (a test only in head)",
    ]
    assert out[-1] == "compared 4 tests: 3 new, 0 fixed; 1 only in base, 5 only in head"
    text = markdown.read_text()
    assert "| `t.py::test_new_shm` | leak shm |" in text and "Nothing new" not in text


SHM_LEAK_ALLOWED = {"kind": "shm", "detail": SHM_LEAK[1], "allowed": True}


def test_nothing_new_exits_0_and_thresholds_are_options(pair, capsys) -> None:
    base, head = pair
    assert main(["compare", base, base]) == 0
    assert capsys.readouterr().out.endswith("compared 7 tests: 0 new, 0 fixed\n")
    assert main(["compare", head, head, "--startup-growth", "5", "--peak-growth", "2048"]) == 0


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("{not json", "not JSON"),
        (json.dumps({"version": 99, "tests": []}), "report version 99, expected"),
        (json.dumps({"version": SCHEMA_VERSION, "tests": [{"nodeid": 1}]}), "malformed"),
        ("", "empty file"),
    ],
)
def test_unusable_input_is_one_line_and_exit_2(pair, tmp_path, capsys, content, problem) -> None:
    base, _ = pair
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    assert main(["compare", base, str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {bad}: ") and problem in err


def test_an_output_that_cannot_be_written_is_one_line_and_exit_2(pair, tmp_path, capsys) -> None:
    base, head = pair
    (tmp_path / "blocker").write_text("a file, not a directory")
    blocked = tmp_path / "blocker" / "compare.md"
    assert main(["compare", base, head, "--markdown", str(blocked)]) == 2
    assert capsys.readouterr().err == f"error: {blocked}: cannot write: Not a directory\n"


def test_a_missing_report_is_exit_2_on_either_side(pair, tmp_path, capsys) -> None:
    base, head = pair
    missing = tmp_path / "missing.json"
    for args in ([str(missing), head], [base, str(missing)]):
        assert main(["compare", *args]) == 2
        err = capsys.readouterr().err
        assert err == f"error: {missing}: cannot read: No such file or directory\n"


def test_an_infinite_threshold_never_counts_growth_as_new(pair, capsys) -> None:
    """ "inf" is a threshold nothing grows past (it used to end in a traceback)."""
    base, head = pair
    args = ["compare", base, head, "--startup-growth", "inf", "--peak-growth", "inf"]
    assert main(args) == 1  # the leak and the crash are still new
    out = capsys.readouterr().out
    assert "NEW    t.py::test_crash: crash: ended by SIGSEGV" in out
    assert "start-up" not in out and "GPU memory peak" not in out


def test_one_report_is_head_with_write_baseline(pair, tmp_path, capsys) -> None:
    _, head = pair
    known = tmp_path / "known.json"
    assert main(["compare", "--write-baseline", str(known), head]) == 0
    assert capsys.readouterr().out == f"wrote the leak baseline (3 leaks of {head}) to {known}\n"


def test_the_help_names_base_and_head_and_the_exit_status(capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as exited:
        main(["compare", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    usage = "usage: python -m pytest_gpuiso compare [options] BASE HEAD\n"
    assert out.startswith(usage + "       python -m pytest_gpuiso compare [options] ")
    positionals = out.split("positional arguments:\n")[1].split("\n\n")[0].splitlines()
    assert [line.split()[0] for line in positionals] == ["BASE", "HEAD"]
    assert "REPORT" not in out
    text = " ".join(out.split())
    assert "exit status: 0 when nothing is new; 1 when something is; 2 for a usage error" in text
    assert 'or an output cannot be written (one line on stderr: "error: PATH: problem")' in text


def test_the_help_says_what_a_test_on_one_side_only_counts_as(capsys, monkeypatch) -> None:
    """A test only in HEAD that does something wrong is new (what compare does since issue
    50); the help said tests on one side only were "never new"."""
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "never new" not in text
    assert (
        "A test only in HEAD (one the change added) is listed, and what it does wrong is "
        "new: a leak its marker does not allow, a crash, a timeout. A test only in BASE is "
        "listed for information, never counted." in text
    )


def _with_session(path: Path, gpu: str, driver: str, torch: str | None) -> str:
    env = {"python": "3.11.7", "cuda_driver": driver, "gpus": [{"name": gpu, "memory": 1}]}
    env |= {"torch": torch} if torch else {}
    session = {"started": "2026-11-29T02:30:04Z", "finished": "x", "environment": env}
    document = {"version": SCHEMA_VERSION, "tests": [_record("t.py::test_a")], "session": session}
    path.write_text(json.dumps(document))
    return str(path)


def test_compare_says_what_runs_it_compares_and_warns_when_the_runners_differ(
    tmp_path: Path, capsys
) -> None:
    """Issue 50: a "new" leak on another GPU model, driver or torch may be the runner's."""
    base = _with_session(tmp_path / "base.json", "NVIDIA A10", "550.54", "2.8.0")
    head = _with_session(tmp_path / "head.json", "NVIDIA H100 80GB HBM3", "580.95", "2.8.0")
    assert main(["compare", base, head]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[:2] == [
        "base: started 2026-11-29T02:30:04Z: GPUs NVIDIA A10, CUDA driver 550.54, torch 2.8.0, "
        "python 3.11.7",
        "head: started 2026-11-29T02:30:04Z: GPUs NVIDIA H100 80GB HBM3, CUDA driver 580.95, "
        "torch 2.8.0, python 3.11.7",
    ]
    assert err.splitlines() == [
        "warning: the runs differ: GPUs: NVIDIA A10 in base, NVIDIA H100 80GB HBM3 in head",
        "warning: the runs differ: CUDA driver: 550.54 in base, 580.95 in head",
    ]
    # a session of the wrong shape is input like any other: read as far as it is right
    (tmp_path / "odd.json").write_text(
        json.dumps({"version": SCHEMA_VERSION, "tests": [], "session": {"environment": [1]}})
    )
    assert main(["compare", str(tmp_path / "odd.json"), head]) == 0
    assert "head: started" in capsys.readouterr().out


def test_merge_keeps_each_shards_session(tmp_path: Path, capsys) -> None:
    one = _with_session(tmp_path / "one.json", "NVIDIA A10", "550.54", None)
    two = _with_session(tmp_path / "two.json", "NVIDIA A10", "550.54", None)
    merged = tmp_path / "merged.json"
    assert main(["merge", one, two, "--json", str(merged)]) == 0
    shards = json.loads(merged.read_text())["shards"]
    assert [s["path"] for s in shards] == [one, two]
    assert shards[0]["session"]["environment"]["cuda_driver"] == "550.54"


def test_merge_writes_pytest_splits_durations_from_the_isolated_wall_times(tmp_path: Path, capsys):
    """Issue 50: shards balanced by what isolation measured: each test's wall time (start-up
    included), its last attempt across shards, as pytest-split's {nodeid: seconds}."""
    one = _report(
        tmp_path / "one.json",
        _record("t.py::test_a", wall=12.5, duration=11.0),
        _record("t.py::test_flaky", wall=3.0, attempt=1),
    )
    two = _report(
        tmp_path / "two.json",
        _record("t.py::test_flaky", wall=4.25, attempt=2),
        _record("t.py::test_old", duration=0.75),  # a report without wall times
    )
    path = tmp_path / ".test_durations"
    assert main(["merge", one, two, "--durations", str(path)]) == 0
    assert json.loads(path.read_text()) == {
        "t.py::test_a": 12.5,
        "t.py::test_flaky": 4.25,
        "t.py::test_old": 0.75,
    }
    assert "wrote the merged durations file (3 tests from 2 reports)" in capsys.readouterr().out


def test_merge_updates_a_durations_file_keeping_the_tests_it_did_not_run(tmp_path: Path, capsys):
    """As pytest-split's own --store-durations: a run of part of the suite (a deselected
    folder, a test renamed away) leaves the other tests' entries as they were."""
    path = tmp_path / ".test_durations"
    path.write_text(json.dumps({"t.py::test_a": 1.0, "t.py::test_gone": 9.0}))
    one = _report(tmp_path / "one.json", _record("t.py::test_a", wall=2.5))
    assert main(["merge", one, "--durations", str(path)]) == 0
    assert json.loads(path.read_text()) == {"t.py::test_a": 2.5, "t.py::test_gone": 9.0}


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("{", "not a durations file (not JSON: "),
        ('{"t.py::test_a": "slow"}', "not a durations file ({nodeid: seconds} expected)"),
        ('["t.py::test_a"]', "not a durations file ({nodeid: seconds} expected)"),
    ],
)
def test_a_durations_file_that_is_not_one_is_one_line_and_left_alone(
    tmp_path: Path, capsys, content: str, problem: str
) -> None:
    path = tmp_path / ".test_durations"
    path.write_text(content)
    one = _report(tmp_path / "one.json", _record("t.py::test_a", wall=2.5))
    assert main(["merge", one, "--durations", str(path), "--json", str(tmp_path / "m.json")]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: {path}: {problem}")
    assert path.read_text() == content and not (tmp_path / "m.json").exists()


def test_a_durations_path_that_is_a_fifo_is_one_line_not_a_hang(tmp_path: Path, capsys) -> None:
    path = tmp_path / ".test_durations"
    os.mkfifo(path)
    one = _report(tmp_path / "one.json", _record("t.py::test_a", wall=2.5))
    assert main(["merge", one, "--durations", str(path)]) == 2
    assert capsys.readouterr().err == f"error: {path}: not a regular file\n"
