"""Fixtures broader than a test are set up anew in each isolated test's process: each
test's JSON record says which its process set up, and ``reports.fixtures.rebuilt`` names
those more than one process set up. The sessions run
fixtures/programs/isolation/sem_fixture_scopes.py."""

from __future__ import annotations

from pytest_gpuiso.reports.fixtures import rebuilt
from tests.helpers import REPORT

PROGRAM = "sem_fixture_scopes.py"


def test_each_record_names_the_broad_fixtures_its_process_set_up(gpuiso):
    gpuiso.copy(PROGRAM)
    result = gpuiso.run(REPORT, PROGRAM)
    result.assert_outcomes(passed=4)
    records = gpuiso.records()
    model = {"name": "model", "scope": "session"}
    optimizer = {"name": "optimizer", "scope": "class"}
    # In the order they began; not pytest's own (tmp_path's tmp_path_factory), not a
    # private autouse one, not the function-scoped ones; the in-process test has no record.
    assert {nodeid: record.get("fixtures") for nodeid, record in records.items()} == {
        f"{PROGRAM}::test_uses_model_and_db": [model, {"name": "db", "scope": "module"}],
        f"{PROGRAM}::TestSteps::test_step": [model, optimizer],
        f"{PROGRAM}::TestSteps::test_eval": [model, optimizer],
    }
    # db: one process only, so not named
    assert rebuilt(list(records.values())) == (
        "session-scoped fixture model set up in 3 isolated processes, class-scoped "
        'optimizer in 2: each isolated test sets up its own (docs/semantics.md, "Fixtures")'
    )
