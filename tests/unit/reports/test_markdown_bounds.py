"""The Markdown a session or compare writes (for $GITHUB_STEP_SUMMARY and a pull
request comment) stays under GitHub's limits: a comment is refused past 65,536
characters, a step summary past 1 MiB is dropped whole. Long cells are cut, long
sections end with how many rows were left out, and the whole is cut at a line with a
note: shortened, never dropped."""

from __future__ import annotations

from pytest_gpuiso.reports import compare, mdtext, report

COMMENT_LIMIT = 65_536
JVM = "java -cp " + ":".join(f"/opt/app/lib/dependency-{i:04d}-1.2.3.jar" for i in range(1300))


def _record(nodeid: str, leaks=()) -> dict:
    return {
        "nodeid": nodeid,
        "outcome": "passed",
        "attempt": 1,
        "exit": {"code": 0, "signal": None, "timed_out": False, "expired": None},
        "timeout": 900.0,
        "leaks": [{"kind": kind, "detail": detail} for kind, detail in leaks],
        "escaped": [],
        "startup": 0.5,
        "gpu_memory_peak": None,
    }


def test_a_long_cell_is_cut_and_says_by_how_much():
    assert len(JVM) > 40_000
    text = mdtext.cut(JVM)
    assert len(text) == mdtext.CELL_CHARS
    assert text.startswith("java -cp /opt/app/lib/dependency-0000")
    assert text.endswith(f"... ({len(JVM) - mdtext.CELL_CHARS} more characters)")
    assert mdtext.cut("short") == "short"


def test_a_session_whose_test_leaks_jvms_stays_under_a_comment():
    leaks = [
        ("process", f"process {n} still running after the test ended: {JVM}") for n in range(40)
    ]
    text = report.markdown([_record("t.py::test_jvms", leaks)])
    assert len(text) < COMMENT_LIMIT
    assert text.count("| `t.py::test_jvms` | process |") == 40  # every leak, each cut
    assert "more characters)" in text


def test_many_leaky_tests_are_cut_at_a_line_with_a_note():
    records = [
        _record(
            f"tests/test_{n}.py::test_{'x' * 200}", [("shm", "segment /dev/shm/x " + "y" * 250)]
        )
        for n in range(1000)
    ]
    text = report.markdown(records)
    assert len(text) < COMMENT_LIMIT
    assert text.rstrip().endswith(
        "not shown (GitHub's size limits): every test is in the JSON report.**"
    )
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert 50 < len(rows) < 200 and all(row.endswith(" |") for row in rows)  # whole rows


def test_a_session_says_where_the_rest_is_only_where_there_is_one(tmp_path, monkeypatch):
    """Before: "every test is in the JSON report" even in a session that wrote none."""
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    records = [_record(f"t.py::test_{n}", [("shm", f"segment /dev/shm/x{n}")]) for n in range(300)]
    report.write_markdown(tmp_path / "a.md", records, report=tmp_path / "gpuiso.json")
    report.write_markdown(tmp_path / "b.md", records)
    said = (tmp_path / "a.md").read_text().splitlines()
    assert "100 more leaks are in the JSON report (gpuiso.json)." in said
    without = (tmp_path / "b.md").read_text()
    assert "100 more leaks are in the JSON report of --gpu-isolate-report=PATH." in without
    assert "in the JSON report." not in without


def test_compare_of_a_renamed_module_of_15000_tests_stays_under_a_comment():
    base = [_record(f"tests/models/test_layers.py::test_layer[case{i}]") for i in range(15000)]
    renamed = [
        _record(f"tests/models/test_layer_ops.py::test_layer[case{i}]") for i in range(15000)
    ]
    text = compare.markdown(compare.compare(base, renamed))
    assert len(text) < COMMENT_LIMIT
    assert "14800 more not shown: compare's terminal output lists every one." in text
    assert "### Only in base" in text and "### Only in head" in text


def test_compare_of_15000_new_leaks_stays_under_a_comment():
    shm = ("shm", "segment /dev/shm/psm_1 (1048576 bytes, created by pid 12) left in /dev/shm")
    base = [_record(f"t.py::test[{i}]") for i in range(15000)]
    head = [_record(f"t.py::test[{i}]", [shm]) for i in range(15000)]
    text = compare.markdown(compare.compare(base, head))
    assert len(text) < COMMENT_LIMIT
    assert text.count("\n| `t.py::test[") == compare.ROWS
    assert "14800 more not shown" in text


def test_markdown_under_the_limit_is_left_whole():
    lines = ["## t", "", "| a |", "|---|", "| b |"]
    assert mdtext.bounded(lines, "anywhere") == "\n".join(lines) + "\n"
    cut = mdtext.bounded([f"| row {n} |" for n in range(100)], "the JSON report", limit=300)
    assert len(cut) <= 300
    assert cut.endswith("more lines not shown (GitHub's size limits): the JSON report.**\n")
