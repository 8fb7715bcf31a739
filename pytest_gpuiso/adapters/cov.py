"""pytest-cov and isolated tests: their lines count in pytest's report, nothing left on disk.

pytest-cov's controller must not run in a test's process or in the fork server: a
test's process would erase every other process's data when it starts and leave a
``.coverage.<host>.<pid>`` file (or nothing, killed), and the server would measure its
own imports. So where pytest parses its configuration in such a process, the plugin is
parked: ``--no-cov`` is set before pytest-cov's own ``pytest_load_initial_conftests``
builds its plugin, which then stays disabled. The test's process instead measures its
test's protocol with a ``coverage.Coverage`` that has no data file, and sends the data
back (``pytest_gpuiso_child_payload``); pytest adds it to its controller's data once the
test loop is over, before pytest-cov saves, combines and reports (under xdist: the
worker's data, which the controller combines as ever). The disabled plugin gets a
stand-in controller, so that ``@pytest.mark.no_cover``, the ``cov`` fixture and
``--cov-context=test`` work in the test's process as in pytest.

pytest-cov's and coverage's private names used: ``pytest_cov.plugin._prepare_cov_source``,
``TestContextPlugin``, ``CovPlugin.cov_controller`` (checked on pytest-cov 7.1.0,
coverage 7.17.4). Without them, one ``GpuIsoStartWarning`` says isolated tests are not
measured, and the plugin stays parked in the tests' processes.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from ..warning_types import GpuIsoStartWarning, warn_session

COV_PLUGIN = "_cov"  # the name pytest-cov registers its CovPlugin under
PAYLOAD_KEY = "pytest-cov"
# Plugins present only in processes that run no session of the user's own: a test's
# process (child_plugin.CHILD_PLUGIN, the template's forks included) and the fork
# server (registered before it parses, forkserver.server).
HOSTS = ("gpuiso-child", "gpuiso-forkserver")


def missing_internals() -> list[str]:
    """What this adapter needs of pytest-cov and coverage and does not find."""
    try:
        import pytest_cov.plugin as cov_plugin
        from coverage import Coverage, CoverageData
    except ImportError as exc:
        return [str(exc)]
    wanted = {
        "pytest_cov.plugin._prepare_cov_source": hasattr(cov_plugin, "_prepare_cov_source"),
        "pytest_cov.plugin.TestContextPlugin": hasattr(cov_plugin, "TestContextPlugin"),
        "coverage.Coverage.switch_context": hasattr(Coverage, "switch_context"),
        "coverage.CoverageData.dumps/loads/update": all(
            hasattr(CoverageData, name) for name in ("dumps", "loads", "update")
        ),
    }
    return [name for name, found in wanted.items() if not found]


class StandIn:
    """What pytest-cov's disabled plugin and its fixtures use of a controller, in a
    test's process: ``cov`` (the ``cov`` fixture), ``started``, ``pause``/``resume``
    (the ``no_cover`` marker and fixture)."""

    def __init__(self, cov: Any) -> None:
        self.cov = cov  # None: not measured
        self.started = cov is not None

    def pause(self) -> None:
        if self.cov is not None:
            self.started = False
            self.cov.stop()

    def resume(self) -> None:
        if self.cov is not None:
            self.cov.start()
            self.started = True


class CovAdapter:
    """Parks pytest-cov where it must not run, measures the test in its process and
    hands the data to pytest's controller."""

    def __init__(self) -> None:
        self.measure = False  # parked here, and the session asked for coverage
        self.cov: Any = None  # the test's Coverage, in a test's process
        self.received: Any = None  # pytest: the tests' data, a CoverageData without disk
        self.missing: list[str] | None = None  # missing_internals(), once asked

    def _missing(self) -> list[str]:
        if self.missing is None:
            self.missing = missing_internals()
        return self.missing

    # ------------------------------------------------------------ a test's process, the server

    @pytest.hookimpl(wrapper=True)
    def pytest_load_initial_conftests(self, early_config: Any) -> Any:
        manager = early_config.pluginmanager
        ns = early_config.known_args_namespace
        if any(manager.has_plugin(name) for name in HOSTS) and getattr(ns, "cov_source", None):
            self.measure = not ns.no_cov
            ns.no_cov = True  # pytest-cov's tryfirst implementation, inside us, reads it
            _stop_auto_started()
        return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: Any) -> Any:
        manager = item.config.pluginmanager
        if not self.measure or not manager.has_plugin(HOSTS[0]):
            return (yield)
        plugin = manager.get_plugin(COV_PLUGIN)
        if self._missing():  # not measured (pytest warned); no_cover still finds a controller
            if plugin is not None:
                plugin.cov_controller = StandIn(None)
            return (yield)
        import coverage
        from pytest_cov.plugin import TestContextPlugin, _prepare_cov_source

        option = item.config.option
        cov = coverage.Coverage(
            source=_prepare_cov_source(option.cov_source),
            branch=option.cov_branch,
            config_file=option.cov_config,
            data_file=None,  # nothing on disk: the data goes to pytest
        )
        # The test's modules were imported before, and other files stay unmeasured:
        # as pytest-cov's workers, say nothing about either.
        cov._warn_no_data = False
        cov._warn_unimported_source = False
        cov._warn_preimported_source = False
        self.cov = cov
        stand_in = StandIn(cov)
        if plugin is not None:
            plugin.cov_controller = stand_in
        if option.cov_context == "test":
            manager.register(TestContextPlugin(stand_in), "_cov_contexts")
        cov.start()
        try:
            return (yield)
        finally:
            if stand_in.started:
                cov.stop()
                stand_in.started = False

    def pytest_gpuiso_child_payload(self, item: Any, payload: dict[str, Any]) -> None:
        if self.cov is not None:
            payload[PAYLOAD_KEY] = self.cov.get_data().dumps()

    # ------------------------------------------------------------ pytest

    @pytest.hookimpl(trylast=True)
    def pytest_configure(self, config: Any) -> None:
        plugin = config.pluginmanager.get_plugin(COV_PLUGIN)
        if self.measure or plugin is None or getattr(config.option, "no_cov", True):
            return
        if any(config.pluginmanager.has_plugin(name) for name in HOSTS):
            return
        _start_resource_tracker_unmeasured()
        missing = self._missing()
        if missing:
            warn_session(
                config,
                GpuIsoStartWarning(
                    f"pytest-cov {_version('pytest-cov')} with coverage {_version('coverage')}: "
                    f"{', '.join(missing)} not found; the lines isolated tests run are not "
                    "measured"
                ),
            )

    def pytest_gpuiso_parent_payload(
        self, item: Any, payload: dict[str, Any], reports: list
    ) -> None:
        blob = payload.get(PAYLOAD_KEY)
        if not blob:
            return
        from coverage import CoverageData

        data = CoverageData(no_disk=True)
        data.loads(blob)
        if self.received is None:
            self.received = CoverageData(no_disk=True)
        self.received.update(data)

    @pytest.hookimpl(wrapper=True, trylast=True)  # inside pytest-cov's: before it saves
    def pytest_runtestloop(self, session: Any) -> Any:
        result = yield
        received, self.received = self.received, None
        plugin = session.config.pluginmanager.get_plugin(COV_PLUGIN)
        controller = getattr(plugin, "cov_controller", None)
        if received is not None and getattr(controller, "cov", None) is not None:
            controller.cov.get_data().update(received)
        return result


def _stop_auto_started() -> None:
    """Coverage's ``patch = subprocess`` starts a Coverage when a spawned interpreter
    starts (this process, inheriting pytest's environment): stop it, and never save it."""
    control = sys.modules.get("coverage.control")
    auto = getattr(getattr(control, "process_startup", None), "coverage", None)
    if auto is not None:
        auto._auto_save = False
        auto.stop()


def _start_resource_tracker_unmeasured() -> None:
    """Start multiprocessing's resource tracker (spawning a test's process would) without
    coverage's ``patch = subprocess`` variables: it would measure itself, and save an empty
    ``.coverage.<host>.<pid>`` file when it exits, after pytest-cov combined the data."""
    import os

    names = [name for name in _AUTO_START_VARIABLES if name in os.environ]
    if not names:
        return
    from multiprocessing import resource_tracker

    saved = {name: os.environ.pop(name) for name in names}
    try:
        resource_tracker.ensure_running()
    finally:
        os.environ.update(saved)


_AUTO_START_VARIABLES = ("COVERAGE_PROCESS_START", "COVERAGE_PROCESS_CONFIG")


def _version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "(version unknown)"


def register(pluginmanager: Any) -> None:
    pluginmanager.register(CovAdapter(), "gpuiso-adapter-cov")
