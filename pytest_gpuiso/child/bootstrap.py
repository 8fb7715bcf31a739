"""Child side of an isolated run: bootstrap, run exactly one job, send frames, exit.

Two kinds of job run here:

* ``ItemJob``: rebuild the pytest config from the parent's invocation arguments
  (the way xdist workers do), collect only the target test's module, run the one
  item through ``pytest_runtest_protocol`` and ship every report as
  ``pytest_report_to_serializable`` data.
* ``CallJob``: call a picklable function (``run_isolated``) and ship its value
  or its exception.

It talks to the parent in frames (``frames``): ``READY`` once bootstrapped,
then what the job produced, and ``DONE`` last. Once ``DONE`` is sent the child runs
threading's exit hooks and multiprocessing's finalizers and leaves with ``os._exit``
(``flush_and_exit``), so a non-daemon thread left running by a test cannot keep it alive.
Just before ``os._exit`` it closes its descriptors (not stdio, not the pipe) and says
``EXITING``: the parent may then go on while the kernel tears its memory down
(``supervisor``), and what the test held through a descriptor (a port, a lock, a file)
is already free for the next test, as after an exit.

A child may be started before its test's turn (prewarming, ``supervisor``): it
bootstraps, imports, parses the configuration and configures pytest, collects its
test's module (``Bootstrap.collect_ahead``), then waits for the parent's go, which
carries the environment of the GPUs it was leased. Nothing of the test itself (its
fixtures, its body) runs before the go. A child that touched CUDA before the go
(``Channel.cuda_touched``), or read a variable the go changes (``CUDA_VISIBLE_DEVICES``),
cannot switch GPUs any more: it says ``stale`` (and whether the module's import did it)
and leaves, and the parent starts a fresh one.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from .. import _compat
from ..proc._linux import die_with_parent, set_child_subreaper
from ..wire import frames
from ..wire.frames import send_frame
from ..wire.jobs import Bootstrap, CallJob, ItemJob
from ..wire.payloads import ExceptionData
from . import cuda_state
from .env_reads import EnvReads
from .exiting import flush_and_exit, mark_exit_handlers
from .overrides import override_options
from .relay import (
    ChildPlugin,
    after_the_test,
    named_capture_files,
    restart_capture,
)

_keep: list[Any] = []  # objects that must live as long as the process (faulthandler's file)


# Variables that decide which GPUs a CUDA runtime sees; read once, at its initialisation.
CUDA_ENV = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")


def main(
    boot: Bootstrap,
    job: Any,
    conn: Connection,
    go: Connection | None = None,
    *,
    config: Any = None,
) -> None:
    """Entry point of the isolated process (spawned, or forked by the fork server).

    ``config``: a configuration the fork server parsed (never configured) before it
    forked this process; an ``ItemJob`` uses it when it was parsed from its arguments.
    """
    bootstrap(boot, conn)
    channel = Channel(conn, boot.spill_prefix, go, boot.output, boot.collect_ahead)
    status = 0
    try:
        refuse_inherited_cuda()
        channel.send(frames.READY, os.getpid())
        _preload(channel, boot.preload)
        channel.go_first(driver=cuda_state.baseline())
        if isinstance(job, CallJob):
            run_call(job, channel)
        else:
            run_item(job, channel, boot, config)
    except BaseException:
        status = 1
        with contextlib.suppress(Exception):
            send_frame(conn, frames.ERROR, internal_error(), boot.spill_prefix)
    flush_and_exit(status, conn)


def refuse_inherited_cuda() -> None:
    inherited = cuda_state.touched()
    if inherited is not None:
        raise RuntimeError(
            f"the isolated process started with CUDA state it must not have: {inherited}; "
            "refusing to run the test (it would not get a clean CUDA context)"
        )


def internal_error() -> str:
    """The exception being handled, as an ``ERROR`` frame's text: its one-line summary
    first (what pytest shows of a process that could not start), then its traceback."""
    kind, exc, _ = sys.exc_info()
    summary = " ".join(" ".join(traceback.format_exception_only(kind, exc)).split())
    return f"internal error in the isolated process: {summary}\n{traceback.format_exc()}"


def bootstrap(boot: Bootstrap, conn: Connection) -> None:
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


def _preload(channel: Channel, modules: tuple[str, ...]) -> None:
    """Import what the test will need, ahead of its turn; a failure is the test's to meet."""
    from importlib import import_module

    if modules:
        channel.send(frames.PHASE, f"importing {', '.join(modules)}")
    for name in modules:
        with contextlib.suppress(Exception):
            import_module(name)


class Channel:
    """The child's end of the pipes: frames out, the go in."""

    def __init__(
        self,
        conn: Connection,
        spill_prefix: str,
        go: Connection | None = None,
        output: str | None = None,
        collect_ahead: bool = False,
        configured: bool = False,
    ) -> None:
        self.conn = conn
        self.spill_prefix = spill_prefix
        self.go = go
        self.output = output  # the file fds 1 and 2 write to (None: pytest's terminal)
        self.collect_ahead = collect_ahead and go is not None
        self.configured = configured  # user code ran before, GPUs visible (the template)
        self.ahead: str | None = None  # the module it is collecting before its go
        if go is not None:
            EnvReads.start()

    def send(self, kind: str, payload: Any) -> None:
        send_frame(self.conn, kind, payload, self.spill_prefix)

    def collecting_ahead(self, module: str) -> None:
        """The test's module is about to be imported before the go (``collect_ahead``)."""
        self.ahead = module
        EnvReads.where = module

    def wait_go(self) -> None:
        """Block until the parent says this test's turn has come; apply its environment."""
        if self.go is None:
            set_child_subreaper(False)
            mark_exit_handlers()
            return
        try:
            env: dict[str, str] = self.go.recv()
        except (EOFError, OSError):
            os._exit(0)  # discarded before its turn (session over, other test order)
        self.go.close()
        self.go = None
        reads = EnvReads.stop()
        set_child_subreaper(False)
        stale = self._stale(env, reads)
        if stale is not None:  # too late to change the GPUs this process sees
            self.send(frames.STALE, stale)
            os._exit(0)
        os.environ.update(env)
        mark_exit_handlers()
        if self.ahead is not None:
            self.send(frames.AHEAD, self.ahead)
        if self.output is not None:  # start-up noise (imports) is not the test's output
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            with contextlib.suppress(OSError):
                os.ftruncate(1, 0)

    def go_first(self, driver: str | None) -> None:
        """Take the go before any code of the session's runs (plugins, conftests, the
        module) where the driver library (``driver``, its path) is mapped already
        (inherited, or by the preload: torch's CUDA 13 build): a CUDA call made with the
        GPUs hidden would not show."""
        if self.go is not None and not self.configured and driver:
            self.configured, self.collect_ahead = True, False  # none of it ran hidden
            self.wait_go()

    def cuda_touched(self) -> str | None:
        """Why CUDA counts as touched while this process waits with its GPUs hidden."""
        return cuda_state.touched() if self.configured else cuda_state.hidden_touch()

    def _stale(self, env: dict[str, str], reads: dict[str, str | None]) -> dict | None:
        """Why this process cannot take the go's environment, or None when it can.

        ``{"cuda": why or None, "read": variable or None, "module": the test module
        whose import (before the go) did it, or None: plugins or conftests did}``.
        """
        changed = sorted(name for name, value in env.items() if os.environ.get(name) != value)
        if any(name in CUDA_ENV for name in changed) and (reason := self.cuda_touched()):
            return {"cuda": reason, "read": None, "module": self.ahead}
        for name in changed:
            if name in reads:
                return {"cuda": None, "read": name, "module": reads[name]}
        return None


def stale_notice(why: dict[str, Any]) -> str:
    """What a replaced prewarmed process means for the session, in words (``_stale``'s
    ``why``): prewarming turned off (plugins, conftests) or collecting ahead (the module)."""
    if why["module"] is None:
        if why["cuda"]:
            return (
                "prewarming turned off: a process started ahead of its test initialised CUDA "
                f"before it was given its GPUs ({why['cuda']}); a plugin or conftest uses "
                "CUDA or NVML at import (torch.cuda.is_available() and device_count() do): "
                "call them in fixtures or tests instead"
            )
        return (
            f"prewarming turned off: a process started ahead of its test read {why['read']} "
            "before it was given its GPUs; a plugin or conftest reads it at import: read it "
            "in fixtures or tests instead"
        )
    if why["read"]:
        what, advice = f"read {why['read']}", "read it in fixtures or tests instead"
    else:
        what = f"initialised CUDA ({why['cuda']})"
        advice = (
            "a skipif condition calling torch.cuda.is_available() can be written as a "
            'string, "not torch.cuda.is_available()", which pytest evaluates when the test runs'
        )
    return (
        "prewarmed processes no longer collect their test's module ahead of its turn: "
        f"importing {why['module']}, one {what} before it was given its GPUs; {advice}"
    )


# --------------------------------------------------------------------------- calls


def run_call(job: CallJob, channel: Channel) -> None:
    """Run a ``run_isolated`` call: wait for the go, call, send what it returned or raised."""
    channel.wait_go()
    channel.send(frames.BEGIN, (_name(job.func), time.monotonic()))  # its timeout counts
    try:
        value = job.func(*job.args, **job.kwargs)
    except BaseException as exc:
        channel.send(frames.END, None)
        channel.send(frames.EXCEPTION, describe_exception(exc))
    else:
        channel.send(frames.END, None)
        try:  # its caller, and only it, unpickles it (frames are plain data)
            channel.send(frames.RESULT, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception as exc:
            channel.send(
                frames.EXCEPTION,
                {
                    "type": "PicklingError",
                    "message": f"the return value of {_name(job.func)} cannot be pickled: {exc}",
                    "traceback": "",
                    "pickled": None,
                },
            )
    channel.send(frames.DONE, 0)


def describe_exception(exc: BaseException) -> ExceptionData:
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


def run_item(job: ItemJob, channel: Channel, boot: Bootstrap, config: Any = None) -> None:
    """Run one test through pytest (its configuration parsed here, or the fork server's)."""
    os.chdir(job.invocation_dir)
    plugin = ChildPlugin(job, channel)
    if config is not None:  # parsing it once in the fork server saves ~15 ms a test
        params = config.invocation_params
        if tuple(params.args) != job.args or str(params.dir) != job.invocation_dir:
            config = None
    with named_capture_files(boot.capture_prefix):  # for the global capture, made here
        if config is None:  # parsing starts it
            channel.send(frames.PHASE, "configuring pytest (plugins, conftests)")
            config = _compat.prepare_config(list(job.args), plugins=[plugin])
        else:
            config.pluginmanager.register(plugin)
            restart_capture(config)
    override_options(config.option, job.basetemp, job.options)
    status = after_the_test(plugin, lambda: config.hook.pytest_cmdline_main(config=config))
    channel.send(frames.DONE, status)
