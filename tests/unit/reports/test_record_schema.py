"""The JSON record's schema is written once (``reports.record.Record``) and each of its
fields is documented in docs/json-report.md; the records sessions write are checked
against it in tests/sessions/reports/test_report.py."""

from __future__ import annotations

import re
import typing

from pytest_gpuiso.reports.record import Record
from tests.helpers import ROOT


def _fields(kind: type, prefix: str = "") -> set[str]:
    """The fields of a TypedDict, a nested one's as ``outer.inner``."""
    found = set()
    for name, hint in typing.get_type_hints(kind).items():
        if typing.is_typeddict(hint) and name != "location":  # location's parts: one row
            found |= _fields(hint, f"{prefix}{name}.")
        else:
            found.add(f"{prefix}{name}")
    return found


def _documented() -> set[str]:
    """The fields of the record table in docs/json-report.md (its first column)."""
    text = (ROOT / "docs" / "json-report.md").read_text()
    table = text[text.index("| field | meaning |") :].split("\n\n", 1)[0]
    return set(re.findall(r"^\| `([a-z_.]+)` \|", table, re.MULTILINE))


def test_each_field_of_the_record_is_documented_and_each_documented_field_declared() -> None:
    declared = _fields(Record)
    assert {"nodeid", "exit.signal", "start.method", "location", "shard"} <= declared
    assert _documented() - {"version"} == declared


def test_the_documented_table_is_read() -> None:
    documented = _documented()
    assert len(documented) > 25 and "version" in documented and "exit.expired" in documented
