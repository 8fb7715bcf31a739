"""pytest's hooks, and only them: options, configure, header, dispatch, records, fixture.

Each hook hands its work to the module that does it: ``options`` declares the
options, ``settings`` parses them, ``runner`` runs one isolated test (parent
side), ``record`` makes the JSON record, ``recorder`` collects the records and has
``report`` and ``findings`` write them out.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest

from . import header
from .gpu import pinning, workers
from .gpu.devices import discover
from .gpu.leases import Leases
from .options import add_options
from .parent import runner
from .parent.call import call_isolated
from .parent.session import (
    CONTROLLER,
    STATE,
    Controller,
    State,
    close,
    isolated,
    settle,
    start_server,
)
from .proc import dead_sessions, workdir
from .recorder import Recorder
from .reports import baseline, files
from .reports.baseline import Baseline
from .reports.shards import ReportError
from .settings import MARKER_DOC, read_settings
from .values import DEFAULT_GRACE, SpecError
from .warning_types import GpuIsoLeakWarning, GpuIsoStartWarning, warn_session
from .wire.plugin_names import CHILD_PLUGIN

__all__ = ["GpuIsoLeakWarning", "GpuIsoStartWarning"]


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from . import adapters, hookspecs

    pluginmanager.add_hookspecs(hookspecs)
    adapters.register(pluginmanager)


def _is_child(config: pytest.Config) -> bool:
    return config.pluginmanager.has_plugin(CHILD_PLUGIN)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER_DOC)
    if _is_child(config):
        return
    settings = read_settings(config)
    debugger = _debugger(config)
    if debugger and settings.mode != "off":
        _warn_start(config, f"{debugger}: every test runs in-process, so the debugger reaches it")
        settings = dataclasses.replace(settings, mode="off")
    controller = None
    if not hasattr(config, "workerinput"):  # under xdist, the controller writes the reports
        controller = Controller(
            report_path=_output_path(config, settings.report_path, settings.report_source),
            summary_path=_output_path(config, settings.summary_path, settings.summary_source),
            code_quality_path=_output_path(
                config, settings.code_quality_path, settings.code_quality_source
            ),
        )
        config.stash[CONTROLLER] = controller
    state = State(
        settings=settings,
        baseline=_baseline(config, settings),
        parallel=hasattr(config, "workerinput"),
        cache=getattr(config, "cache", None),  # learnt imports, for the next session
    )
    if settings.mode != "off":
        if settings.mode == "all":  # every test needs it: a taken name is the session's error
            try:
                workdir.root()
            except workdir.WorkdirError as exc:
                raise pytest.UsageError(f"gpu-isolate: {exc}") from None
        ended = workdir.clean_stale()  # and what the tests of dead sessions left running
        if ended:
            _warn_start(config, dead_sessions.describe(ended))
        from ._lease import RegionError

        try:
            sizes = dict(settings.device_sizes)
            state.devices = discover(settings.devices, settings.devices_source, sizes, state.nvml)
            if state.devices.names:
                state.leases = Leases(state.devices, settings.slots)
        except (RegionError, SpecError) as exc:  # a bad device list, a table not ours
            raise pytest.UsageError(f"gpu-isolate: {exc}") from None
        problem = pinning.problem(config, settings, state.devices)
        if problem is not None:
            raise pytest.UsageError(f"gpu-isolate: {problem}")
        # before any test module is collected; the controller's, before it starts workers
        state.pins = pinning.pin(config, settings, state.leases)
        state.pin = pinning.own(config, state.pins, state.leases)
    config.stash[STATE] = state
    config.pluginmanager.register(Recorder(config, state, controller), "gpuiso-recorder")


def _warn_start(config: pytest.Config, text: str) -> None:
    """Say ``text`` once, as a warning of the session; a usage error where a filter makes
    ``GpuIsoStartWarning`` an error."""
    text = f"gpu-isolate: {text}"
    if not warn_session(config, GpuIsoStartWarning(text)):
        raise pytest.UsageError(f"{text} (GpuIsoStartWarning is an error by -W/filterwarnings)")


def _debugger(config: pytest.Config) -> str:
    """``--pdb`` or ``--trace`` when given: the debugger cannot reach into a test's process."""
    return "--trace" if config.option.trace else "--pdb" if config.option.usepdb else ""


def _output_path(config: pytest.Config, value: str | None, source: str) -> Path | None:
    """A report's path, checked now (not at the session's end) where it is written.

    Relative to the ini file's folder (the rootdir without one) when it comes from the
    ini file, to the invocation directory when from the command line, as --junitxml.
    """
    if value is None:
        return None
    try:
        files.check_output(value, source, str(_base(config, source)))
    except SpecError as exc:
        raise pytest.UsageError(f"gpu-isolate: {exc}") from None
    return _path_of(config, value, source)


def _base(config: pytest.Config, source: str) -> Path:
    """What a relative path is relative to: the invocation directory for the command
    line, the ini file's folder for the ini file (the rootdir without one)."""
    if source.startswith("ini "):
        return config.inipath.parent if config.inipath else config.rootpath
    return config.invocation_params.dir


def _path_of(config: pytest.Config, value: str, source: str) -> Path:
    """The path made absolute, links kept: /dev/stdout must not become
    /proc/<pid>/fd/pipe:[...]."""
    return Path(os.path.abspath(os.path.join(_base(config, source), value)))


def _baseline(config: pytest.Config, settings: Any) -> Baseline | None:
    """The leak baseline, read now: a file that cannot serve is the session's usage error."""
    if settings.leak_baseline is None:
        return None
    path = _path_of(config, settings.leak_baseline, settings.leak_baseline_source)
    try:
        return baseline.load(str(path))
    except ReportError as exc:
        raise pytest.UsageError(f"gpu-isolate: {settings.leak_baseline_source}: {exc}") from None


def pytest_unconfigure(config: pytest.Config) -> None:
    state = config.stash.get(STATE, None)
    if state is not None:
        close(state)
        workdir.remove_process_dir()


def pytest_report_header(config: pytest.Config) -> list[str]:
    state = config.stash.get(STATE, None)
    if state is None:
        return []
    return header.lines(config, state, _debugger(config))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist's controller, before starting a worker: hand it its pinned GPUs."""
    state = node.config.stash.get(STATE, None)
    controller = node.config.stash.get(CONTROLLER, None)
    if state is not None and controller is not None and state.pins:
        given = pinning.assign(state.pins, controller.pinned_to, node.gateway.id)
        if given is not None:
            node.workerinput[pinning.WORKERINPUT] = given


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """A worker ended (or crashed): a worker started in its place gets its GPUs."""
    controller = node.config.stash.get(CONTROLLER, None)
    if controller is not None:
        controller.pinned_to.pop(node.gateway.id, None)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto`` under --gpu-isolate with GPUs: one worker per GPU slot (``workers``)."""
    return workers.auto_workers(config, dict(os.environ))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    if not isolated(item):
        settle(item.config)
        return None
    ihook = item.ihook
    attempt = 1
    while True:  # each attempt in a fresh process, while pytest_gpuiso_rerun says so
        ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        ran = runner.run_item(item, nextitem)
        again = None
        if ran.stop is None:
            again = item.config.hook.pytest_gpuiso_rerun(
                item=item,
                attempt=attempt,
                reports=ran.reports,
                payload=ran.payload,
                complete=ran.complete,
            )
        if again is not None:  # a plugin counts this test's attempts (pytest-rerunfailures)
            for rep in ran.reports:
                rep.rerun = attempt - 1  # type: ignore[attr-defined] - as rerunfailures sets it
        if not again:
            break
        runner.mark_rerun(item, ran, attempt)
        for rep in ran.reports:
            ihook.pytest_runtest_logreport(report=rep)
        ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        attempt += 1
    runner.finish_item(item, nextitem, ran, attempt)
    for rep in ran.reports:
        ihook.pytest_runtest_logreport(report=rep)
    if ran.stop is not None:  # pytest.exit() or Ctrl-C in the test: end the session here too
        runner.stop_session(ran.stop)
    ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def _runs_tests(config: pytest.Config) -> bool:
    """False in an xdist controller, which runs no test itself."""
    dist = getattr(config.option, "dist", "no")
    return hasattr(config, "workerinput") or dist == "no" or not dist


def _wants_server(config: pytest.Config, state: State | None) -> bool:
    if state is None or state.settings.mode == "off" or state.settings.start != "forkserver":
        return False
    return _runs_tests(config) and not config.option.collectonly


@pytest.hookimpl(tryfirst=True)
def pytest_collection(session: pytest.Session) -> None:
    """Start the fork server now, so that it imports torch while pytest collects.

    Only when every test is isolated; otherwise once collection found a marked test.
    """
    state = session.config.stash.get(STATE, None)
    if _wants_server(session.config, state) and state.settings.mode == "all":
        start_server(session.config, state)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Tell the fork server the isolated tests' modules: it loads their conftests, collects them."""
    state = session.config.stash.get(STATE, None)
    if not _wants_server(session.config, state):
        return
    modules = {str(item.path) for item in session.items if isolated(item)}
    if not modules:
        return
    started = start_server(session.config, state)
    if started is not None:
        directories = {str(Path(module).parent) for module in modules}
        precollect = sorted(modules) if state.settings.precollect else []
        started.serving.collect(sorted(directories), precollect)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Discard prewarmed processes and stop the fork server."""
    state = session.config.stash.get(STATE, None)
    if state is not None:
        close(state)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    """pytest-timeout must not also fire in the parent: the supervisor enforces the timeout."""
    return True if isolated(item) else None


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> bool | None:
    return True if isolated(item) else None


@pytest.fixture
def gpu_isolated_run(request: pytest.FixtureRequest):
    """``gpu_isolated_run(func, *args, timeout=None, gpus=0, **kwargs)``: call ``func`` in a
    fresh spawned process and return its value (see ``pytest_gpuiso.run_isolated``); GPUs
    come from the session's lease table."""
    state = request.config.stash.get(STATE, None)
    grace = state.settings.grace if state is not None else DEFAULT_GRACE
    leases = state.leases if state is not None else None

    def run(func, *args, timeout=None, gpus=0, **kwargs):
        return call_isolated(
            func, args, kwargs, timeout=timeout, gpus=gpus, grace=grace, leases=leases
        )

    return run
