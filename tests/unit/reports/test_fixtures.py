"""``reports.fixtures.rebuilt``: the one line naming the broad fixtures that more than one
isolated process set up, from the records' ``fixtures``."""

from __future__ import annotations

import pytest

from pytest_gpuiso.reports.fixtures import rebuilt

WHERE = ': each isolated test sets up its own (docs/semantics.md, "Fixtures")'


def record(*fixtures: tuple[str, str], nodeid: str = "t.py::t", attempt: int = 1) -> dict:
    return {
        "nodeid": nodeid,
        "attempt": attempt,
        "fixtures": [{"name": name, "scope": scope} for name, scope in fixtures],
    }


def test_none_when_no_broad_fixture_was_set_up_twice():
    assert rebuilt([]) is None
    assert rebuilt([{"nodeid": "t.py::a"}, {"nodeid": "t.py::b", "fixtures": []}]) is None
    once = [record(("model", "session"), nodeid="t.py::a"), record(nodeid="t.py::b")]
    assert rebuilt(once) is None


def test_names_each_with_its_count_broadest_scope_then_most_processes_first():
    records = [
        record(("db", "module"), ("model", "session")),
        record(("model", "session"), ("db", "module"), ("opt", "class")),
        record(("model", "session"), ("db", "module"), ("opt", "class")),
        record(("model", "session"), ("pkg", "package"), ("cfg", "session")),
        record(("cfg", "session"), ("pkg", "package"), ("only_once", "module")),
    ]
    assert rebuilt(records) == (
        "session-scoped fixture model set up in 4 isolated processes, session-scoped cfg "
        "in 2, package-scoped pkg in 2, module-scoped db in 3, class-scoped opt in 2" + WHERE
    )


def test_a_rerun_is_another_process_and_a_fixture_counts_once_a_process():
    records = [
        record(("model", "session"), ("model", "session"), attempt=1),
        record(("model", "session"), attempt=2),
    ]
    assert rebuilt(records) == "session-scoped fixture model set up in 2 isolated processes" + WHERE


@pytest.mark.parametrize(
    ("extra", "tail"), [(1, " and 1 more fixture"), (3, " and 3 more fixtures")]
)
def test_at_most_five_are_named_then_the_rest_counted(extra, tail):
    names = [f"f{i}" for i in range(5 + extra)]
    line = rebuilt([record(*((name, "module") for name in names))] * 2)
    named = ", ".join(f"module-scoped {name} in 2" for name in names[1:5])
    assert line == (
        f"module-scoped fixture f0 set up in 2 isolated processes, {named}{tail}" + WHERE
    )


def test_the_same_name_in_two_scopes_is_two_fixtures():
    records = [record(("x", "session"), ("x", "module"))] * 2 + [record(("x", "module"))]
    assert rebuilt(records) == (
        "session-scoped fixture x set up in 2 isolated processes, module-scoped x in 3" + WHERE
    )


@pytest.mark.parametrize(
    "fixtures",
    [
        "model",
        ["model"],
        [{"name": "model"}],
        [{"name": "model", "scope": "function"}],
        [{"name": 3, "scope": "session"}],
        [{"name": "", "scope": "session"}],
        [{"name": "model", "scope": ["session"]}],
    ],
)
def test_what_a_record_from_a_file_holds_that_is_not_a_fixture_is_left_out(fixtures):
    records = [{"nodeid": "t.py::a", "fixtures": fixtures}] * 3
    assert rebuilt(records) is None
