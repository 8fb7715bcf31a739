"""The project's own tests (tests/): pytester, and how the suite runs.

A run of the suite (no path given, or paths under tests/) without ``-n`` or
``-p no:xdist`` runs on two xdist workers a core: most of its time is spent on the
start-ups of the pytest runs it starts, which the workers spread over the cores, and on
their sleeps and time-outs, which they overlap. ``--dist loadgroup`` keeps the tests that
share one build of the wheel (``xdist_group``) on one worker. Every such run prints its
30 slowest tests (``--durations``), so that growth is seen when it happens. This is set
here rather than in tox.ini's addopts so that a machine without pytest-xdist (a GPU
machine running tests/gpu) still runs the suite, serially, and so that a run of the demo
from this directory (the README's first command) runs as users run it.

Under ``PYTHONDONTWRITEBYTECODE`` (common in CI images), a checkout's modules are compiled
again by every process that imports them: the suite's runs start thousands (pytest runs,
fork servers, templates, spawned tests), each paying ~0.2 s to compile the plugin. So a
run of the suite compiles the plugin's bytecode once, into its ``__pycache__`` folders
(ignored by git), as Python itself does without that variable; a stale file is never
read (Python checks each against its source). tests/sessions/isolation: 193 s to 160 s.
"""

from __future__ import annotations

import compileall
import os
import sys
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

TESTS = Path(__file__).resolve().parent / "tests"
PACKAGE = TESTS.parent / "pytest_gpuiso"


def _runs_the_suite(config: pytest.Config) -> bool:
    here = config.invocation_params.dir
    paths = [(here / arg.split("::")[0]).resolve() for arg in config.args]
    return all(path == TESTS or TESTS in path.parents for path in paths)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or not _runs_the_suite(config):
        return
    if config.option.durations is None:
        config.option.durations = 30
    if sys.dont_write_bytecode:  # see the docstring; an installed wheel has its own
        compileall.compile_dir(PACKAGE, quiet=2)
    if not config.pluginmanager.has_plugin("xdist"):
        return
    serial = config.option.usepdb or config.option.trace or config.option.collectonly
    if config.option.numprocesses is None and config.option.dist == "no" and not serial:
        config.option.numprocesses = 2 * len(os.sched_getaffinity(0))
        config.option.dist = "loadgroup"
