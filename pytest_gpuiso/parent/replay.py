"""What an isolated test's process did that pytest must see in this process, replayed:
its warnings, junit records and uncaptured output, its leaks as warnings, and a test
that loaded CUDA while it leased no GPU (``warn_cuda_without_gpu``).
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from dataclasses import replace
from typing import Any

import pytest

from .. import _compat
from ..leaks import Verdict
from ..warning_types import GpuIsoLeakWarning, GpuIsoStartWarning, issue_for_test, warn_for_test
from ..wire import frames


def warn_leaks(item: pytest.Item, verdict: Verdict) -> Verdict:
    """``warn`` leaks reach pytest's warnings summary, like any warning of the test,
    through the test's warning filters: ``ignore`` drops one; one that ``error`` turns
    into an exception fails the test's teardown, as the ``fail`` level does."""
    lineno = _line(item)
    warned: list = []
    errors: list = []
    for leak in verdict.warning:
        warning = GpuIsoLeakWarning(f"{leak.kind}: {leak.detail}")
        how = issue_for_test(warning, str(item.path), lineno)
        (errors if how == "error" else warned).append(leak)
        if how == "ignored":  # reported still, but not annotated
            _record_of(verdict, leak)["ignored"] = True
    if not errors:
        return verdict
    for leak in errors:  # their records say they failed the test
        _record_of(verdict, leak)["level"] = "fail"
    return replace(
        verdict,
        failing=verdict.failing + errors,
        warning=warned,
        policy_text=f"{verdict.policy_text}; GpuIsoLeakWarning is an error by -W/filterwarnings",
    )


def _record_of(verdict: Verdict, leak: Any) -> dict[str, Any]:
    """The record of a warned leak, in the verdict's records."""
    return next(
        r
        for r in verdict.records
        if r.get("level") == "warn"
        and not r.get("ignored")
        and (r["kind"], r["detail"]) == (leak.kind, leak.detail)
    )


def junit_xml(config: pytest.Config) -> Any:
    """pytest's LogXML object when this process writes junitxml (not in xdist workers)."""
    return config.stash.get(_compat.xml_key, None)


def replay_junit(config: pytest.Config, records: list[tuple[str, str | None, str, str]]) -> None:
    """Apply the child's record_xml_attribute / record_testsuite_property calls."""
    xml = junit_xml(config)
    if xml is None:
        return
    for kind, nodeid, name, value in records:
        if kind == "attribute":
            xml.node_reporter(nodeid).add_attribute(name, value)
        else:
            xml.add_global_property(name, value)


def echo(config: pytest.Config, text: str) -> None:
    """Show what the test wrote outside capture (e.g. under capsys.disabled()), as in-process."""
    capman = config.pluginmanager.get_plugin("capturemanager")
    with capman.global_and_fixture_disabled() if capman else contextlib.nullcontext():
        sys.stdout.write(text)
        sys.stdout.flush()


def replay_warnings(
    config: pytest.Config, payloads: list[dict[str, Any]], seen: set[tuple[Any, ...]] | None
) -> int:
    """Hand the child's warnings to pytest's warnings summary, as in-process (the child's
    filters already applied to them); return how many were folded.

    A fresh process warns again what a library warns once per process (torch's warn-once
    messages): in-process the session shows it once, isolated every test would. With
    ``seen`` (the session's replayed warnings; None: ``gpu_isolate_warnings = each``) a
    warning an earlier test's process gave, the same category, message and line, is not
    replayed but counted; a test's own repeats of it still are, as in-process."""
    folded = 0
    fresh = set()
    for data in payloads:
        key = tuple(data[k] for k in ("category_module", "category_name", "message"))
        key += (data["filename"], data["lineno"])
        if seen is not None and key in seen:
            folded += 1
            continue
        fresh.add(key)
        message, category = frames.decode_warning(data)
        record = warnings.WarningMessage(
            message=message, category=category, filename=data["filename"], lineno=data["lineno"]
        )
        config.hook.pytest_warning_recorded.call_historic(
            kwargs=dict(
                warning_message=record, when="runtest", nodeid=data["nodeid"], location=None
            )
        )
    if seen is not None:
        seen |= fresh
    return folded


NO_GPU = (
    "gpu-isolate: this test loaded {libraries} but leased no GPU, so it saw none "
    '(CUDA_VISIBLE_DEVICES=""); if it needs a GPU, mark it @pytest.mark.gpu_isolated(gpus=1) '
    "or run with --gpu-isolate-gpus=1 (marked gpus=0, it is not warned)"
)


def warn_cuda_without_gpu(item: pytest.Item, explicit: bool, loaded: list[str]) -> None:
    """One ``GpuIsoStartWarning`` for a test that loaded CUDA's driver library or NVML
    while it leased no GPU and GPUs exist (``loaded``: its ``DRIVER`` frame), unless its
    marker said ``gpus=0`` (``explicit``). The message is the same for every test, so
    pytest's warnings summary lists the tests under one entry."""
    if loaded and not explicit:
        text = NO_GPU.format(libraries=" and ".join(loaded))
        warn_for_test(GpuIsoStartWarning(text), str(item.path), _line(item))


def _line(item: pytest.Item) -> int:
    """The 1-based line of the test's definition, where its warnings point."""
    return (item.location[1] or 0) + 1
