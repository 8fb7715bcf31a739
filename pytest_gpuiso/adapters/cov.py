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
``CovPlugin.cov_controller`` and ``.pid``, ``pytest_cov.embed._active_cov`` (before 7),
``Coverage._warn_*`` and ``._auto_save`` (checked on pytest-cov 2.12.1 to 7.1.0, coverage
5.2.1 to 7.17.4). Without what ``missing_internals`` looks for, one ``GpuIsoStartWarning``
says isolated tests are not measured, and the plugin stays parked in the tests' processes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from typing import Any

import pytest

from .. import _compat
from ..warning_types import GpuIsoStartWarning, warn_session
from ..wire.plugin_names import CHILD_PLUGIN, SERVER_PLUGIN
from . import plugin_version

COV_PLUGIN = "_cov"  # the name pytest-cov registers its CovPlugin under
PAYLOAD_KEY = "pytest-cov"
# Plugins present only in processes that run no session of the user's own: a test's
# process (the template's forks included) and the fork server (registered before it parses).
HOSTS = (CHILD_PLUGIN, SERVER_PLUGIN)


def missing_internals() -> list[str]:
    """What this adapter needs of pytest-cov and coverage and does not find."""
    try:
        import pytest_cov.plugin as cov_plugin
        from coverage import Coverage, CoverageData
    except ImportError as exc:
        return [str(exc)]
    wanted = {
        "pytest_cov.plugin._prepare_cov_source": hasattr(cov_plugin, "_prepare_cov_source"),
        "pytest_cov.plugin.CovPlugin": hasattr(cov_plugin, "CovPlugin"),
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


class TestContexts:
    """``--cov-context=test`` in a test's process: the contexts pytest-cov's own
    ``TestContextPlugin`` names (``<nodeid>|setup``, ``|run``, ``|teardown``)."""

    def __init__(self, controller: StandIn) -> None:
        self.controller = controller

    def pytest_runtest_setup(self, item: Any) -> None:
        self._switch(item, "setup")

    def pytest_runtest_call(self, item: Any) -> None:
        self._switch(item, "run")

    def pytest_runtest_teardown(self, item: Any) -> None:
        self._switch(item, "teardown")

    def _switch(self, item: Any, when: str) -> None:
        if self.controller.started:
            self.controller.cov.switch_context(f"{item.nodeid}|{when}")


class CovAdapter:
    """Parks pytest-cov where it must not run, measures the test in its process and
    hands the data to pytest's controller."""

    def __init__(self) -> None:
        self.measure = False  # parked here, and the session asked for coverage
        self.cov: Any = None  # the test's Coverage, in a test's process
        self.received: Any = None  # pytest: the tests' data so far, a CoverageData
        self.scratch: str | None = None  # pytest: the private directory it is kept in
        self.merge_failed = False  # pytest: a test's data could not be added (warned once)
        self.missing: list[str] | None = None  # missing_internals(), once asked

    def _missing(self) -> list[str]:
        if self.missing is None:
            self.missing = missing_internals()
        return self.missing

    # ------------------------------------------------------------ a test's process, the server

    @pytest.hookimpl(wrapper=True)
    def pytest_load_initial_conftests(self, early_config: Any) -> Any:
        manager = early_config.pluginmanager
        ns = _compat.known_args(early_config)
        if any(manager.has_plugin(name) for name in HOSTS) and getattr(ns, "cov_source", None):
            self.measure = not ns.no_cov
            ns.no_cov = True  # pytest-cov's tryfirst implementation, inside us, reads it
            _stop_auto_started()
        return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: Any) -> Any:
        manager = item.config.pluginmanager
        if not self.measure or not manager.has_plugin(CHILD_PLUGIN):
            return (yield)
        plugin = manager.get_plugin(COV_PLUGIN)
        if plugin is not None:
            # pytest-cov < 7 starts coverage at each test's setup in a process other than
            # its session's (``self.pid``, None when parked), and saves it at teardown.
            plugin.pid = os.getpid()
        if self._missing():  # not measured (pytest warned); no_cover still finds a controller
            if plugin is not None:
                plugin.cov_controller = StandIn(None)
            return (yield)
        import coverage
        from pytest_cov.plugin import _prepare_cov_source

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
        if getattr(option, "cov_context", None) == "test":
            manager.register(TestContexts(stand_in), "_cov_contexts")
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
                    f"pytest-cov {plugin_version('pytest-cov')} with coverage "
                    f"{plugin_version('coverage')}: "
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

        if self.received is None:
            # On disk, in a directory of ours: a diskless CoverageData updated twice fails
            # on coverage 7.10 (the other database stays attached to its connection).
            self.scratch = tempfile.mkdtemp(prefix="gpuiso-cov-")
            self.received = CoverageData(basename=os.path.join(self.scratch, "received"))
        try:
            data = CoverageData(no_disk=True)
            data.loads(blob)
            self.received.update(data)
        except Exception as exc:  # noqa: BLE001 - coverage's DataError and whatever else
            self._not_counted(item.config, f"the lines {item.nodeid} ran", exc)

    def _not_counted(self, config: Any, what: str, exc: Exception) -> None:
        """Warn once a session: the first failure says why, the others would repeat it."""
        if not self.merge_failed:
            self.merge_failed = True
            text = f"pytest-cov: {what} are not counted (nor others that fail so): {exc}"
            warn_session(config, GpuIsoStartWarning(text))

    @pytest.hookimpl(wrapper=True, trylast=True)  # inside pytest-cov's: before it saves
    def pytest_runtestloop(self, session: Any) -> Any:
        try:
            result = yield
            received = self.received
            plugin = session.config.pluginmanager.get_plugin(COV_PLUGIN)
            controller = getattr(plugin, "cov_controller", None)
            if received is not None and getattr(controller, "cov", None) is not None:
                try:
                    controller.cov.get_data().update(received)
                except Exception as exc:  # noqa: BLE001 - as for one test's data
                    self._not_counted(session.config, "the lines isolated tests ran", exc)
        finally:
            self.received = None
            if self.scratch is not None:
                shutil.rmtree(self.scratch, ignore_errors=True)
                self.scratch = None
        return result


def _stop_auto_started() -> None:
    """Coverage's ``patch = subprocess`` (pytest-cov before 7: its ``.pth`` file) starts a
    Coverage when a spawned interpreter starts (this process, inheriting pytest's
    environment): stop it, and never save it."""
    control = sys.modules.get("coverage.control")
    embed = sys.modules.get("pytest_cov.embed")
    # The last started first: coverage stops only its current collector. pytest-cov's
    # .pth file (pytest-cov.pth) runs after coverage's (a1_coverage.pth).
    for auto in (
        getattr(embed, "_active_cov", None),
        getattr(getattr(control, "process_startup", None), "coverage", None),
    ):
        if auto is not None:
            auto._auto_save = False
            with contextlib.suppress(Exception):  # measured along with ours, then
                auto.stop()
    if embed is not None:  # its cleanup() at each test's teardown would save it
        embed._active_cov = None


def _start_resource_tracker_unmeasured() -> None:
    """Start multiprocessing's resource tracker (spawning a test's process would) without
    the variables that start coverage in a new interpreter: it would measure itself, and
    save an empty ``.coverage.<host>.<pid>`` file when it exits, after pytest-cov combined
    the data."""
    from multiprocessing import resource_tracker

    # Even without them now: pytest-cov < 7 sets its variables at session start
    # (under xdist, in the worker), after which the tracker would start with them.
    names = [name for name in os.environ if name.startswith(_AUTO_START_VARIABLES)]

    saved = {name: os.environ.pop(name) for name in names}
    try:
        resource_tracker.ensure_running()
    finally:
        os.environ.update(saved)


# coverage's patch = subprocess; pytest-cov's COV_CORE_SOURCE, _CONFIG, _DATAFILE (< 7)
_AUTO_START_VARIABLES = ("COVERAGE_PROCESS_START", "COVERAGE_PROCESS_CONFIG", "COV_CORE_")


def register(pluginmanager: Any) -> None:
    pluginmanager.register(CovAdapter(), "gpuiso-adapter-cov")
