"""Hooks through which other plugins carry their state across a test's process.

An isolated test runs in a process of its own; what a plugin builds there (the
lines coverage saw, a benchmark's timings, the snapshots a test used) ends with
that process unless it reaches pytest. These hooks carry it: the parent hands
options down (``pytest_gpuiso_child_options``), the test's process fills a dict
once its session is over (``pytest_gpuiso_child_payload``), and pytest receives
it before the test's reports are logged (``pytest_gpuiso_parent_payload``).
``pytest_gpuiso_rerun`` asks whether a finished attempt runs again, in a fresh
process. Registered by ``plugin.pytest_addhooks`` on both sides; docs/plugins.md's
"For plugin authors" section describes the order of events.
"""

from __future__ import annotations

from typing import Any

import pytest


@pytest.hookspec
def pytest_gpuiso_child_options(config: Any) -> dict[str, Any] | None:
    """Parent, once a session: ``config.option`` values the tests' processes use instead
    of what they would parse themselves (a seed resolved at configure, say).

    Return a dict of picklable values keyed by option dest; dicts of several plugins are
    merged in call order. Applied in the test's process before its ``pytest_configure``
    (in the fork server's template: before the template configures).
    """


@pytest.hookspec
def pytest_gpuiso_child_payload(item: Any, payload: dict[str, Any]) -> None:
    """Test's process, once its session finished: put plain data (str, int, float, bool,
    None, bytes, and lists, tuples and dicts of them) under your own key; another value
    arrives as its repr, with a warning of the test.

    Called once per test's process, after ``pytest_sessionfinish`` of every other plugin
    (like xdist's ``workeroutput``); not called when the process crashed, was stopped by
    a timeout or never ran its test. An exception here becomes a warning of the test.
    """


@pytest.hookspec
def pytest_gpuiso_parent_payload(item: Any, payload: dict[str, Any], reports: list) -> None:
    """Parent: the dict the test's process filled, before the test's reports are logged
    (an implementation may change them). Not called when the process sent none."""


@pytest.hookspec(firstresult=True)
def pytest_gpuiso_rerun(
    item: Any, attempt: int, reports: list, payload: dict[str, Any], complete: bool
) -> bool | None:
    """Parent, after each attempt of an isolated test: True runs it again in a fresh process.

    ``attempt`` counts from 1; ``reports`` are the attempt's (not logged yet); ``payload``
    is what its process sent (empty when none); ``complete`` is False when the process
    crashed, timed out or did not finish its reports. The first non-None answer counts.
    """
