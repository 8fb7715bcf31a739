"""Child side of an isolated run: bootstrap, run exactly one job, send frames, ``os._exit``.

Two kinds of job run here:

* ``ItemJob``: rebuild the pytest config from the parent's invocation arguments
  (the way xdist workers do), collect only the target test's module, run the one
  item through ``pytest_runtest_protocol`` and ship every report as
  ``pytest_report_to_serializable`` data.
* ``CallJob``: call a picklable function (``run_isolated``) and ship its value
  or its exception.

It talks to the parent in frames (``frames``): ``READY`` once bootstrapped,
then what the job produced, and ``DONE`` last. The child leaves with ``os._exit``
once ``DONE`` is sent, so a non-daemon thread left running by a test cannot keep
it alive.

A child may be started before its test's turn (prewarming, ``supervisor``): it
bootstraps, imports, parses the configuration and configures pytest, then waits
for the parent's go, which carries the environment of the GPUs it was leased.
Nothing of the test itself (its module, its fixtures) runs before the go. A
child that has initialised CUDA before the go cannot switch GPUs any more: it
says ``stale`` and leaves, and the parent starts a fresh one.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import itertools
import os
import pickle
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, NoReturn

import pytest

from . import _compat, cuda_state, frames
from ._linux import die_with_parent, set_child_subreaper
from .frames import send_frame

CHILD_PLUGIN = "gpuiso-child"

_keep: list[Any] = []  # objects that must live as long as the process (faulthandler's file)
# A configuration the fork server parsed before forking this process (see ``ItemJob.run``).
prepared: Any = None


@dataclass(frozen=True)
class Bootstrap:
    parent_pid: int
    output: str | None  # file for fds 1 and 2; None: keep the parent's (pytest -s)
    stack_file: str
    stack_signal: int
    spill_dir: str
    capture_prefix: str  # pytest's capture files get these names, so a crash can't lose them
    env: tuple[tuple[str, str], ...] = ()  # e.g. CUDA_VISIBLE_DEVICES of the leased GPUs
    preload: tuple[str, ...] = ()  # modules to import while waiting for the go (prewarming)


# Variables that decide which GPUs a CUDA runtime sees; read once, at its initialisation.
CUDA_ENV = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")


def main(boot: Bootstrap, job: Any, conn: Connection, go: Connection | None = None) -> None:
    """Entry point of the isolated process (spawned, or forked by the fork server)."""
    _bootstrap(boot, conn)
    channel = Channel(conn, boot.spill_dir, go, boot.output)
    status = 0
    try:
        _refuse_inherited_cuda()
        channel.send(frames.READY, os.getpid())
        _preload(boot.preload)
        job.run(channel, boot)
    except BaseException:
        status = 1
        with contextlib.suppress(Exception):
            send_frame(conn, frames.ERROR, _internal_error(), boot.spill_dir)
    _flush_and_exit(status)


def _refuse_inherited_cuda() -> None:
    inherited = cuda_state.touched()
    if inherited is not None:
        raise RuntimeError(
            f"the isolated process started with CUDA state it must not have: {inherited}; "
            "refusing to run the test (it would not get a clean CUDA context)"
        )


def _internal_error() -> str:
    return "internal error in the isolated process:\n" + traceback.format_exc()


def _flush_and_exit(status: int) -> NoReturn:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def _bootstrap(boot: Bootstrap, conn: Connection) -> None:
    # Own process group: the parent signals the test's whole tree at once, and
    # the terminal's Ctrl-C goes to pytest, which then takes the group down.
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    die_with_parent(boot.parent_pid)
    # Until its go, orphans of this process's descendants (a daemon a plugin double-forks
    # at configure) stay in its tree: the sweep of the test running while it is prewarmed
    # spares them, and they are its own test's leftovers once it ends. Off at the go, so
    # that the test sees orphans go to pytest as they did (os.wait() reaps only its own).
    set_child_subreaper(True)
    # Only this process may hold the pipe's write end: a forked grandchild
    # holding it would keep the pipe open after we die.
    fd = conn.fileno()
    os.set_inheritable(fd, False)
    os.register_at_fork(after_in_child=lambda: _close_quietly(fd))
    if boot.output is not None:
        out = os.open(boot.output, os.O_WRONLY | os.O_APPEND)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
    stack = open(boot.stack_file, "w")  # noqa: SIM115 - must stay open for faulthandler
    _keep.append(stack)
    faulthandler.register(boot.stack_signal, file=stack, all_threads=True, chain=False)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    os.environ.update(dict(boot.env))  # before anything could initialise CUDA


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def _preload(modules: tuple[str, ...]) -> None:
    """Import what the test will need, ahead of its turn; a failure is the test's to meet."""
    from importlib import import_module

    for name in modules:
        with contextlib.suppress(Exception):
            import_module(name)


class Channel:
    """The child's end of the pipes: frames out, the go in."""

    def __init__(
        self,
        conn: Connection,
        spill_dir: str,
        go: Connection | None = None,
        output: str | None = None,
    ) -> None:
        self.conn = conn
        self.spill_dir = spill_dir
        self.go = go
        self.output = output  # the file fds 1 and 2 write to (None: pytest's terminal)

    def send(self, kind: str, payload: Any) -> None:
        send_frame(self.conn, kind, payload, self.spill_dir)

    def wait_go(self) -> None:
        """Block until the parent says this test's turn has come; apply its environment."""
        if self.go is None:
            set_child_subreaper(False)
            return
        try:
            env: dict[str, str] = self.go.recv()
        except (EOFError, OSError):
            os._exit(0)  # discarded before its turn (session over, other test order)
        self.go.close()
        set_child_subreaper(False)
        if any(os.environ.get(name) != env.get(name) for name in CUDA_ENV if name in env):
            reason = cuda_state.touched()
            if reason is not None:  # too late to change the GPUs this process sees
                self.send(frames.STALE, reason)
                os._exit(0)
        os.environ.update(env)
        if self.output is not None:  # start-up noise (imports) is not the test's output
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            with contextlib.suppress(OSError):
                os.ftruncate(1, 0)


# --------------------------------------------------------------------------- calls


@dataclass(frozen=True)
class CallJob:
    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def run(self, channel: Channel, boot: Bootstrap) -> None:
        channel.wait_go()
        try:
            value = self.func(*self.args, **self.kwargs)
        except BaseException as exc:
            channel.send(frames.EXCEPTION, describe_exception(exc))
        else:
            try:
                channel.send(frames.RESULT, value)
            except Exception as exc:
                channel.send(
                    frames.EXCEPTION,
                    {
                        "type": "PicklingError",
                        "message": f"the return value of {_name(self.func)} "
                        f"cannot be pickled: {exc}",
                        "traceback": "",
                        "pickled": None,
                    },
                )
        channel.send(frames.DONE, 0)


def describe_exception(exc: BaseException) -> dict[str, Any]:
    """An exception as data: always its text, and the object itself when it pickles."""
    try:
        message = str(exc)
    except Exception:
        message = repr(exc)
    try:
        pickled = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(pickled)
    except Exception:
        pickled = None
    return {
        "type": _name(type(exc)),
        "message": message,
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        "pickled": pickled,
    }


def _name(obj: Any) -> str:
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", repr(obj))
    return qualname if module in (None, "builtins") else f"{module}.{qualname}"


# --------------------------------------------------------------------------- items


@dataclass(frozen=True)
class ItemJob:
    nodeid: str
    collect_arg: str  # what to collect: "path::Class::func" or the file path
    args: tuple[str, ...]  # the parent's invocation arguments
    invocation_dir: str
    basetemp: str
    junit_family: str | None = None  # the parent writes junitxml with this family
    torch_check: bool = False  # compare torch's CUDA allocator before and after the test

    def run(self, channel: Channel, boot: Bootstrap) -> None:
        _name_capture_files(boot.capture_prefix)
        os.chdir(self.invocation_dir)
        plugin = ChildPlugin(self, channel)
        config = _take_prepared(self.args, self.invocation_dir)
        if config is None:
            config = _compat.prepare_config(list(self.args), plugins=[plugin])
        else:
            config.pluginmanager.register(plugin)
            _restart_capture(config)
        _override_options(config.option, self.basetemp)
        status = config.hook.pytest_cmdline_main(config=config)
        channel.send(frames.DONE, int(status))


def _take_prepared(args: tuple[str, ...], invocation_dir: str) -> Any:
    """The fork server's parsed (never configured) configuration, if it fits this job.

    Parsing imports and registers every plugin and the initial conftests; doing it
    once in the server saves each test's process ~15 ms of its start-up.
    """
    global prepared
    config, prepared = prepared, None
    if config is None:
        return None
    params = config.invocation_params
    if tuple(params.args) != tuple(args) or str(params.dir) != invocation_dir:
        return None
    return config


def _restart_capture(config: Any) -> None:
    """Give this process its own global capture (the server stopped its own after parsing).

    As after ``pytest_load_initial_conftests``: started, then suspended until a test runs.
    """
    capman = config.pluginmanager.get_plugin("capturemanager")
    if capman is not None:
        capman.start_global_capturing()
        capman.suspend_global_capture()


def _name_capture_files(prefix: str) -> None:
    """Give pytest's fd-capture files names in our private directory.

    pytest captures into anonymous temporary files; when the test crashes they
    vanish with the process, and with them whatever the test printed just before.
    Named files (0600, removed by the parent after the test) survive the crash.
    """
    counter = itertools.count(1)

    def named_temporary_file(buffering: int = -1, **_: Any) -> Any:
        fd = os.open(f"{prefix}{next(counter)}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        return open(fd, "w+b", buffering=buffering)  # noqa: SIM115 - pytest owns and closes it

    _compat.set_capture_tempfile(named_temporary_file)


# Options that must not take effect in the child: the parent debugs, distributes,
# writes result files and keeps the last-failed cache; the child only runs one test.
_CHILD_OVERRIDES: dict[str, Any] = {
    "usepdb": False,
    "trace": False,
    "xmlpath": None,
    "numprocesses": None,
    "maxprocesses": None,
    "dist": "no",
    "tx": [],
    "looponfail": False,
    "report_log": None,
    "htmlpath": None,
    "lf": False,
    "failedfirst": False,
    "newfirst": False,
    "stepwise": False,
    "stepwise_skip": False,
    "gpu_isolate_report": None,
}


def _override_options(option: Any, basetemp: str) -> None:
    for name, value in _CHILD_OVERRIDES.items():
        if hasattr(option, name):
            setattr(option, name, value)
    option.basetemp = basetemp


class ChildPlugin:
    """Collects just the target item, runs it and forwards reports and warnings."""

    __name__ = CHILD_PLUGIN  # pluggy registers the plugin under this name

    def __init__(self, job: ItemJob, channel: Channel) -> None:
        self.job = job
        self.channel = channel
        self.collect_errors: list[str] = []
        self.config: Any = None

    @pytest.hookimpl(trylast=True)
    def pytest_configure(self, config: Any) -> None:
        self.config = config
        if self.job is not None:
            self._record_junit(config)
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
        gc.freeze()
        self.channel.wait_go()  # a prewarmed child stops here until its test's turn
        try:
            session.perform_collect([self.job.collect_arg])
        except pytest.UsageError:  # "found no collectors": the collect errors say why
            session.items = []
        gc.freeze()
        return True

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
                f"the isolated process could not collect {self.job.nodeid!r}:\n{detail}",
            )
            return True
        item = session.items[0]
        self._run(item)
        return True

    def _run(self, item: Any) -> None:
        before = torch_allocated() if self.job.torch_check else {}
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
        if self.job.torch_check:
            for device, grown in torch_growth(before).items():
                self.channel.send(frames.TORCH_LEAK, {"device": device, "bytes": grown})

    def pytest_runtest_logreport(self, report: Any) -> None:
        data = self.config.hook.pytest_report_to_serializable(config=self.config, report=report)
        self.channel.send(frames.REPORT, data)

    def pytest_warning_recorded(
        self, warning_message: Any, when: str, nodeid: str, location: Any
    ) -> None:
        if when == "runtest":
            self.channel.send(frames.WARNING, frames.encode_warning(warning_message, nodeid))

    @pytest.hookimpl(optionalhook=True, tryfirst=True)
    def pytest_timeout_set_timer(self, item: Any, settings: Any) -> bool:
        return True  # the parent enforces the timeout; pytest-timeout must not fire here too

    @pytest.hookimpl(optionalhook=True, tryfirst=True)
    def pytest_timeout_cancel_timer(self, item: Any) -> bool:
        return True

    def pytest_internalerror(self, excrepr: Any, excinfo: Any) -> None:
        self.channel.send(
            frames.ERROR, f"internal pytest error in the isolated process:\n{excrepr}"
        )


class TemplatePlugin(ChildPlugin):
    """The template's session (see ``forkserver``): collect, then fork tests' processes.

    The template configures pytest, starts the session and collects the isolated
    tests' modules once; then its ``pytest_collection`` hands over to the fork
    server's request loop. That loop returns only in a freshly forked test's
    process (by raising ``forkserver.Become``), which takes its job from it, sets
    up what is its own (pipes, output, capture files, temporary directory), waits
    for its go and runs its item from the collected session.
    """

    def __init__(self, modules: list[str] | None, serve: Callable[[list[str]], None]) -> None:
        super().__init__(None, None)  # type: ignore[arg-type] - given to each fork
        self.modules = modules
        self.serve = serve
        self.items: dict[str, Any] = {}
        self.seeded: list[Any] = [None, None]  # generator states the collection set

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection(self, session: Any) -> bool:
        from .forkserver import Become

        before = _random_states()
        session.perform_collect(self.modules)  # None: the session's arguments, as pytest
        # A module that seeded a global generator at import: each test's process starts
        # from that state, as if it had imported the module itself (a fork reseeds them).
        after = _random_states()
        self.seeded = [new if new != old else None for old, new in zip(before, after, strict=True)]
        self.items = {item.nodeid: item for item in session.items}
        capman = self.config.pluginmanager.get_plugin("capturemanager")
        if capman is not None:  # each test's process captures into its own files
            capman.stop_global_capturing()
        try:
            self.serve(list(self.items))
        except Become as become:
            boot, job, conn, go = become.args
        else:
            os._exit(0)
        self._become(boot, job, conn, go)
        self.channel.wait_go()
        return True

    def _become(self, boot: Bootstrap, job: ItemJob, conn: Connection, go: Connection) -> None:
        """This process is now the test's: take its job and what is its own."""
        _bootstrap(boot, conn)
        self.job = job
        self.channel = Channel(conn, boot.spill_dir, go, boot.output)
        _refuse_inherited_cuda()
        self.channel.send(frames.READY, os.getpid())
        config = self.config
        self._record_junit(config)
        _name_capture_files(boot.capture_prefix)
        _restart_capture(config)
        _override_options(config.option, job.basetemp)
        # The session's factory was made in the template: this test's basetemp instead.
        _compat.retarget_basetemp(config, job.basetemp)
        _restore_random_states(self.seeded)
        _repoint_faulthandler(config)

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list) -> None:
        """Keep everything: the template serves every test it collected."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: Any) -> bool:
        item = self.items.get(self.job.nodeid)
        session.items[:] = [item] if item is not None else []
        return super().pytest_runtestloop(session)


def run_template(
    config: Any, modules: list[str] | None, serve: Callable[[list[str]], None]
) -> None:
    """The template's pytest session; in a test's process forked from it, the test's end."""
    plugin = TemplatePlugin(modules, serve)
    config.pluginmanager.register(plugin, CHILD_PLUGIN)
    _restart_capture(config)
    _override_options(config.option, config.option.basetemp)
    try:
        status = int(config.hook.pytest_cmdline_main(config=config))
    except BaseException:
        if plugin.channel is None:  # the template itself failed: the server forks instead
            raise
        with contextlib.suppress(Exception):
            plugin.channel.send(frames.ERROR, _internal_error())
        _flush_and_exit(1)
    if plugin.channel is not None:  # a test's process: its session is over
        plugin.channel.send(frames.DONE, status)
        status = 0
    _flush_and_exit(status)


def _random_states() -> list[Any]:
    """The states of Python's and numpy's global random generators (None: no numpy)."""
    import random

    numpy = sys.modules.get("numpy")
    try:
        state = numpy.random.get_state() if numpy is not None else None
    except Exception:
        state = None
    return [random.getstate(), _comparable(state)]


def _comparable(state: Any) -> Any:
    """numpy's state tuple holds an array; a tuple of plain values compares with ==."""
    if state is None:
        return None
    return tuple(x.tolist() if hasattr(x, "tolist") else x for x in state)


def _restore_random_states(seeded: list[Any]) -> None:
    import random

    python, numpy_state = seeded
    if python is not None:
        random.setstate(python)
    numpy = sys.modules.get("numpy")
    if numpy_state is not None and numpy is not None:
        with contextlib.suppress(Exception):
            kind, keys, *rest = numpy_state
            numpy.random.set_state((kind, numpy.asarray(keys, dtype=numpy.uint32), *rest))


def _repoint_faulthandler(config: Any) -> None:
    """Crash dumps go to this process's stderr, as pytest's faulthandler plugin set it up.

    The plugin enabled faulthandler on a copy of stderr made at configure time, in the
    template; here the copy is pointed at this process's stderr (while capture is
    suspended, so the real one), and faulthandler at the copy, which fd capture of
    fd 2 during the test does not redirect.
    """
    with contextlib.suppress(Exception):
        fd = config.stash.get(_compat.fault_handler_stderr_fd_key, None)
        if fd is not None:
            os.dup2(2, fd)
            faulthandler.enable(file=fd, all_threads=True)


class QuietReporter(_compat.TerminalReporter):
    """The child's terminal reporter: writes to /dev/null and asks for no summary.

    Nobody reads the child's terminal, and ``pytest_terminal_summary`` hooks can be
    costly (hypothesis's imports all of hypothesis there: ~1 s in every process).
    """

    @pytest.hookimpl(wrapper=True)
    def pytest_sessionfinish(self, session: Any, exitstatus: Any) -> Any:
        return (yield)


def torch_allocated() -> dict[int, int]:
    """Bytes held by torch's CUDA allocator per device; {} when CUDA is not initialised.

    Never initialises CUDA itself: a test that did not use the GPU has nothing to compare.
    """
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return {}
    return {d: int(torch.cuda.memory_allocated(d)) for d in range(torch.cuda.device_count())}


def torch_growth(before: dict[int, int]) -> dict[int, int]:
    """Growth of ``torch_allocated()`` since ``before``, after dropping unreachable tensors."""
    import gc

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    after = torch_allocated()
    return {d: n - before.get(d, 0) for d, n in after.items() if n > before.get(d, 0)}


class JunitRecorder:
    """Stands in for pytest's LogXML in the child when the parent writes junitxml.

    ``record_xml_attribute`` and ``record_testsuite_property`` write straight into
    the LogXML object; here their calls are recorded and replayed by the parent.
    """

    def __init__(self, family: str, channel: Channel) -> None:
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
