"""``python -m pytest_gpuiso merge``: the JSON reports of CI shards into one report and summary."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuiso.reports import report

# pytest's report formats, hooks and internals: CI's lowest-versions stage runs them all
pytestmark = pytest.mark.versions

MIB = 1 << 20


def _record(nodeid: str, outcome: str = "passed", **extra: Any) -> dict[str, Any]:
    """One record as ``--gpu-isolate-report`` writes it (schema version 1)."""
    record: dict[str, Any] = {
        "nodeid": nodeid,
        "outcome": outcome,
        "duration": 0.84,
        "pid": 41872,
        "timeout": 30.0,
        "exit": {"code": 0, "signal": None, "timed_out": False},
        "escaped": [],
        "leaks": [],
    }
    record.update(extra)
    return record


SHARD_1 = [
    _record("tests/test_model.py::test_forward[fp32]"),
    _record(
        "tests/test_model.py::test_dataloader",
        leaks=[
            {
                "kind": "shm",
                "detail": "segment /dev/shm/torch_4242_1 (64 MiB) left behind",
                "path": "/dev/shm/torch_4242_1",
                "bytes": 64 * MIB,
            },
            {
                "kind": "process",
                "detail": "process 4250 (python -m worker) still running, killed",
                "pid": 4250,
                "allowed": True,
            },
        ],
    ),
    _record(
        "tests/test_model.py::test_step[fp16]",
        "failed",
        duration=3.51,
        timeout=3.0,
        exit={"code": -9, "signal": "SIGKILL", "timed_out": True},
        escaped=[{"pid": 41901, "cmdline": "python worker.py"}],
    ),
    _record("tests/test_model.py::test_backward"),
]

SHARD_2 = [
    _record(
        "tests/test_cuda.py::test_spawns_holder",
        gpus=["0"],
        lease_wait=0.0,
        leaks=[
            {
                "kind": "gpu_memory",
                "detail": "GPU 0: process 3123456 (NVML pid, 1024 MiB) appeared on the GPU "
                "during the test and still holds it after the test's processes were reaped",
                "device": "0",
                "pid": 3123456,
                "bytes": 1024 * MIB,
                "holder": True,
            }
        ],
    ),
    _record(
        "tests/test_cuda.py::test_kernel_segfault",
        "failed",
        exit={"code": -11, "signal": "SIGSEGV", "timed_out": False},
    ),
    _record("tests/test_cuda.py::test_skipped", "skipped", duration=0.31),
]


def _write(path: Path, tests: Any, version: Any = 1) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"version": version, "tests": tests}), encoding="utf-8")
    return path


@pytest.fixture
def shards(tmp_path: Path) -> list[str]:
    """Two shard reports, named relative to ``tmp_path`` (where the command runs)."""
    _write(tmp_path / "reports" / "shard-1.json", SHARD_1)
    _write(tmp_path / "reports" / "shard-2.json", SHARD_2)
    return ["reports/shard-1.json", "reports/shard-2.json"]


def merge(cwd: Path, *args: str, step_summary: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "GITHUB_STEP_SUMMARY"}
    if step_summary is not None:
        env["GITHUB_STEP_SUMMARY"] = str(step_summary)
    return subprocess.run(
        [sys.executable, "-m", "pytest_gpuiso", "merge", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_merged_json_keeps_every_record_and_names_its_shard(tmp_path, shards):
    result = merge(tmp_path, *shards, "--json", "out/merged.json")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout.splitlines() == [
        "wrote the merged JSON report (7 tests from 2 reports) to out/merged.json"
    ]
    document = json.loads((tmp_path / "out" / "merged.json").read_text(encoding="utf-8"))
    assert document["version"] == 1
    assert document["tests"] == [{**r, "shard": "reports/shard-1.json"} for r in SHARD_1] + [
        {**r, "shard": "reports/shard-2.json"} for r in SHARD_2
    ]
    assert not (tmp_path / "out" / "merged.md").exists()
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["merged.json"]  # no temp files


def test_markdown_totals_add_up_across_shards(tmp_path, shards):
    result = merge(tmp_path, *shards, "--markdown", "summary.md", "--json", "merged.json")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "wrote the merged JSON report (7 tests from 2 reports) to merged.json",
        "wrote the merged Markdown summary (7 tests from 2 reports) to summary.md",
    ]
    text = (tmp_path / "summary.md").read_text(encoding="utf-8")
    lines = text.splitlines()
    assert lines[0] == "## pytest-gpuiso"
    assert "**7 isolated tests** (2 failed, 4 passed, 1 skipped)" in lines
    # shm from shard 1, gpu_memory from shard 2; the allowed process leak is not counted;
    # the timeout from shard 1, the crash from shard 2.
    assert "| 2 in 2 tests | 1 | 0 | 1 | 1 | 1 |" in lines
    assert "Not counted: 1 leak allowed by `allow_leaks` markers." in lines
    assert (
        "| `tests/test_model.py::test_dataloader` | shm | segment /dev/shm/torch\\_4242\\_1 "
        "(64 MiB) left behind |" in lines
    )
    assert any(
        line.startswith(
            "| `tests/test_cuda.py::test_spawns_holder` | gpu_memory | GPU 0: process 3123456"
        )
        for line in lines
    )
    assert (
        "| `tests/test_model.py::test_step[fp16]` | failed "
        "| timed out after 3 s, ended by SIGKILL |" in lines
    )
    assert "| `tests/test_cuda.py::test_kernel_segfault` | failed | crashed with SIGSEGV |" in lines
    # The summary of the merge is the summary of the merged report.
    merged = json.loads((tmp_path / "merged.json").read_text(encoding="utf-8"))["tests"]
    assert text == report.markdown(merged)


def test_markdown_is_appended_to_the_github_step_summary(tmp_path, shards):
    step = tmp_path / "step_summary.md"
    step.write_text("## unit tests\n\nall green\n", encoding="utf-8")
    result = merge(tmp_path, *shards, "--markdown", "summary.md", step_summary=step)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "wrote the merged Markdown summary (7 tests from 2 reports) to summary.md",
        "appended the merged Markdown summary (7 tests from 2 reports) to $GITHUB_STEP_SUMMARY",
    ]
    summary = (tmp_path / "summary.md").read_text(encoding="utf-8")
    assert "| 2 in 2 tests | 1 | 0 | 1 | 1 | 1 |" in summary
    assert step.read_text(encoding="utf-8") == "## unit tests\n\nall green\n" + summary


def test_the_step_summary_gets_the_markdown_even_when_only_json_is_written(tmp_path, shards):
    step = tmp_path / "step_summary.md"
    result = merge(tmp_path, *shards, "--json", "merged.json", step_summary=step)
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 2
    assert "| 2 in 2 tests | 1 | 0 | 1 | 1 | 1 |" in step.read_text(encoding="utf-8").splitlines()


def test_an_unwritable_step_summary_is_a_warning_not_a_failure(tmp_path, shards):
    step = tmp_path / "no-such-dir" / "summary.md"
    result = merge(tmp_path, *shards, "--markdown", "summary.md", step_summary=step)
    assert result.returncode == 0
    assert result.stdout.splitlines() == [
        "wrote the merged Markdown summary (7 tests from 2 reports) to summary.md"
    ]
    assert result.stderr == (
        f"warning: not appended to $GITHUB_STEP_SUMMARY (No such file or directory: {step})\n"
    )
    assert (tmp_path / "summary.md").exists()


def test_a_merged_report_merges_again_with_its_shard_names(tmp_path, shards):
    assert merge(tmp_path, shards[0], "--json", "first.json").returncode == 0
    _write(tmp_path / "third.json", [_record("tests/test_io.py::test_read")])
    result = merge(
        tmp_path, "first.json", shards[1], str(tmp_path / "third.json"), "--json", "all.json"
    )
    assert result.returncode == 0, result.stderr
    tests = json.loads((tmp_path / "all.json").read_text(encoding="utf-8"))["tests"]
    assert [t["shard"] for t in tests] == ["reports/shard-1.json"] * 4 + [
        "reports/shard-2.json"
    ] * 3 + [str(tmp_path / "third.json")]


OK = {"timed_out": False}  # an exit's bound that did not run out


def test_overlapping_shards_count_each_test_once_and_say_so_in_one_line(tmp_path):
    """Four tests in both shards (one rerun in the first, so that its last attempt is
    there), one in each alone: the Markdown counts six tests, each once, from the shard
    with its last attempt, and stderr has one line for the overlap, not one per test.
    Before, the Markdown counted every copy (10 outcomes for 6 tests) and stderr had a
    line per overlapping test."""
    both = [f"t.py::test_{n}" for n in range(4)]
    first = [_record(n, "failed") for n in both[1:]] + [_record("t.py::test_one")]
    first += [
        _record(both[0], "rerun", attempt=1),
        _record(both[0], "failed", attempt=2, exit={"code": -11, "signal": "SIGSEGV", **OK}),
    ]
    second = [_record(n) for n in both] + [_record("t.py::test_two")]
    _write(tmp_path / "a.json", first)
    _write(tmp_path / "b.json", second)
    result = merge(tmp_path, "a.json", "b.json", "--markdown", "s.md", "--json", "m.json")
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        "warning: 4 tests are in more than one shard (shards that overlap), each counted "
        "once, from the shard with its last attempt: t.py::test_1 (a.json, b.json), "
        "t.py::test_2 (a.json, b.json), t.py::test_3 (a.json, b.json) and 1 more"
    ]
    text = (tmp_path / "s.md").read_text(encoding="utf-8")
    assert "**6 isolated tests** (1 failed, 5 passed, 1 rerun)" in text.splitlines()
    assert "| `t.py::test_0` | failed | crashed with SIGSEGV |" in text.splitlines()
    kept = json.loads((tmp_path / "m.json").read_text(encoding="utf-8"))["tests"]
    assert sorted((t["nodeid"], t["outcome"], t["shard"]) for t in kept) == [
        ("t.py::test_0", "failed", "a.json"),
        ("t.py::test_0", "rerun", "a.json"),
        ("t.py::test_1", "passed", "b.json"),
        ("t.py::test_2", "passed", "b.json"),
        ("t.py::test_3", "passed", "b.json"),
        ("t.py::test_one", "passed", "a.json"),
        ("t.py::test_two", "passed", "b.json"),
    ]
    assert text == report.markdown(kept)  # the merged report reads as its summary


def test_one_shard_and_an_empty_shard(tmp_path, shards):
    _write(tmp_path / "empty.json", [])
    result = merge(tmp_path, "empty.json", "--markdown", "summary.md")
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "summary.md").read_text(encoding="utf-8")
    assert "**0 isolated tests** (none)" in text
    assert text.splitlines()[-1] == "No leaks, timeouts or crashes."


def _bad(kind: str, path: Path) -> str:
    """Write a bad report of ``kind``; returns the problem the error must state."""
    record = copy.deepcopy(SHARD_2[0])
    if kind == "missing":
        return "cannot read: No such file or directory"
    if kind == "directory":
        path.mkdir()
        return "cannot read: Is a directory"
    if kind in ("not json", "empty", "truncated", "binary", "too deep"):
        text = {
            "not json": "version: 1\ntests: []\n",
            "empty": "",
            "truncated": json.dumps({"version": 1, "tests": SHARD_1})[:-40],
            "binary": "",
            "too deep": '{"version": 1, "tests": ' + "[" * 100_000 + "]" * 100_000 + "}",
        }[kind]
        if kind == "binary":
            path.write_bytes(b"\xff\xfe\x00junk")
        else:
            path.write_text(text, encoding="utf-8")
        return "empty file" if kind == "empty" else "not JSON (truncated?): "
    if kind == "not a report":
        path.write_text('[{"nodeid": "x"}]', encoding="utf-8")
        return "not a pytest-gpuiso report (no 'tests' list)"
    if kind == "tests not a list":
        path.write_text('{"version": 1, "tests": {"x": 1}}', encoding="utf-8")
        return "not a pytest-gpuiso report (no 'tests' list)"
    versions = {"version 2": 2, "version true": True, "version string": "1", "no version": None}
    if kind in versions:
        _write(path, SHARD_1, versions[kind])
        return f"report version {versions[kind]!r}, expected 1"
    broken = {
        "record not an object": ("x", "not an object"),
        "no nodeid": ({k: v for k, v in record.items() if k != "nodeid"}, "'nodeid' is not"),
        "nodeid not a string": ({**record, "nodeid": 12}, "'nodeid' is not a string"),
        "no outcome": ({k: v for k, v in record.items() if k != "outcome"}, "'outcome' is not"),
        "no exit": ({**record, "exit": None}, "'exit' is not an object"),
        "no timed_out": ({**record, "exit": {"code": 0, "signal": None}}, "'exit.timed_out'"),
        "bad signal": ({**record, "exit": {**record["exit"], "signal": 11}}, "'exit.signal'"),
        "timed out without timeout": (
            {
                **record,
                "timeout": None,
                "exit": {"code": -9, "signal": "SIGKILL", "timed_out": True},
            },
            "'timeout' is not a number",
        ),
        "leaks not a list": ({**record, "leaks": "none"}, "'leaks' is not a list"),
        "escaped not a list": ({**record, "escaped": 3}, "'escaped' is not a list"),
        "leak not an object": ({**record, "leaks": ["shm"]}, "leak 0 has no 'detail' string"),
        "leak without detail": ({**record, "leaks": [{"kind": "shm"}]}, "leak 0 has no 'detail'"),
        "unknown leak kind": (
            {**record, "leaks": [{"kind": "gpu", "detail": "x"}]},
            "leak 0 has kind 'gpu', expected one of shm, process, gpu_memory",
        ),
        # Python's json reads NaN, Infinity and ints of any length: none fits a record
        "peak NaN": (
            {**record, "gpu_memory_peak": float("nan")},
            "'gpu_memory_peak' is nan, not a finite number",
        ),
        "peak Infinity": (
            {**record, "gpu_memory_peak": float("inf")},
            "'gpu_memory_peak' is inf, not a finite number",
        ),
        "peak of 401 digits": (
            {**record, "gpu_memory_peak": 10**400},
            "'gpu_memory_peak' is an integer of 401 digits, beyond 64 bits",
        ),
        "timeout NaN": (
            {**record, "timeout": float("nan"), "exit": {**record["exit"], "timed_out": True}},
            "'timeout' is nan, not a finite number",
        ),
    }
    bad_record, problem = broken[kind]
    _write(path, [SHARD_2[1], bad_record])
    return f"test record 1 is malformed: {problem}"


BAD_KINDS = [
    "missing",
    "directory",
    "not json",
    "empty",
    "truncated",
    "binary",
    "too deep",
    "not a report",
    "tests not a list",
    "version 2",
    "version true",
    "version string",
    "no version",
    "record not an object",
    "no nodeid",
    "nodeid not a string",
    "no outcome",
    "no exit",
    "no timed_out",
    "bad signal",
    "timed out without timeout",
    "leaks not a list",
    "escaped not a list",
    "leak not an object",
    "leak without detail",
    "unknown leak kind",
    "peak NaN",
    "peak Infinity",
    "peak of 401 digits",
    "timeout NaN",
]


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_a_bad_input_is_one_error_line_naming_the_file_and_nothing_is_written(
    tmp_path, shards, kind
):
    bad = "reports/bad shard.json"
    problem = _bad(kind, tmp_path / bad)
    step = tmp_path / "step_summary.md"
    result = merge(
        tmp_path,
        shards[0],
        bad,
        shards[1],
        "--markdown",
        "s.md",
        "--json",
        "m.json",
        step_summary=step,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    [line] = result.stderr.splitlines()
    assert result.stderr == line + "\n"
    assert line.startswith(f"error: {bad}: {problem}"), line
    assert result.stdout == ""
    assert not (tmp_path / "s.md").exists()
    assert not (tmp_path / "m.json").exists()
    assert not step.exists()


def test_an_output_that_cannot_be_written_is_one_error_line(tmp_path, shards):
    (tmp_path / "blocker").write_text("a file, not a directory", encoding="utf-8")
    result = merge(tmp_path, *shards, "--json", "blocker/merged.json")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == "error: blocker/merged.json: cannot write: Not a directory\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "the following arguments are required: REPORT"),
        (["--json", "m.json"], "the following arguments are required: REPORT"),
        (["reports/shard-1.json"], "nothing to write: give --markdown, --json or --durations PATH"),
        (["reports/shard-1.json", "--markdown"], "argument --markdown: expected one argument"),
    ],
)
def test_usage_errors_exit_2(tmp_path, shards, args, message):
    result = merge(tmp_path, *args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[0].startswith("usage: python -m pytest_gpuiso merge")
    assert result.stderr.splitlines()[-1] == f"python -m pytest_gpuiso merge: error: {message}"
    assert result.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reports"]


def test_the_help_documents_the_exit_status(tmp_path):
    result = merge(tmp_path, "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "exit status: 0 when the outputs were written; 2 for a usage error" in text
    assert "or when an input report cannot be read or used" in text
    assert 'or an output cannot be written, with one line on stderr: "error: PATH: problem"' in text
    assert "exit status: 0 when the outputs were written; 1" not in text
    assert "$GITHUB_STEP_SUMMARY" in text
