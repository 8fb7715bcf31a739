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

from . import _import_plainly

_import_plainly()  # loaded once pytest marked us (in a process that imported the package
# before): what this module imports loads plainly (the package's docstring says why)

from . import _compat, native
from .options import add_options
from .parent import early
from .parent.session import STATE, State, close, isolated, settle, warn_start
from .recorder import Recorder
from .reports.controller import CONTROLLER, load_baseline, make_controller
from .settings import MARKER, MARKER_DOC, read_settings
from .values import DEFAULT_GRACE
from .warning_types import GpuIsoLeakWarning, GpuIsoStartWarning
from .wire.plugin_names import CHILD_PLUGIN

# What runs isolated tests (the runner, the launcher, the fork server, the lease
# table) is imported when isolating is first needed, behind ``parent.worker``: a
# session that isolates nothing pays for the options and the configuration only.

__all__ = ["GpuIsoLeakWarning", "GpuIsoStartWarning"]


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from . import adapters, hookspecs

    pluginmanager.add_hookspecs(hookspecs)
    adapters.register(pluginmanager)


def _is_child(config: pytest.Config) -> bool:
    return config.pluginmanager.has_plugin(CHILD_PLUGIN)


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    """Start the fork server's interpreter before the conftests load where it will serve
    every test (``parent.early``)."""
    early.start(early_config)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER_DOC)
    if _is_child(config):
        return
    settings = read_settings(config)
    debugger = _debugger(config)
    said = bool(debugger) and settings.mode == "all"  # marked tests: once one is collected
    if said:
        warn_start(config, f"{debugger}: {_IN_PROCESS}", notice=True)
    unavailable = native.missing()  # not Linux, or built without the C extensions
    if debugger or unavailable:
        settings = dataclasses.replace(settings, mode="off")
    controller = None
    if not hasattr(config, "workerinput"):  # under xdist, the controller writes the reports
        controller = config.stash[CONTROLLER] = make_controller(config, settings)
    state = State(
        settings=settings,
        baseline=load_baseline(config, settings),
        parallel=hasattr(config, "workerinput"),
        cache=getattr(config, "cache", None),  # learnt imports, for the next session
        debugger=debugger,
        debugger_said=said,
        unavailable=unavailable or "",
    )
    config.stash[STATE] = state
    if settings.mode == "all" or settings.pin_workers:  # wanted before collection
        from .parent.worker import prepare

        prepare(config, state)
    config.pluginmanager.register(Recorder(config, state, controller), "gpuiso-recorder")


_IN_PROCESS = "every test runs in-process, so the debugger reaches it"


def _debugger(config: pytest.Config) -> str:
    """``--pdb`` or ``--trace`` when given: the debugger cannot reach into a test's process."""
    return "--trace" if config.option.trace else "--pdb" if config.option.usepdb else ""


def pytest_unconfigure(config: pytest.Config) -> None:
    early.discard(config)
    state = config.stash.get(STATE, None)
    if state is not None:
        close(state)
        if state.prepared:
            from .proc import workdir

            workdir.remove_process_dir()


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Nothing unless every test is isolated or isolation was turned off by hand: where
    only marked tests are, ``pytest_report_collectionfinish`` says so once it saw one."""
    state = config.stash.get(STATE, None)
    if state is not None and state.unavailable:  # one line, wherever isolation was wanted
        return [f"gpu-isolate: off: {state.unavailable}"]
    if state is None or (state.settings.mode == "marked" and not state.settings.pin_workers):
        return []
    from . import header

    return header.lines(config, state, state.debugger)


def pytest_report_collectionfinish(config: pytest.Config, items: list[pytest.Item]) -> list[str]:
    """Where only marked tests are isolated: the header's lines, once one was collected."""
    state = config.stash.get(STATE, None)
    if state is None or state.settings.mode != "marked" or state.settings.pin_workers:
        return []
    if config.get_verbosity() < 0 or config.option.no_header:  # as pytest's header
        return []
    if not state.prepared:
        return []
    from . import header

    marked = sum(1 for item in items if isolated(item))
    return header.lines(config, state, state.debugger, marked)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist's controller, before starting a worker: hand it its pinned GPUs."""
    state = node.config.stash.get(STATE, None)
    controller = node.config.stash.get(CONTROLLER, None)
    if state is not None and controller is not None and state.gpus.pins:
        from .gpu import pinning

        given = pinning.assign(state.gpus.pins, controller.pinned_to, node.gateway.id)
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
    from .gpu import workers

    return workers.auto_workers(config, dict(os.environ))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    if not isolated(item):
        settle(item.config)
        return None
    from .parent import runner
    from .parent.worker import start_worker

    state = item.config.stash[STATE]
    runner.protocol(item, nextitem, start_worker(item.config, state))  # made once
    return True


def _runs_tests(config: pytest.Config) -> bool:
    """False in an xdist controller, which runs no test itself."""
    dist = getattr(config.option, "dist", "no")
    return hasattr(config, "workerinput") or dist == "no" or not dist


def _wants_server(config: pytest.Config, state: State | None) -> bool:
    if state is None or state.settings.mode == "off" or state.settings.start != "forkserver":
        return False
    return _runs_tests(config) and not config.option.collectonly


@pytest.hookimpl(tryfirst=True)  # before the terminal's header
def pytest_sessionstart(session: pytest.Session) -> None:
    """Start the fork server now when every test is isolated: it imports pytest (and
    torch) while this process says its header and collects. Not sooner: every plugin's
    ``pytest_configure`` ran (pytest-cov's adapter starts the resource tracker unmeasured)."""
    state = session.config.stash.get(STATE, None)
    if _wants_server(session.config, state) and state.settings.mode == "all":
        from .parent.worker import start_server

        start_server(session.config, state)
    early.discard(session.config)  # the server did not take it: not needed after all


@pytest.hookimpl(tryfirst=True)  # before the terminal asks for its lines
def pytest_collection_finish(session: pytest.Session) -> None:
    """Tell the fork server the isolated tests' modules: it loads their conftests, collects them."""
    state = session.config.stash.get(STATE, None)
    if state is None:
        return
    if state.debugger and state.settings.mode == "off":
        if not state.debugger_said and any(
            item.get_closest_marker(MARKER) for item in session.items
        ):
            warn_start(session.config, f"{state.debugger}: {_IN_PROCESS}", notice=True)
        return
    modules = {str(item.path) for item in session.items if isolated(item)}
    if not modules:
        return
    from .parent.worker import prepare, start_server

    prepare(session.config, state)
    if not _wants_server(session.config, state):
        return
    worker = start_server(session.config, state)
    if worker is not None:
        directories = {str(Path(module).parent) for module in modules}
        precollect = sorted(modules) if state.settings.precollect else []
        worker.precollect(sorted(directories), precollect, _compat.initial_paths(session))


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
    from .parent.call import call_isolated

    state = request.config.stash.get(STATE, None)
    if state is not None:
        from .parent.worker import prepare

        prepare(request.config, state)
    grace = state.settings.grace if state is not None else DEFAULT_GRACE
    leases = state.gpus.leases if state is not None else None
    health = state.settings.health if state is not None else "after-failure"

    def run(func, *args, timeout=None, gpus=0, **kwargs):
        __tracebackhide__ = True
        return call_isolated(
            func,
            args,
            kwargs,
            timeout=timeout,
            gpus=gpus,
            grace=grace,
            leases=leases,
            health=health,
        )

    return run
