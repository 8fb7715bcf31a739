"""What ``merge`` and ``compare`` read is input, crafted or corrupted: a number no float
holds, a node id no encoding holds, text that would start a workflow command. Each is one
line of error (exit status 2) or is printed escaped; never a traceback, never a line that
GitHub's runner reads as a command, never a raw escape sequence on the terminal."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_gpuiso.__main__ import main
from pytest_gpuiso.reports import baseline
from pytest_gpuiso.reports.record import SCHEMA_VERSION

FORGED = "x\n::error title=FORGED::forged\r##[warning]v1 \x1b[2J\u2028::notice::y"
SURROGATE = "t.py::test_\ud800x"  # valid JSON ("\ud800"), not valid UTF-8


def _record(nodeid: str, **more) -> dict:
    return {
        "nodeid": nodeid,
        "outcome": "passed",
        "attempt": 1,
        "exit": {"code": 0, "signal": None, "timed_out": False, "expired": None},
        "timeout": 900.0,
        "leaks": [],
        "escaped": [],
        "location": {"file": "t.py", "line": 3},
        **more,
    }


def _report(path: Path, *records: dict, **document) -> str:
    path.write_text(json.dumps({"version": SCHEMA_VERSION, "tests": list(records), **document}))
    return str(path)


def _commands(text: str) -> list[str]:
    """The lines of ``text`` GitHub's runner would take as workflow commands (it splits at
    CR and LF only: ``::`` first, or ``##[`` anywhere) that are not the plugin's own
    annotations (read as theirs first, whatever their message holds)."""
    ours = re.compile(r"::(error|warning|notice) file=t\.py,line=3,title=pytest-gpuiso%3A ")
    lines = re.split(r"\r\n|\r|\n", text)
    return [
        line
        for line in lines
        if (line.lstrip().startswith("::") or "##[" in line) and not ours.match(line)
    ]


# -- numbers ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        pytest.param(
            "1" + "0" * 400,
            "'t.py::test_b' is an integer of 401 digits, beyond 64 bits",
            id="401 digits",
        ),
        pytest.param("1e400", "'t.py::test_b' is inf, not a finite number", id="1e400"),
        pytest.param("NaN", "'t.py::test_b' is nan, not a finite number", id="NaN"),
        pytest.param("-Infinity", "'t.py::test_b' is -inf, not a finite number", id="-Infinity"),
    ],
)
def test_a_number_no_float_holds_in_a_durations_file_is_one_line(
    tmp_path: Path, capsys, value: str, problem: str
) -> None:
    """``merge --durations`` reads the file it updates: a 401-digit number in it was an
    OverflowError's traceback and exit status 1."""
    path = tmp_path / ".test_durations"
    content = '{"t.py::test_b": ' + value + "}"
    path.write_text(content)
    one = _report(tmp_path / "one.json", _record("t.py::test_a", wall=2.5))
    assert main(["merge", one, "--durations", str(path)]) == 2
    assert capsys.readouterr().err == f"error: {path}: not a durations file ({problem})\n"
    assert path.read_text() == content


def test_a_dangling_link_of_yours_as_the_durations_file_is_written_through(
    tmp_path: Path, capsys
) -> None:
    """As every report output: the link kept, the file it names made (it was "cannot read:
    No such file or directory")."""
    link = tmp_path / ".test_durations"
    link.symlink_to("durations/not-yet.json")
    (tmp_path / "durations").mkdir()
    one = _report(tmp_path / "one.json", _record("t.py::test_a", wall=2.5))
    assert main(["merge", one, "--durations", str(link)]) == 0
    assert link.is_symlink()
    assert json.loads((tmp_path / "durations" / "not-yet.json").read_text()) == {
        "t.py::test_a": 2.5
    }


def test_a_gpu_memory_peak_that_is_a_float_is_compared_not_a_traceback(
    tmp_path: Path, capsys
) -> None:
    """JSON has one kind of number: a peak written as 1.5e9 was a TypeError of ``>>``."""
    base = _report(tmp_path / "base.json", _record("t.py::test_a", gpu_memory_peak=1.5e9))
    head = _report(tmp_path / "head.json", _record("t.py::test_a", gpu_memory_peak=4.5e9))
    assert main(["compare", base, head]) == 1
    out = capsys.readouterr().out
    assert "NEW    t.py::test_a: GPU memory peak: 1430 MiB -> 4291 MiB" in out


# -- text ---------------------------------------------------------------------------------


def test_a_node_id_no_encoding_holds_is_printed_escaped_in_every_output(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """A lone surrogate in a node id (a crafted or corrupted report) was a
    UnicodeEncodeError's traceback while compare printed it. The terminal, the annotations,
    the Markdown, the step summary and the Code Quality report show its escape; the leak
    baseline keeps it, so that the test it names is the same test when read back."""
    step = tmp_path / "step.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(step))
    leak = {"kind": "shm", "detail": "segment /dev/shm/\udcff left in /dev/shm"}
    base = _report(tmp_path / "base.json", _record("t.py::test_a"))
    head = _report(
        tmp_path / "head.json",
        _record("t.py::test_a"),
        _record(SURROGATE, leaks=[leak], exit={"signal": None, "timed_out": True}),
    )
    outputs = {name: tmp_path / name for name in ("c.md", "cq.json", "known.json")}
    args = ["compare", base, head, "--annotations", "github", "--markdown", str(outputs["c.md"])]
    args += ["--code-quality", str(outputs["cq.json"]), "--write-baseline"]
    assert main([*args, str(outputs["known.json"])]) == 1
    out, err = capsys.readouterr()
    assert err == "" and "\ud800" not in out
    assert r"NEW    t.py::test_\ud800x: leak shm: segment /dev/shm/\udcff left" in out
    assert r"NEW    t.py::test_\ud800x: timeout: ended by the timeout" in out
    assert r"ONLY IN HEAD t.py::test_\ud800x" in out
    assert any(
        line.startswith("::error file=t.py,line=3,") and r"t.py::test_\ud800x: leak shm" in line
        for line in out.splitlines()
    )
    for markdown in (outputs["c.md"], step):  # UTF-8: it would raise on a lone surrogate
        assert r"| `t.py::test_\ud800x` | leak shm | segment /dev/shm/\\udcff left" in (
            markdown.read_text()
        )
    for issue in json.loads(outputs["cq.json"].read_text()):
        assert "\ud800" not in issue["description"] and len(issue["fingerprint"]) == 64
    known = baseline.load(str(outputs["known.json"]))
    assert known.kinds(SURROGATE) == {"shm"}


def test_what_a_report_says_starts_no_workflow_command_on_compares_terminal(
    tmp_path: Path, capsys
) -> None:
    """Node ids, leak details, signal names and the runs' environments of a report reach
    compare's terminal through ``termtext.inert``: escaped, on one line each; the
    annotations keep them inside their own command, escaped by GitHub's rules."""
    session = {
        "started": "2026-12-01T00:00:00Z",
        "environment": {"torch": FORGED, "gpus": [{"name": FORGED}]},
    }
    base = _report(
        tmp_path / "base.json",
        _record(f"t.py::test_a[{FORGED}]", leaks=[{"kind": "process", "detail": FORGED}]),
        _record(f"t.py::test_gone[{FORGED}]"),
        session={"started": "2026-12-01T00:00:00Z", "environment": {"torch": "2.8"}},
    )
    crash = {"code": -11, "signal": FORGED, "timed_out": False, "expired": None}
    head = _report(
        tmp_path / "head.json",
        _record(f"t.py::test_a[{FORGED}]", leaks=[{"kind": "shm", "detail": FORGED}]),
        _record(f"t.py::test_new[{FORGED}]", outcome="failed", exit=crash),
        session=session,
    )
    assert main(["compare", base, head, "--annotations", "github"]) == 1
    out, err = capsys.readouterr()
    assert _commands(out + err) == []
    assert "\x1b" not in out + err and "\u2028" not in out + err
    shown = r"x\n::error title=FORGED::forged\r#\x23[warning]v1 \x1b[2J\u2028::notice::y"
    assert f"FIXED  t.py::test_a[{shown}]: leak process" in out.splitlines()
    assert f"ONLY IN BASE t.py::test_gone[{shown}]" in out.splitlines()
    assert f"warning: the runs differ: torch: 2.8 in base, {shown} in head" in err.splitlines()


def test_an_error_line_quoting_a_report_is_inert(tmp_path: Path, capsys) -> None:
    """A malformed record's message quotes what it holds (a leak's kind): one line still."""
    bad = _report(tmp_path / "bad.json", _record("t.py::a", leaks=[{"kind": FORGED, "detail": ""}]))
    assert main(["merge", bad, "--json", str(tmp_path / "m.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and _commands(err) == [] and "\x1b" not in err
    assert err.startswith(f"error: {bad}: test record 0 is malformed: leak 0 has kind ")


def test_merges_overlap_warning_is_inert(tmp_path: Path, capsys) -> None:
    one = _report(tmp_path / "one.json", _record(f"t.py::test_a[{FORGED}]"))
    two = _report(tmp_path / "two.json", _record(f"t.py::test_a[{FORGED}]"))
    assert main(["merge", one, two, "--json", str(tmp_path / "m.json")]) == 0
    err = capsys.readouterr().err
    assert err.startswith("warning: 1 test is in more than one shard") and err.count("\n") == 1
    assert _commands(err) == [] and "\x1b" not in err


def test_the_process_never_crashes_on_a_name_its_streams_cannot_encode(tmp_path: Path) -> None:
    """A path from the command line that is not UTF-8 (surrogate-escaped by Python) is
    printed as its escape, whatever stdout's encoding."""
    name = os.fsdecode(b"m\xff.json")
    one = _report(tmp_path / "one.json", _record("t.py::test_a"))
    done = subprocess.run(
        [sys.executable, "-m", "pytest_gpuiso", "merge", one, "--json", name],
        capture_output=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONIOENCODING": "utf-8:strict"},
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert b"Traceback" not in done.stderr
    assert rb"to m\udcff.json" in done.stdout
    assert (tmp_path / name).exists()


def test_a_leak_baseline_that_cannot_serve_says_so_in_one_inert_line(tmp_path: Path) -> None:
    """The session's usage error quotes the baseline file's entry: inert too."""
    path = tmp_path / "known.json"
    entry = {"nodeid": "t.py::a", "kind": FORGED}
    path.write_text(json.dumps({"format": baseline.FORMAT, "version": 1, "leaks": [entry]}))
    with pytest.raises(baseline.ReportError) as raised:
        baseline.load(str(path))
    message = str(raised.value)
    assert message.startswith(f"{path}: entry 0 has kind ")
    assert message.isprintable() and "##[" not in message
