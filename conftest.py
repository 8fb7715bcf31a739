"""The project's own tests (tests/): pytester, and the suite under pytest-xdist.

Without ``-n`` (or ``-p no:xdist``), the suite runs on two xdist workers a core: most of
its time is spent waiting on the pytest runs it starts (their processes, sleeps and
time-outs), not computing. ``--dist loadgroup`` keeps the tests that share one build of
the wheel (``xdist_group``) on one worker. It is set here rather than in tox.ini's addopts
so that a machine without pytest-xdist (a GPU machine running tests/gpu) still runs the
suite, serially, and ``-p no:xdist`` turns it off.
"""

from __future__ import annotations

import os

import pytest

pytest_plugins = ["pytester"]


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    if not config.pluginmanager.has_plugin("xdist") or hasattr(config, "workerinput"):
        return
    serial = config.option.usepdb or config.option.trace or config.option.collectonly
    if config.option.numprocesses is None and config.option.dist == "no" and not serial:
        config.option.numprocesses = 2 * len(os.sched_getaffinity(0))
        config.option.dist = "loadgroup"
