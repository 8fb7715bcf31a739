"""Text a test made, on the terminal: ``termtext.inert`` keeps a leak's detail on one line
that GitHub's runner does not read as a workflow command; the leak summary prints details
through it, and the annotations keep them inside their own command (a session over a real
leak: tests/sessions/trust/test_workflow_commands.py)."""

from __future__ import annotations

import pytest

from pytest_gpuiso.reports import findings, mdtext, report
from pytest_gpuiso.termtext import inert
from tests.helpers.output import Terminal

FORGED = "x\n::stop-commands::pwned\n::error title=F::forged\r\n  ::add-mask::s\n##[error]v1"


def _is_command(line: str) -> bool:
    """Whether GitHub's runner would take the line as a workflow command."""
    return line.lstrip().startswith("::") or "##[" in line


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("python -c pass", "python -c pass"),
        ("t.py::test_x[a-b] ü 中 ∞", "t.py::test_x[a-b] ü 中 ∞"),  # printable: as it is
        ("a\nb\r\nc\rd", r"a\nb\r\nc\rd"),
        ("tab\tesc\x1b[31mnul\x00del\x7f", r"tab\tesc\x1b[31mnul\x00del\x7f"),
        ("next\x85line\u2028para\u2029", r"next\x85line\u2028para\u2029"),
        ("nbsp\xa0bidi\u202e", r"nbsp\xa0bidi\u202e"),
        ("bad\udcffname", r"bad\udcffname"),  # an undecodable name's lone surrogate
        ("##[error]x and ##[add-mask]y", r"#\x23[error]x and #\x23[add-mask]y"),
        ("###[x", r"##\x23[x"),
        ("::error::x", r"\x3a:error::x"),
        ("   ::stop-commands::t", r"   \x3a:stop-commands::t"),
        ("\n::warning::x", r"\n::warning::x"),  # escaped, it no longer starts a line
        ("\u3000::notice::x", r"\u3000::notice::x"),
        (": :x", ": :x"),
        (7, "7"),
    ],
)
def test_inert_text_is_one_line_that_starts_no_workflow_command(text, shown):
    assert inert(text) == shown
    assert len(inert(text).splitlines()) <= 1
    assert not _is_command(inert(text))
    assert not _is_command("    shm: " + inert(text))


def test_every_control_character_becomes_a_printable_ascii_escape():
    text = "".join(map(chr, range(0x20))) + "\x7f" + "".join(map(chr, range(0x80, 0xA0)))
    assert inert(text).isascii() and inert(text).isprintable()
    assert inert(FORGED).splitlines() == [inert(FORGED)]


def _record(nodeid: str, detail: str, kind: str = "process", level: str = "warn") -> dict:
    return {
        "nodeid": nodeid,
        "outcome": "passed",
        "attempt": 1,
        "exit": {"code": 0, "signal": None, "timed_out": False, "expired": None},
        "leaks": [{"kind": kind, "detail": detail, "level": level}],
        "escaped": [],
        "location": {"file": "t.py", "line": 3},
    }


def test_the_leak_summary_shows_a_forged_detail_on_one_line():
    tr = Terminal()
    report.terminal_summary(tr, [_record("t.py::test_x", f"process 7 (killed): {FORGED}")], None)
    text = "\n".join(tr.lines)
    assert [line for line in text.splitlines() if _is_command(line)] == []
    assert (
        r"    process: process 7 (killed): x\n::stop-commands::pwned\n::error title=F::forged"
        r"\r\n  ::add-mask::s\n#\x23[error]v1"
    ) in tr.lines


def test_the_leak_summary_shows_a_forged_node_id_on_one_line():
    tr = Terminal()
    report.terminal_summary(tr, [_record("t.py::test_x[\n::error::id]", "a leak")], None)
    assert r"  t.py::test_x[\n::error::id]: 1 process" in tr.lines
    assert [line for line in "\n".join(tr.lines).splitlines() if _is_command(line)] == []


@pytest.mark.parametrize("level", ["fail", "warn", "known"])
def test_an_annotation_keeps_a_forged_detail_inside_its_own_command(level):
    """The annotation's message is the detail as it is, escaped by GitHub's rules: one
    line for the runner (which splits at CR and LF only), a command of ours."""
    found = findings.of_records([_record("t.py::test_x", FORGED, "shm", level)])
    [line] = findings.github(found)
    assert "\n" not in line and "\r" not in line
    assert line.startswith(f"::{findings.LEVEL[level]} file=t.py,line=3,title=pytest-gpuiso")
    assert "behind: x%0A::stop-commands::pwned%0A::error title=F::forged%0D%0A" in line


def test_each_noted_gpu_holder_is_one_summary_line_and_notable():
    note = "GPU 0: pid 4242 (not this test's) holds 1324 MiB: noted, not blamed"
    record = {**_record("t.py::test_x", "a leak"), "leaks": [], "gpu_notes": [note, 7]}
    tr = Terminal()
    report.terminal_summary(tr, [record], None)
    assert [line for line in tr.lines if "noted" in line] == [
        f"gpu-isolate: {note} (after t.py::test_x)"
    ]  # a note that is not text (a hostile record) is left out
    assert report.notable([record])
    assert not report.notable([{**record, "gpu_notes": "not a list"}])


def _summary(records: list, baseline: dict | None = None) -> list[str]:
    tr = Terminal()
    report.terminal_summary(tr, records, None, baseline)
    return tr.lines


def _fixtures(*names: str) -> list[dict]:
    return [{"name": name, "scope": "session"} for name in names]


def test_a_forged_fixture_name_is_one_inert_line():
    """A FIXTURE frame's name is the test's process's text: its line break started a line
    of its own (``::error``) in the "set up in N isolated processes" line."""
    name = "model\n::error title=FORGED::a forged error\x1b[2J ##[warning]v1"
    records = [
        {**_record(f"t.py::test_{n}", "a leak"), "leaks": [], "fixtures": _fixtures(name)}
        for n in range(2)
    ]
    lines = _summary(records)
    assert [line for line in "\n".join(lines).splitlines() if _is_command(line)] == []
    assert (
        r"gpu-isolate: session-scoped fixture model\n::error title=FORGED::a forged error"
        r"\x1b[2J #\x23[warning]v1 set up in 2 isolated processes"
    ) in "\n".join(lines)


def test_timeouts_crashes_and_quarantines_name_their_test_on_one_inert_line():
    forged = "t.py::test_x[\n::error::id ##[x \x1b]"
    timed_out = {
        **_record(forged, "a leak"),
        "leaks": [],
        "timeout": 5.0,
        "exit": {"code": -9, "signal": "SIGKILL", "timed_out": True, "expired": "test"},
    }
    crashed = {
        **_record(forged, "a leak"),
        "leaks": [],
        "exit": {"code": -11, "signal": "SIG\n::warning::SEGV", "timed_out": False},
        "gpu_health": {"quarantined": {"0": "Xid 79\n::error::x"}, "probed": "xid"},
    }
    lines = _summary([timed_out, crashed])
    assert [line for line in "\n".join(lines).splitlines() if _is_command(line)] == []
    shown = r"t.py::test_x[\n::error::id #\x23[x \x1b]"
    assert f"  TIMEOUT {shown} (after 5 s)" in lines
    assert rf"  CRASHED {shown} (SIG\n::warning::SEGV)" in lines
    assert rf"  QUARANTINED GPU 0 after {shown}: Xid 79\n::error::x" in lines


def test_the_leak_baselines_lines_name_its_entries_inert():
    """A baseline is a file (a pull request may have written it): the tests it names that
    did not run, and those fixed, are shown escaped."""
    forged = "t.py::test_gone[\n::stop-commands::tok]"
    summary = {
        "path": "known.json",
        "missing": False,
        "entries": 2,
        "known": 0,
        "fixed": [{"nodeid": forged, "kind": "shm"}],
        "not_run": [forged],
    }
    lines = _summary([{**_record("t.py::test_x", "a leak"), "leaks": []}], summary)
    assert [line for line in "\n".join(lines).splitlines() if _is_command(line)] == []
    assert r"  FIXED t.py::test_gone[\n::stop-commands::tok]: shm (no longer leaks)" in lines


def test_a_markdown_cell_holds_no_raw_control_character_nor_lone_surrogate():
    assert mdtext.cell("a\nb\x1b[2J\udcff") == r"a b\\x1b\[2J\\udcff"
    assert mdtext.code_cell("t.py::x[\x1b\u2028]") == r"`t.py::x[\x1b\u2028]`"
    assert mdtext.cell("x" * 400 + "\x1b").endswith("(104 more characters)")  # "\\x1b": 4
