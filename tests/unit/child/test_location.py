"""A test's process takes its item's location from pytest's process, which computed it
already (pytest reads the test's source for it), instead of computing it again."""

from __future__ import annotations

import pytest

from pytest_gpuiso import _compat

pytestmark = pytest.mark.versions  # pytest's Item.location, a cached property


def _item(pytester):
    module = pytester.getmodulecol("def test_a():\n    pass\n", configargs=("-p", "no:syrupy"))
    return module.collect()[0]


def test_a_given_location_is_the_items(pytester):
    item = _item(pytester)
    given = ("elsewhere/test_x.py", 41, "test_a")
    _compat.set_location(item, given)
    assert item.location == given
    report = pytest.TestReport.from_item_and_call(
        item, pytest.CallInfo.from_call(lambda: None, "call")
    )
    assert report.location == given


def test_a_location_computed_already_is_kept(pytester):
    item = _item(pytester)
    computed = item.location
    _compat.set_location(item, ("elsewhere/test_x.py", 41, "test_a"))
    assert item.location == computed
    assert computed[2] == "test_a"
