"""pytest's options as a test's process sets them: the parent debugs, distributes, writes
result files and keeps the caches; the test's process only runs its one test."""

from __future__ import annotations

from typing import Any

# Options that must not take effect in the child: the parent debugs, distributes,
# writes result files and keeps the last-failed cache; the child only runs one test.
_CHILD_OVERRIDES: dict[str, Any] = {
    "usepdb": False,
    "trace": False,
    "xmlpath": None,
    "numprocesses": None,
    "maxprocesses": None,
    "dist": "no",
    "tx": [],
    "looponfail": False,
    "report_log": None,
    "htmlpath": None,
    "lf": False,
    "failedfirst": False,
    "newfirst": False,
    "stepwise": False,
    "stepwise_skip": False,
    "gpu_isolate_report": None,
}


def override_options(option: Any, basetemp: str, extra: tuple = ()) -> None:
    """Set the child's options: ours, then what plugins asked for through
    ``pytest_gpuiso_child_options`` (``extra``: (dest, value) pairs), then basetemp."""
    override_again(option)
    for name, value in extra:
        setattr(option, name, value)
    option.basetemp = basetemp


def override_again(option: Any) -> None:
    """Our overrides alone (a conftest's pytest_cmdline_main may have set them again)."""
    for name, value in _CHILD_OVERRIDES.items():
        if hasattr(option, name):
            setattr(option, name, value)
