"""The pytest side of a test's process: the plugin that runs exactly one item.

``ChildPlugin`` waits for the go in ``pytest_collection``, collects the target
test's module, keeps only its item, runs it through ``pytest_runtest_protocol``
and sends every report, warning and junit record to pytest as frames. It says
what it is doing while the process starts (``PHASE``), and when the test's
protocol begins and ends (``BEGIN``, ``END``): the test's timeout counts from one
to the other, the start-up bound before and after (``supervisor``). The fork
server's template subclasses it (``forkserver.template``).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any, Protocol

import pytest

from .. import _compat
from ..leaks import torch as torch_check
from ..wire import frames, wire
from ..wire.environment import LEASED_ENV
from ..wire.payloads import encode_warning
from ..wire.plugin_names import CHILD_PLUGIN
from . import cuda_state, imports, memory_cap
from .overrides import override_again


def freeze() -> None:
    """Leave what exists now out of garbage collection, once its garbage is collected.

    Cyclic garbage that is frozen stays forever (a class attrs replaced at import would
    still be among its base's ``__subclasses__()``), so it goes first; after ``import
    torch`` that full collection costs ~60 ms, paid once where the fork server freezes."""
    gc.collect()
    gc.freeze()


class ChildChannel(Protocol):
    """The test's end of its pipes to pytest, as the plugin uses it (``bootstrap.Channel``,
    which imports this module, is the one there is)."""

    collect_ahead: bool  # the test's module is imported before the go

    def send(self, kind: str, payload: Any) -> None: ...

    def wait_go(self) -> None: ...

    def collecting_ahead(self, module: str) -> None: ...

    def cuda_touched(self) -> str | None: ...


def restart_capture(config: Any) -> None:
    """Give this process pytest's global capture as its own, in the state pytest leaves
    it after ``pytest_load_initial_conftests`` (suspended until a test runs).

    The capture this process inherited is kept when it can be (``adopt_global_capture``):
    its streams are what conftests and test modules took while they were imported (a
    logger around ``sys.stdout``), and they stay ``sys.stdout`` at test time, as in
    pytest's own process. Otherwise it starts anew.
    """
    if _compat.adopt_global_capture(config):
        return
    capman = config.pluginmanager.get_plugin("capturemanager")
    if capman is not None:
        capman.stop_global_capturing()
        capman.start_global_capturing()
        capman.suspend_global_capture()


@contextlib.contextmanager
def named_capture_files(prefix: str) -> Iterator[None]:
    """Give the fd-capture files pytest makes meanwhile (the session's global capture)
    names in our private directory.

    pytest captures into anonymous temporary files; when the test crashes they vanish
    with the process, and with them whatever the test printed just before. Named files
    (0600, removed by the parent after the test) survive the crash. Only the global
    capture's: those of ``capfd`` and of each subtest stay anonymous (a file made and
    kept per subtest cost ~0.35 ms each, and the parent read every one).
    """
    counter = itertools.count(1)

    def named_temporary_file(buffering: int = -1, **_: Any) -> Any:
        fd = os.open(f"{prefix}{next(counter)}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        return open(fd, "w+b", buffering=buffering)  # noqa: SIM115 - pytest owns and closes it

    _compat.set_capture_tempfile(named_temporary_file)
    try:
        yield
    finally:
        _compat.set_capture_tempfile(None)


def after_the_test(plugin: ChildPlugin, run: Any) -> int:
    """``run()`` (pytest's session in this process), its status; an exception raised once
    the test's protocol ended (a plugin's ``pytest_sessionfinish`` or ``pytest_unconfigure``
    failing: a warning a ``filterwarnings = error`` makes an error there) is not the
    test's: pytest's own process ends its session alike, and says so once."""
    try:
        return int(run())
    except Exception:
        if not plugin.ended:
            raise
        return int(pytest.ExitCode.OK)


class ChildPlugin:
    """Collects just the target item, runs it and forwards reports and warnings."""

    __name__ = CHILD_PLUGIN  # pluggy registers the plugin under this name

    def __init__(self, job: Any, channel: ChildChannel) -> None:
        # job: wire.jobs.ItemJob; channel: bootstrap.Channel (this module does not import it)
        self.job = job
        self.channel = channel
        self.collect_errors: list[str] = []
        self.config: Any = None
        self.ran: Any = None  # the item, once its protocol ran here
        self.ended = False  # its protocol ended: what fails after is the session's end

    @pytest.hookimpl(trylast=True)
    def pytest_configure(self, config: Any) -> None:
        self.config = config
        if self.job is not None:
            self._record_junit(config)
        # A conftest's pytest_cmdline_main may have set them again (xdist's -n for a run
        # of its suite, when not an xdist worker): this process runs one test, no workers.
        override_again(config.option)
        dsession = config.pluginmanager.get_plugin("dsession")  # xdist's, made for it
        if dsession is not None:
            config.pluginmanager.unregister(dsession)
        # The parent keeps the last-failed / new-first caches and the stepwise state.
        for name in ("lfplugin", "nfplugin", "stepwiseplugin"):
            found = config.pluginmanager.get_plugin(name)
            if found is not None:
                config.pluginmanager.unregister(found)
        # The parent prints; the child's terminal output would only bury the crash tail.
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)
            quiet = QuietReporter(config, open(os.devnull, "w"))  # noqa: SIM115
            config.pluginmanager.register(quiet, "terminalreporter")
        if config.option.setupshow:  # to the output the parent echoes (as outside capture)
            _compat.show_setup_on(config, sys.stdout)

    def _record_junit(self, config: Any) -> None:
        if self.job.junit_family is not None:
            recorder = JunitRecorder(self.job.junit_family, self.channel)
            config.stash[_compat.xml_key] = recorder
            config.pluginmanager.register(recorder, "gpuiso-junit-recorder")

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection(self, session: Any) -> bool:
        # What exists before the test runs (the interpreter, the preload modules, pytest's
        # configuration, plugins, conftests, the collected module) is left out of garbage
        # collection, as in the fork server's template: pytest's end-of-session gc.collect()
        # calls (its unraisable-exception check) would otherwise scan all of torch's objects
        # in every test's process, ~130 ms a test. Frozen now, and again once collected (a
        # process started cold imports torch with the test module). The test's objects are
        # collected as ever.
        freeze()
        # pytest's own pytest_collection does, ours replaces it: with pytest's initial paths,
        # not this process's one file
        _compat.rewrite_for(session, self.job.initial_paths)
        module = os.path.relpath(self.job.collect_arg.split("::", 1)[0])
        # A prewarmed process collects while it waits for its go (seeing no GPU), unless
        # CUDA is touched already: it would be replaced at its go anyway.
        ahead = self.channel.collect_ahead and self.channel.cuda_touched() is None
        if ahead:
            self.channel.collecting_ahead(module)
            self._collect(session, module)
        self.channel.wait_go()  # a prewarmed child stops here until its test's turn
        if not ahead:
            self._collect(session, module)
        freeze()
        return True

    def _collect(self, session: Any, module: str) -> None:
        self.channel.send(frames.PHASE, f"importing {module}")
        try:
            session.perform_collect([self.job.collect_arg])
        except pytest.UsageError:  # "found no collectors": the collect errors say why
            session.items = []

    @pytest.hookimpl(trylast=True)  # after -k / -m deselection
    def pytest_collection_modifyitems(self, items: list) -> None:
        items[:] = [item for item in items if item.nodeid == self.job.nodeid]

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self.collect_errors.append(f"{report.nodeid}:\n{report.longreprtext}")

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: Any) -> bool:
        if not session.items:
            detail = "\n".join(self.collect_errors) or "the test was not collected"
            self.channel.send(
                frames.ERROR,
                f"{frames.UNCOLLECTED}{self.job.nodeid!r}:\n{detail}",
            )
            return True
        item = session.items[0]
        if self.job.location is not None:  # as pytest's process has it, not read again
            _compat.set_location(item, self.job.location)
        self._run(item)
        return True

    def _run(self, item: Any) -> None:
        memory_cap.install()  # its GPU memory lease, on torch's allocator when CUDA starts
        before = torch_check.allocated() if self.job.torch_check else {}
        modules = imports.mark()
        # the test's timeout counts from here
        self.channel.send(frames.BEGIN, (item.nodeid, time.monotonic()))
        self.ran = item
        try:
            item.config.hook.pytest_runtest_protocol(item=item, nextitem=None)
        except (pytest.exit.Exception, KeyboardInterrupt) as exc:
            # pytest.exit() or Ctrl-C raised by the test ends the parent's session too.
            self.channel.send(
                frames.EXIT,
                {
                    "interrupt": isinstance(exc, KeyboardInterrupt),
                    "message": str(getattr(exc, "msg", exc)),
                    "returncode": getattr(exc, "returncode", None),
                },
            )
            raise
        self.channel.send(frames.END, None)
        self.ended = True
        learnt = imports.learnable(modules)
        if learnt["names"]:  # the fork server's template imports them for the tests after it
            self.channel.send(frames.IMPORTED, learnt)
        if os.environ.get(LEASED_ENV) == "":  # there are GPUs, and this test leased none
            loaded = cuda_state.driver_libraries()
            if loaded:
                self.channel.send(frames.DRIVER, loaded)
        if self.job.torch_check:
            for device, grown in torch_check.growth(before).items():
                self.channel.send(frames.TORCH_LEAK, {"device": device, "bytes": grown})

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: Any) -> None:
        """Send what other plugins put in ``pytest_gpuiso_child_payload`` (after their own
        session ends); a failing implementation becomes a warning, the result stands."""
        item = self.ran
        if item is None:  # nothing ran here (the template itself, a collection error)
            return
        payload: dict[str, Any] = {}
        try:
            item.config.hook.pytest_gpuiso_child_payload(item=item, payload=payload)
        except Exception as exc:  # noqa: BLE001 - a plugin's bug must not cost the result
            self._warn(item, f"pytest_gpuiso_child_payload failed: {type(exc).__name__}: {exc}")
        problems: list[str] = []
        payload = wire.plain(payload, "pytest_gpuiso_child_payload", problems)
        for problem in problems:  # a value that isn't plain data: only it becomes its repr
            self._warn(item, f"{problem} sent instead")
        if payload:
            self.channel.send(frames.PAYLOAD, payload)

    def _warn(self, item: Any, text: str) -> None:
        """A warning of the test, sent as its warnings are (the parent replays it)."""
        message = warnings.WarningMessage(
            pytest.PytestWarning(text), pytest.PytestWarning, str(item.path), 0
        )
        self.channel.send(frames.WARNING, encode_warning(message, item.nodeid))

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef: Any, request: Any) -> Any:
        """Say which fixtures of a scope broader than the test this process sets up (as
        each begins: one that hangs or crashes the process is named too), but for
        machinery (``machinery``); the test's JSON record lists them."""
        if self.ran is not None and fixturedef.scope != "function" and not machinery(fixturedef):
            self.channel.send(frames.FIXTURE, (fixturedef.argname, fixturedef.scope))
        return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: Any, call: Any) -> Any:
        report = yield
        overrun = memory_cap.describe_overrun(call.excinfo)
        if overrun is not None:
            report.sections.append(("gpu-isolate: GPU memory lease", overrun))
        return report

    def pytest_runtest_logreport(self, report: Any) -> None:
        # record_property values as plain data; any other value as its str(), which is
        # what junitxml writes of it
        report.user_properties = [
            wire.plain(prop, "record_property", [], str) for prop in report.user_properties
        ]
        report.sections = [(title, keep_end(text)) for title, text in report.sections]
        data = self.config.hook.pytest_report_to_serializable(config=self.config, report=report)
        longrepr = report.longrepr
        if hasattr(longrepr, "toterminal") and not hasattr(longrepr, "reprcrash"):
            data[frames.TEXT_REPR] = True  # e.g. a missing fixture: a text with no crash line
        self.channel.send(frames.REPORT, data)

    def pytest_warning_recorded(
        self, warning_message: Any, when: str, nodeid: str, location: Any
    ) -> None:
        if when == "runtest":
            self.channel.send(frames.WARNING, encode_warning(warning_message, nodeid))

    @pytest.hookimpl(optionalhook=True, tryfirst=True)
    def pytest_timeout_set_timer(self, item: Any, settings: Any) -> bool:
        return True  # the parent enforces the timeout; pytest-timeout must not fire here too

    @pytest.hookimpl(optionalhook=True, tryfirst=True)
    def pytest_timeout_cancel_timer(self, item: Any) -> bool:
        return True

    def pytest_internalerror(self, excrepr: Any, excinfo: Any) -> None:
        if self.channel is None:  # the fork server's template: no test's process yet
            return
        self.channel.send(
            frames.ERROR, f"internal pytest error in the isolated process:\n{excrepr}"
        )


_MACHINERY = ("_pytest", "pytest", "pytest_gpuiso")  # modules whose fixtures are not named


def machinery(fixturedef: Any) -> bool:
    """Whether a fixture is machinery rather than what the session's code or plugins set
    up: pytest's own (``tmp_path_factory``, which every ``tmp_path`` sets up), ours, or a
    private one (a leading ``_``, which ``pytest --fixtures`` hides too: a plugin's autouse
    internals)."""
    if fixturedef.argname.startswith("_"):
        return True
    func = getattr(fixturedef.func, "__func__", fixturedef.func)
    module = str(getattr(func, "__module__", None) or "")
    return module.split(".", 1)[0] in _MACHINERY


SECTION_KEEP = 16 << 20  # characters of one captured output section sent to pytest


def keep_end(text: Any) -> Any:
    """A captured output section, cut to its last ``SECTION_KEEP`` characters (from a
    line's start) with a line that says how much is not kept."""
    if not isinstance(text, str) or len(text) <= SECTION_KEEP:
        return text
    end = text[-SECTION_KEEP:]
    end = end.split("\n", 1)[1] if "\n" in end else end
    return (
        f"[gpu-isolate: the first {len(text) - len(end)} of its {len(text)} characters "
        "are not kept]\n" + end
    )


class QuietReporter(_compat.TerminalReporter):
    """The child's terminal reporter: writes to /dev/null and asks for no summary.

    Nobody reads the child's terminal, and ``pytest_terminal_summary`` hooks can be
    costly (hypothesis's imports all of hypothesis there: ~1 s in every process).
    """

    @pytest.hookimpl(wrapper=True)
    def pytest_sessionfinish(self, session: Any, exitstatus: Any) -> Any:
        return (yield)


class JunitRecorder:
    """Stands in for pytest's LogXML in the child when the parent writes junitxml.

    ``record_xml_attribute`` and ``record_testsuite_property`` write straight into
    the LogXML object; here their calls are recorded and replayed by the parent.
    """

    def __init__(self, family: str, channel: Any) -> None:
        self.family = family
        self.channel = channel

    def node_reporter(self, report: Any) -> JunitRecorder._Node:
        return self._Node(self, str(getattr(report, "nodeid", report)))

    def add_global_property(self, name: str, value: object) -> None:
        __tracebackhide__ = True
        _compat.check_record_param_type("name", name)
        self.channel.send(frames.JUNIT, ("property", None, name, str(value)))

    class _Node:
        def __init__(self, recorder: JunitRecorder, nodeid: str) -> None:
            self.recorder = recorder
            self.nodeid = nodeid

        def add_attribute(self, name: str, value: object) -> None:
            self.recorder.channel.send(
                frames.JUNIT, ("attribute", self.nodeid, str(name), str(value))
            )
