"""A test's warning names its category by module and class: pytest's process rebuilds it
without importing that module (which is the test's to choose: importing it would run the
test's code in pytest, or hang it, or load torch and its CUDA driver there). The category
itself where pytest has its module already; else a class of the same name, of the
category's nearest builtin base, the same class for each warning of that category."""

from __future__ import annotations

import json
import time

from tests.helpers import GpuIso

PROGRAM = "sec_warning_categories"


def test_a_category_of_a_module_pytest_never_imported_is_named_not_imported(
    gpuiso_spawn: GpuIso, lease_region
):
    gpuiso_spawn.copy(PROGRAM)
    folder = gpuiso_spawn.path / PROGRAM
    start = time.monotonic()
    result = gpuiso_spawn.run(PROGRAM, "-p", "no:randomly")
    elapsed = time.monotonic() - start

    result.assert_outcomes(passed=3)
    # the module's import, in pytest's process, leaves this file and takes 60 s
    assert not (folder / "imported-outside-the-test").exists(), result.stdout.str()
    assert elapsed < 45, f"the session took {elapsed:.1f} s"
    result.stdout.fnmatch_lines_random(
        [
            "*test_foreign_categories.py:*: ForeignWarning: MARKER-FOREIGN-1",
            "*test_foreign_categories.py:*: ForeignWarning: MARKER-FOREIGN-2",
            "*test_foreign_categories.py:*: PlainWarning: MARKER-NESTED",
        ]
    )
    seen = json.loads((folder / "categories-main.json").read_text())
    assert seen["imported"] is False
    by_message = {w["message"]: w for w in seen["warnings"]}
    assert set(by_message) == {"MARKER-FOREIGN-1", "MARKER-FOREIGN-2", "MARKER-NESTED"}
    first, again = by_message["MARKER-FOREIGN-1"], by_message["MARKER-FOREIGN-2"]
    assert (first["category_module"], first["qualname"], first["name"]) == (
        "foreign_category",
        "ForeignWarning",
        "ForeignWarning",
    )
    assert first["mro"][:2] == ["ForeignWarning", "DeprecationWarning"]
    assert again["id"] == first["id"]  # one category, one class
    nested = by_message["MARKER-NESTED"]
    assert (nested["category_module"], nested["qualname"], nested["name"]) == (
        "foreign_category",
        "Outer.PlainWarning",
        "PlainWarning",
    )
    assert nested["mro"][:2] == ["PlainWarning", "Warning"]


def test_under_xdist_neither_worker_nor_controller_imports_the_category(
    gpuiso_spawn: GpuIso, lease_region
):
    """xdist's controller rebuilds a worker's warnings by importing the category's module:
    a stand-in's module is the plugin's own, so the controller never imports the test's."""
    gpuiso_spawn.copy(PROGRAM)
    folder = gpuiso_spawn.path / PROGRAM
    result = gpuiso_spawn.run(PROGRAM, "-p", "no:randomly", "-n", "1")

    result.assert_outcomes(passed=3)
    assert not (folder / "imported-outside-the-test").exists(), result.stdout.str()
    result.stdout.fnmatch_lines_random(
        ["*ForeignWarning: MARKER-FOREIGN-1", "*PlainWarning: MARKER-NESTED"]
    )
    for who in ("main", "gw0"):
        seen = json.loads((folder / f"categories-{who}.json").read_text())
        assert seen["imported"] is False, who
        names = sorted(w["name"] for w in seen["warnings"])
        assert names == ["ForeignWarning", "ForeignWarning", "PlainWarning"], who
        assert {w["module"] for w in seen["warnings"]} == {"pytest_gpuiso.parent.standins"}
