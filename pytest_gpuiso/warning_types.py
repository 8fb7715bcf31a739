"""pytest-gpuiso's warning categories, and how the session's own warnings are issued
(a test's are replayed with the test, by ``parent.replay``).

They go through Python's ``warnings`` machinery with pytest's filters in force, so
``-W``, ini ``filterwarnings`` and ``@pytest.mark.filterwarnings`` treat them as any
pytest warning: ``ignore`` drops one, ``error`` turns it into an exception (which
the caller makes a failure of the test, or a usage error of the session). A session's
``GpuIsoStartWarning`` is an error only under a filter that names it: a project's blanket
``error`` is about its own code, not how the plugin runs it (``warn_session``).
"""

from __future__ import annotations

import sys
import warnings

import pytest

from . import _compat
from .termtext import inert


class GpuIsoLeakWarning(pytest.PytestWarning):
    """An isolated test left something behind (``--gpu-isolate-leaks=warn``)."""


class GpuIsoStartWarning(pytest.PytestWarning):
    """The fork server or prewarming could not be used, isolation is off for a debugger, or
    what a dead session's tests left running was ended."""


def inert_warning(warning: Warning) -> Warning:
    """The warning with its text inert (``termtext.inert``): it may quote what a test's
    process or a dead session chose (a command line, a /dev/shm name, a library's name)."""
    return type(warning)(inert(str(warning)))


def _named_error(warning: Warning, filename: str, line: int) -> bool:
    """Whether the filter that turned ``warning`` into an error names its category (or
    a subclass of it), where that category is one of the plugin's session warnings that
    a blanket filter leaves alone (``warn_session``)."""
    kind = type(warning)
    if not issubclass(kind, GpuIsoStartWarning):
        return True  # a leak warning: the test's, under every filter
    text = str(warning)
    module = filename[:-3] if filename.endswith(".py") else filename
    for action, message, category, where, lineno in warnings.filters:
        if (
            issubclass(kind, category)
            and (message is None or message.match(text))
            and (where is None or where.match(module))
            and lineno in (0, line)
        ):
            return action == "error" and issubclass(category, GpuIsoStartWarning)
    return False


def warn_session(
    config: pytest.Config, warning: Warning, *, notice: bool = False, stacklevel: int = 1
) -> bool:
    """Issue a warning of the session (no test's marks apply), at the line of ours that
    issues it (``stacklevel`` frames up from its caller); False when a filter made it an
    error. ``notice``: information (tests run in-process for a debugger), which a filter's
    ``error`` shows all the same: it ends nothing.

    A ``GpuIsoStartWarning`` says how the plugin runs the tests (a fork server given up,
    a dead session's leftovers ended), never what a test did: a project's blanket
    ``filterwarnings = error`` (or ``error::pytest.PytestWarning``) shows it and ends
    nothing; only a filter that names ``GpuIsoStartWarning`` (or a subclass) makes it an
    error."""
    warning = inert_warning(warning)
    caller = sys._getframe(stacklevel)
    where = (caller.f_code.co_filename, caller.f_lineno)
    with warnings.catch_warnings(record=True) as log:
        warnings.simplefilter("always", type(warning))
        _compat.apply_session_filters(config)
        try:
            warnings.warn_explicit(warning, type(warning), *where)
        except type(warning):
            if not notice and _named_error(warning, *where):
                return False
            log.append(warnings.WarningMessage(warning, type(warning), *where))
    for record in log:
        config.hook.pytest_warning_recorded.call_historic(
            kwargs=dict(warning_message=record, when="runtest", nodeid="", location=None)
        )
    return True
