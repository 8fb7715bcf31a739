"""Other plugins' state across a test's process, through the ``pytest_gpuiso_*`` hooks.

One module per plugin, each with ``register(pluginmanager)``: it registers its hook
implementations when its plugin is installed (both in pytest and in the tests'
processes) and imports the plugin itself only when a hook needs it. Called from
``plugin.pytest_addhooks``, so that the implementations are there before the
command line is parsed (pytest-cov decides at ``pytest_load_initial_conftests``).

Also here: ``benchmark`` (pytest-benchmark's timings join pytest's), ``randomly``
(pytest-randomly's seed in every test's process), ``rerunfailures`` (each attempt in a
fresh process) and ``syrupy`` (the snapshots an isolated test used).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

ADAPTERS = ("randomly", "syrupy", "benchmark", "cov", "rerunfailures")


def register(pluginmanager: Any) -> None:
    for name in ADAPTERS:
        import_module(f"{__name__}.{name}").register(pluginmanager)


def plugin_version(distribution: str) -> str:
    """The installed version of a plugin's distribution, for the adapters' warnings."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "(version unknown)"
