"""NVIDIA's Xid catalog as ``gpu.xids`` reads it: each Xid's class and action, the ones
other sources disagree on, and an Xid it does not hold. Whole sessions where the
simulator raises them are in tests/gpusim/test_xids.py."""

from __future__ import annotations

import pytest

from pytest_gpuiso.gpu import xids


@pytest.mark.parametrize(
    ("number", "kind"),
    [
        *((n, xids.APPLICATION) for n in (8, 11, 13, 31, 68, 94, 126)),  # restart the application
        *((n, xids.IGNORE) for n in (43, 45, 63, 92, 121)),  # informational
        *((n, xids.RESET) for n in (48, 95, 109, 119, 120, 140)),  # reset the GPU
        (79, xids.REBOOT),  # fallen off the bus
    ],
)
def test_each_xid_gets_the_class_of_its_catalog_action(number: int, kind: str) -> None:
    assert xids.classify(number).kind == kind


def test_dcgms_always_fatal_xids_all_quarantine() -> None:
    """DCGM fails a GPU on these whatever else it sees; so do we (by the catalog's action)."""
    assert all(xids.classify(n).quarantines for n in (48, 74, 79, 95, 119, 120, 140))


def test_kubernetes_ignored_xids_are_not_all_the_applications() -> None:
    """The device plugin's list (13, 31, 43, 45, 68, 109): the catalog wants a reset for
    109, and 43 and 45 only noted."""
    read = {n: xids.classify(n).kind for n in (13, 31, 43, 45, 68, 109)}
    assert read == {
        13: xids.APPLICATION,
        31: xids.APPLICATION,
        43: xids.IGNORE,
        45: xids.IGNORE,
        68: xids.APPLICATION,
        109: xids.RESET,
    }


def test_an_xid_the_catalog_does_not_hold_quarantines_saying_so() -> None:
    unknown = xids.classify(999)
    assert (unknown.kind, unknown.name, unknown.quarantines) == (xids.UNKNOWN, "", True)
    assert unknown.text() == (
        "Xid 999 (unknown): not in NVIDIA's Xid catalog: read the driver's log (dmesg) and "
        "the catalog"
    )


def test_every_class_says_what_to_do_and_every_entry_has_a_known_bucket() -> None:
    assert set(xids.ACTIONS) == set(xids.BUCKETS.values()) | {xids.UNKNOWN}
    assert all(bucket in xids.BUCKETS for _, bucket in xids.CATALOG.values())
    assert all(name for name, _ in xids.CATALOG.values())
    fallen = xids.classify(79)
    assert fallen.text() == "Xid 79 (GPU has fallen off the bus): reboot the machine"
    assert fallen.entry("1") == {
        "device": "1",
        "xid": 79,
        "name": "GPU has fallen off the bus",
        "class": "reboot",
        "action": "reboot the machine",
    }
    assert "nvidia-smi -r" in xids.classify(48).action and not xids.classify(13).quarantines
