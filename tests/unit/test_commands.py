"""``python -m pytest_gpuiso``: its commands agree on one exit status (0: ok; 1: findings or
a refusal; 2: a usage error, or an input that cannot be read or used, or an output that
cannot be written), each failure is one line on stderr naming its culprit, and the help
names every command.

Each command runs in a process of its own, in the test's temporary folder: "-m" puts the
cwd first on sys.path, and a checkout's ``pytest_gpuiso/`` there would shadow the
installed package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_gpuiso.gpu.leases import open_region
from pytest_gpuiso.reports.record import SCHEMA_VERSION

COMMANDS = ["status", "reset", "merge", "compare"]


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("GITHUB_STEP_SUMMARY", "COLUMNS")}
    env["COLUMNS"] = "100"  # argparse's width: the help's layout is the same everywhere
    return subprocess.run(
        [sys.executable, "-m", "pytest_gpuiso", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _report(path: Path, *leaky: str) -> str:
    """A JSON report of one test, ``t.py::test_a``, with these leak kinds."""
    record = {
        "nodeid": "t.py::test_a",
        "outcome": "passed",
        "attempt": 1,
        "exit": {"code": 0, "signal": None, "timed_out": False, "expired": None},
        "timeout": 900.0,
        "leaks": [{"kind": kind, "detail": f"a {kind} leak"} for kind in leaky],
        "escaped": [],
    }
    path.write_text(json.dumps({"version": SCHEMA_VERSION, "tests": [record]}))
    return path.name


def _one_error(result: subprocess.CompletedProcess, status: int, line: str) -> None:
    """Exit ``status`` with exactly ``line`` on stderr: no traceback, nothing else."""
    assert (result.returncode, result.stderr) == (status, line + "\n"), result.stdout


def test_the_help_names_every_command_on_a_line_and_the_exit_status(tmp_path: Path) -> None:
    result = _cli(tmp_path, "--help")
    assert (result.returncode, result.stderr) == (0, "")
    lines = result.stdout.splitlines()
    start = lines.index("  COMMAND") + 1
    listed = lines[start : lines.index("", start)]
    assert [line.split()[0] for line in listed] == COMMANDS  # no description wraps
    assert all(len(line.split()) > 2 for line in listed), listed
    text = " ".join(result.stdout.split())
    assert "exit status, the same for every command: 0 when all went well" in text
    assert "1 for findings or a refusal (compare: something new; reset: a live holder" in text
    assert "2 for a usage error, or an input that cannot be read or used" in text
    assert 'Each failure is one line on stderr, "error: ...", that names' in text


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_has_its_help(tmp_path: Path, command: str) -> None:
    result = _cli(tmp_path, command, "--help")
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.startswith(f"usage: python -m pytest_gpuiso {command} ")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["status", "extra"], "status: error: unrecognized arguments: extra"),
        (["reset", "--bogus"], "reset: error: unrecognized arguments: --bogus"),
        (["merge"], "merge: error: the following arguments are required: REPORT"),
        (["compare", "a", "b", "c"], "compare: error: unrecognized arguments: c"),
        (["compare", "a", "b", "--peak-growth", "nan"], "not a number >= 0: 'nan'"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        ([], "the following arguments are required: COMMAND"),
    ],
)
def test_usage_errors_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    result = _cli(tmp_path, *args)
    assert result.returncode == 2
    assert result.stderr.startswith("usage: python -m pytest_gpuiso")
    assert message in result.stderr.splitlines()[-1]
    assert "Traceback" not in result.stderr


def test_an_unreadable_report_is_2_for_merge_and_compare_alike(tmp_path: Path) -> None:
    good = _report(tmp_path / "good.json")
    _one_error(
        _cli(tmp_path, "merge", good, "missing.json", "--json", "m.json"),
        2,
        "error: missing.json: cannot read: No such file or directory",
    )
    _one_error(
        _cli(tmp_path, "compare", good, "missing.json"),
        2,
        "error: missing.json: cannot read: No such file or directory",
    )
    (tmp_path / "dir.json").mkdir()
    for args in (["merge", "dir.json", "--json", "m.json"], ["compare", "dir.json", good]):
        _one_error(_cli(tmp_path, *args), 2, "error: dir.json: cannot read: Is a directory")
    assert not (tmp_path / "m.json").exists()


def test_an_output_that_cannot_be_written_is_2_for_merge_and_compare_alike(tmp_path: Path):
    good = _report(tmp_path / "good.json")
    (tmp_path / "blocker").write_text("a file, not a directory")
    for args in (["merge", good, "--json"], ["compare", good, good, "--markdown"]):
        result = _cli(tmp_path, *args, "blocker/out")
        _one_error(result, 2, "error: blocker/out: cannot write: Not a directory")


def test_compare_is_0_when_nothing_is_new_and_1_when_something_is(tmp_path: Path) -> None:
    base, head = _report(tmp_path / "base.json"), _report(tmp_path / "head.json", "shm")
    same = _cli(tmp_path, "compare", base, base)
    assert (same.returncode, same.stderr) == (0, "")
    new = _cli(tmp_path, "compare", base, head, "--annotations", "off")
    assert (new.returncode, new.stderr) == (1, "")  # a finding is no error
    assert new.stdout.startswith("NEW    t.py::test_a: leak shm")
    fixed = _cli(tmp_path, "compare", head, base)
    assert (fixed.returncode, fixed.stderr) == (0, "")


def test_status_and_reset_of_no_table_are_0(tmp_path: Path) -> None:
    table = tmp_path / "none"
    status = _cli(tmp_path, "--region", str(table), "status")
    assert (status.returncode, status.stderr) == (0, "")
    for args in (["reset"], ["reset", "--force"], ["reset", "--device", "0"]):
        reset = _cli(tmp_path, "--region", str(table), *args)
        assert (reset.returncode, reset.stderr) == (0, ""), args
        assert reset.stdout == f"nothing to reset: {table} does not exist\n"


def test_a_lease_table_that_cannot_be_used_is_2_for_status_and_reset(tmp_path: Path) -> None:
    """A directory where the table should be: unusable input, never deleted."""
    table = tmp_path / "table"
    table.mkdir()
    unusable = f"error: cannot open the lease region {table}: Is a directory"
    for args in (["status"], ["reset"], ["reset", "--device", "0"]):
        _one_error(_cli(tmp_path, "--region", str(table), *args), 2, unusable)
    forced = _cli(tmp_path, "--region", str(table), "reset", "--force")
    _one_error(forced, 2, f"error: {table} is not a pytest-gpuiso lease table: left alone")
    assert table.is_dir()


def test_a_corrupted_lease_table_is_2_for_status_and_reset(tmp_path: Path) -> None:
    from pytest_gpuiso._lease import MAGIC

    table = tmp_path / "table"
    table.write_bytes(MAGIC.to_bytes(8, sys.byteorder) + b"\0" * 92)  # a table's start
    table.chmod(0o600)
    for args in (["status"], ["reset"]):
        result = _cli(tmp_path, "--region", str(table), *args)
        assert result.returncode == 2, args
        [line] = result.stderr.splitlines()
        assert line.startswith("error: ") and str(table) in line and "100 bytes" in line
    forced = _cli(tmp_path, "--region", str(table), "reset", "--force")
    assert (forced.returncode, forced.stderr) == (0, "")
    assert forced.stdout.startswith(f"deleted the lease table {table}: it is unusable")


def test_reset_refuses_with_1_while_a_holder_lives_and_force_clears(tmp_path: Path) -> None:
    table = tmp_path / "table"
    region = open_region(str(table))
    lease, _ = region.acquire(["0"], 1, 1, "t.py::test_held", None)
    try:
        status = _cli(tmp_path, "--region", str(table), "status")
        assert (status.returncode, status.stderr) == (0, "")  # holders are no finding
        assert "t.py::test_held" in status.stdout
        refused = _cli(tmp_path, "--region", str(table), "reset")
        held = f"GPU 0 by pid {os.getpid()} (t.py::test_held)"
        line = f"error: refusing to reset {table}: live holders: {held} (use --force)"
        _one_error(refused, 1, line)
        assert region.snapshot()["holders"] != []
        not_quarantined = _cli(tmp_path, "--region", str(table), "reset", "--device", "0")
        assert (not_quarantined.returncode, not_quarantined.stderr) == (0, "")
        assert "GPU 0 is not quarantined in" in not_quarantined.stdout
        forced = _cli(tmp_path, "--region", str(table), "reset", "--force")
        assert (forced.returncode, forced.stderr, forced.stdout) == (0, "", f"cleared {table}\n")
        assert region.snapshot()["holders"] == []
    finally:
        region.release(lease)


def test_status_whose_reader_stops_early_ends_quietly(tmp_path: Path) -> None:
    """``status | head -1``: the reader is gone before status writes; no BrokenPipeError
    traceback, a status of 1 (its output was lost)."""
    table = tmp_path / "leases"
    open_region(str(table))
    status = subprocess.Popen(
        [sys.executable, "-m", "pytest_gpuiso", "--region", str(table), "status"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    status.stdout.close()  # long before the interpreter has started and written
    assert status.wait(timeout=60) == 1
    assert status.stderr.read() == ""
