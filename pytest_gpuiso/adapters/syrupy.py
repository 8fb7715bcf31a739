"""syrupy and isolated tests: the snapshots an isolated test used count in pytest's report.

syrupy decides at the end of a session which snapshots no test used, and with
``--snapshot-update`` deletes them. A test's process runs one test: on its own it would
delete every other test's snapshots, and pytest, which never saw the isolated tests'
assertions, would delete theirs. So:

- the tests' processes run with ``disable_unused_snapshots`` (``--snapshot-disable-unused``,
  asked through ``pytest_gpuiso_child_options``): they write what their test created or
  updated and delete nothing;
- each sends its assertions' results (location, name, data, created / updated / success);
- pytest rebuilds them as assertions of its own snapshot session (a ``SnapshotAssertion``
  per extension, its ``executions`` filled), so its report counts them (passed, generated,
  updated, failed) and its unused detection spares them, as for an in-process test.
  Under xdist the worker's report carries them to the controller, as syrupy does.

syrupy's internals used (checked once; without them one warning, and pytest's unused
detection is turned off rather than deleting the isolated tests' snapshots; syrupy < 6.0,
without ``--snapshot-disable-unused``, gets a warning too):
``config._syrupy`` (``SnapshotSession``: ``_assertions``, ``_written_snapshot_locations``),
``SnapshotAssertion(session, extension_class, test_location, update_snapshots)`` and its
``executions``, ``AssertionResult``, ``PyTestLocation``.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest

from ..warning_types import GpuIsoStartWarning, warn_session
from . import plugin_version

PLUGIN = "syrupy"  # syrupy's entry point name
KEY = "syrupy"  # its part of the payload
_RESULT_FIELDS = ("snapshot_location", "snapshot_name", "created", "updated", "success")
_warned = pytest.StashKey[bool]()


def _fields(cls: type) -> set[str]:
    """Field names of a dataclass or attrs class (syrupy used attrs before 4.0)."""
    found = set(getattr(cls, "__dataclass_fields__", ()))
    return found | {a.name for a in getattr(cls, "__attrs_attrs__", ())}


def missing_internals() -> list[str]:
    """What this adapter needs of syrupy and the installed version lacks."""
    try:
        from syrupy.assertion import AssertionResult, SnapshotAssertion
        from syrupy.location import PyTestLocation  # noqa: F401
        from syrupy.session import SnapshotSession
    except ImportError as exc:
        return [str(exc)]
    needs = {
        "SnapshotSession._assertions": "_assertions" in _fields(SnapshotSession),
        "SnapshotAssertion.executions": hasattr(SnapshotAssertion, "executions"),
        "SnapshotAssertion(session, extension_class, test_location, update_snapshots)": {
            "session",
            "extension_class",
            "test_location",
            "update_snapshots",
        }
        <= _fields(SnapshotAssertion),
        "AssertionResult": {*_RESULT_FIELDS, "asserted_data", "recalled_data", "exception"}
        <= _fields(AssertionResult),
        "AssertionResult.final_data": hasattr(AssertionResult, "final_data"),
    }
    return [name for name, there in needs.items() if not there]


def _warn_once(config: Any, text: str) -> None:
    if not config.stash.get(_warned, False):
        config.stash[_warned] = True
        warn_session(config, GpuIsoStartWarning(f"syrupy {plugin_version('syrupy')}: {text}"))


def _unsupported(config: Any, reason: str) -> None:
    """Isolated tests' snapshots cannot be reported: pytest's unused detection off, so
    that nothing they used is deleted as unused (syrupy >= 6.0 has the option)."""
    if hasattr(config.option, "disable_unused_snapshots"):
        config.option.disable_unused_snapshots = True
        effect = "unused snapshot detection turned off"
    else:
        effect = "--snapshot-update deletes them as unused"
    _warn_once(config, f"{reason}; isolated tests' snapshots not reported, {effect}")


def _import(path: tuple[str, str]) -> type:
    module, qualname = path
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


class SyrupyAdapter:
    """Both sides: options and payload in the test's process, the report in pytest."""

    def pytest_gpuiso_child_options(self, config: Any) -> dict[str, Any] | None:
        if not config.pluginmanager.has_plugin(PLUGIN):
            return None
        missing = missing_internals()
        if missing:
            _unsupported(config, "no " + ", ".join(missing))
        elif not hasattr(config.option, "disable_unused_snapshots"):
            _warn_once(
                config,
                "no --snapshot-disable-unused (syrupy < 6.0); with --snapshot-update each "
                "isolated test's process deletes the snapshots its test did not use",
            )
        return {"disable_unused_snapshots": True}

    def pytest_gpuiso_child_payload(self, item: Any, payload: dict[str, Any]) -> None:
        session = getattr(item.config, "_syrupy", None)
        if session is None or missing_internals():
            return
        results = []
        for assertion in session._assertions:
            cls = assertion.extension_class
            for result in assertion.executions.values():
                sent = {name: getattr(result, name) for name in _RESULT_FIELDS}
                sent["data"] = result.final_data
                sent["extension"] = (cls.__module__, cls.__qualname__)
                results.append(sent)
        written = sorted(getattr(session, "_written_snapshot_locations", ()))
        if results or written:
            payload[KEY] = {"results": results, "written": written}

    def pytest_gpuiso_parent_payload(
        self, item: Any, payload: dict[str, Any], reports: list
    ) -> None:
        sent = payload.get(KEY)
        session = getattr(item.config, "_syrupy", None)
        if not sent or session is None:
            return
        if hasattr(session, "_written_snapshot_locations"):  # lock files to clean up
            session._written_snapshot_locations.update(sent["written"])
        by_extension: dict[tuple[str, str], list[dict]] = {}
        for result in sent["results"]:
            by_extension.setdefault(tuple(result["extension"]), []).append(result)
        for extension, results in by_extension.items():
            try:
                extension_class = _import(extension)
            except Exception as exc:  # a class pytest cannot import by its name
                _unsupported(item.config, f"extension {'.'.join(extension)}: {exc!r}")
                continue
            _add_assertion(session, item, extension_class, results)


def _add_assertion(session: Any, item: Any, extension_class: type, results: list) -> None:
    """An assertion of pytest's snapshot session holding what the test's process saw."""
    from syrupy.assertion import AssertionResult, SnapshotAssertion
    from syrupy.location import PyTestLocation

    location = PyTestLocation(item)
    assertion = SnapshotAssertion(
        session=session,  # registers it with the session
        extension_class=extension_class,
        test_location=location,
        update_snapshots=bool(item.config.option.update_snapshots),
    )
    for index, result in enumerate(results):
        assertion.executions[index] = AssertionResult(
            **{name: result[name] for name in _RESULT_FIELDS},
            asserted_data=result["data"],
            recalled_data=result["data"],
            exception=None,
            test_location=location,
        )


def register(pluginmanager: Any) -> None:
    pluginmanager.register(SyrupyAdapter(), "gpuiso-adapter-syrupy")
