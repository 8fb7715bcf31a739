"""pytest-randomly and isolated tests: every test's process uses pytest's seed.

Without ``--randomly-seed`` (or with ``last``), pytest-randomly's ``pytest_configure``
makes a seed in each process that configures, writes it to the cache and reseeds
``random`` from it before each phase of a test: an isolated test would see another
seed than the header printed, and its process would overwrite the cache's. The seed
pytest resolved (an int once it configured; under xdist the worker's, which the
controller resolved) goes down as ``config.option.randomly_seed``: the test's
process, and the fork server's template, then take pytest-randomly's explicit-seed
path, so its reseeding (session start, each phase) gives what it gives in pytest.
Parent side only: nothing comes back.
"""

from __future__ import annotations

from typing import Any

from ..warning_types import GpuIsoStartWarning, warn_session
from . import plugin_version

PLUGIN = "randomly"  # pytest-randomly's entry point name


class RandomlyAdapter:
    """``pytest_gpuiso_child_options``: the session's resolved seed."""

    def pytest_gpuiso_child_options(self, config: Any) -> dict[str, Any] | None:
        if not config.pluginmanager.has_plugin(PLUGIN):
            return None
        seed = getattr(config.option, "randomly_seed", None)
        if isinstance(seed, int) and not isinstance(seed, bool):
            return {"randomly_seed": seed}
        warn_session(
            config,
            GpuIsoStartWarning(
                f"pytest-randomly {plugin_version('pytest-randomly')}: no resolved seed "
                f"after configure (randomly_seed={seed!r}); isolated tests use seeds of "
                "their own, not the one reported"
            ),
        )
        return None


def register(pluginmanager: Any) -> None:
    pluginmanager.register(RandomlyAdapter(), "gpuiso-adapter-randomly")
