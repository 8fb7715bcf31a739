"""What an isolated test's process did that pytest must see in this process, replayed:
its warnings (their categories rebuilt importing nothing), junit records and uncaptured
output, its leaks as warnings, and a test that loaded CUDA while it leased no GPU
(``warn_cuda_without_gpu``). A warning of the test is issued through the test's own
filters (``issue_for_test``).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
import warnings
from dataclasses import replace
from typing import Any

import pytest

from .. import _compat
from ..leaks import ADVICE, Verdict
from ..termtext import inert
from ..warning_types import GpuIsoLeakWarning, GpuIsoStartWarning, inert_warning
from ..wire.payloads import BUILTIN_WARNINGS, WarningData
from . import standins

# How a project whose warnings are errors keeps leaks warnings (the last filter wins).
KEEP_WARNING = (
    "to keep leaks warnings, add default::pytest_gpuiso.GpuIsoLeakWarning to filterwarnings "
    "after error (or -W default::pytest_gpuiso.GpuIsoLeakWarning)"
)


def warn_leaks(item: pytest.Item, verdict: Verdict) -> Verdict:
    """``warn`` leaks reach pytest's warnings summary, like any warning of the test,
    through the test's warning filters: ``ignore`` drops one; one that ``error`` turns
    into an exception fails the test's teardown, as the ``fail`` level does."""
    lineno = _line(item)
    warned: list = []
    errors: list = []
    for leak in verdict.warning:
        advice = ADVICE.get(leak.kind)
        text = f"{leak.kind}: {inert(leak.detail)}" + (f" ({advice})" if advice else "")
        warning = GpuIsoLeakWarning(text)
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
        policy_text=f"{verdict.policy_text}; GpuIsoLeakWarning is an error by -W/filterwarnings:"
        f" {KEEP_WARNING}",
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
        message, category = decode_warning(data)
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


def decode_warning(data: WarningData) -> tuple[Warning, type[Warning]]:
    """The warning of a ``frames.WARNING`` frame and its category, importing nothing: the
    frame names the category's module, which is the test's to choose (importing it here
    would run the test's code in pytest, or load torch and its CUDA driver). The category
    itself where pytest's process has its module already, else its ``stand_in``;
    ``UserWarning`` for the message when the category will not take it."""
    category = _imported(data["category_module"], data["category_name"])
    if category is None:
        base = BUILTIN_WARNINGS.get(data["category_base"], UserWarning)
        category = stand_in(data["category_module"], data["category_name"], base)
    try:
        message: Warning = category(data["message"])
    except Exception:
        message = UserWarning(data["message"])
    return message, category


# A module's and a class's own namespace, read past any __getattribute__ of theirs
_MODULE_NAMESPACE = vars(types.ModuleType)["__dict__"]
_CLASS_NAMESPACE = vars(type)["__dict__"]


def _imported(module: str, qualname: str) -> type[Warning] | None:
    """The category ``module.qualname`` when its module is in ``sys.modules``, looked up
    in the module's and classes' namespaces so that no code runs: no import, no module
    ``__getattr__`` (a lazy module's imports), no descriptor."""
    found: Any = sys.modules.get(module)
    if not issubclass(type(found), types.ModuleType):
        return None
    namespace = _MODULE_NAMESPACE.__get__(found) or {}
    for part in qualname.split("."):
        found = namespace.get(part)
        if not issubclass(type(found), type):
            return None
        namespace = _CLASS_NAMESPACE.__get__(found)
    return found if issubclass(found, Warning) else None


# One class per category in this process, as its module would give (the same category
# of two tests is one); bounded, as a test's process may name any number of them.
@functools.lru_cache(maxsize=1024)
def stand_in(module: str, qualname: str, base: type[Warning]) -> type[Warning]:
    """A subclass of ``base`` (the category's nearest builtin base) named as the category
    is (``__name__``, ``__qualname__``; ``category_module`` keeps its module's name), for
    a category whose module pytest's process has not imported: the warnings summary shows
    its name, and what looks for a builtin category (``DeprecationWarning``) finds it. Its
    ``__module__`` is ``standins``, which is what an xdist controller imports to rebuild
    it. ``base`` itself for a name no class can have."""
    name = qualname.rpartition(".")[2]
    if not name.isidentifier() or name.startswith("__"):  # a NUL, a lone surrogate, a dunder
        return base
    names = {"__module__": standins.__name__, "__qualname__": qualname, "category_module": module}
    return type(name, (base,), names)


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


def warn_for_test(warning: Warning, filename: str, lineno: int) -> bool:
    """Issue a warning of the running test; False when a filter made it an error."""
    return issue_for_test(warning, filename, lineno) != "error"


def issue_for_test(warning: Warning, filename: str, lineno: int) -> str:
    """Issue a warning of the running test through its filters: "shown" (pytest records
    it), "ignored" (a filter dropped it) or "error" (a filter made it an exception).

    Called inside pytest's ``pytest_runtest_protocol`` wrapper, which applies the
    item's filters (ini, ``-W``, its ``filterwarnings`` marks) and records what passes.
    The filters are applied here, in a catcher of our own that sees which it was; what
    passes them is handed on to pytest's catcher with ``warnings.showwarning``, which
    applies no filter again.
    """
    warning = inert_warning(warning)
    with warnings.catch_warnings(record=True) as passed:
        try:
            warnings.warn_explicit(warning, type(warning), filename, lineno)
        except type(warning):
            return "error"
    for shown in passed:
        warnings.showwarning(shown.message, shown.category, shown.filename, shown.lineno)
    return "shown" if passed else "ignored"
