"""``run_isolated``: call a picklable function in a fresh spawned process.

For isolated phases inside one test (load a model, measure, tear down) or any
script that needs a clean CUDA context per step. The function and its arguments
must be picklable; functions are pickled by reference, so define them at module
level in an importable module.
"""

from __future__ import annotations

import itertools
import os
import pickle
import secrets
from collections.abc import Callable
from typing import Any

from .. import native
from ..gpu import xids
from ..gpu.devices import discover
from ..gpu.health import Checkup, Health
from ..gpu.leases import LeaseError, Leases, held_lease, visible_env
from ..gpu.nvml import NvmlReader
from ..leaks.process import Mark
from ..proc import workdir
from ..values import DEFAULT_GRACE, DEFAULT_STARTUP_TIMEOUT, parse_count, parse_seconds
from ..wire.jobs import CallJob
from . import supervisor
from .launcher import Launcher
from .outcome import Outcome
from .results import trim_stack
from .watch import Bounds

_CALLS = itertools.count(1)


class IsolationError(RuntimeError):
    """The isolated call did not return: it timed out, crashed or exited early."""

    def __init__(self, message: str, outcome: Outcome | None = None) -> None:
        super().__init__(message)
        self.outcome = outcome


class IsolatedTimeout(IsolationError, TimeoutError):
    """The isolated call exceeded its timeout and was killed."""


class RemoteError(IsolationError):
    """The call raised an exception that could not be pickled; its text is kept."""

    def __init__(self, type_name: str, message: str, remote_traceback: str) -> None:
        super().__init__(f"{type_name}: {message}\n\nRemote traceback:\n{remote_traceback}")
        self.type_name = type_name
        self.remote_traceback = remote_traceback


# The public names (``pytest_gpuiso.IsolatedTimeout``), as tracebacks and pickles say them.
for _public in (IsolationError, IsolatedTimeout, RemoteError):
    _public.__module__ = "pytest_gpuiso"


class RemoteTraceback(Exception):
    """Carries the child's traceback text as the ``__cause__`` of a re-raised exception."""

    def __str__(self) -> str:
        return f"\n\nRemote traceback (isolated process):\n{self.args[0]}"


def run_isolated(
    func: Callable[..., Any],
    *args: Any,
    timeout: float | None = None,
    gpus: int = 0,
    grace: float = DEFAULT_GRACE,
    **kwargs: Any,
) -> Any:
    """Run ``func(*args, **kwargs)`` in a fresh spawned process and return its value.

    An exception raised remotely is re-raised here (with the remote traceback as
    its cause); one that cannot be pickled becomes ``RemoteError`` with its text.
    ``timeout`` (seconds) kills the process tree and raises ``IsolatedTimeout``;
    a crash raises ``IsolationError`` naming the signal. ``gpus`` is the number
    of GPUs to lease for the call; the process sees exactly those.
    """
    __tracebackhide__ = True  # a failing call's traceback in pytest shows the test, not us
    return call_isolated(func, args, kwargs, timeout=timeout, gpus=gpus, grace=grace)


def call_isolated(
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    timeout: float | None,
    gpus: int,
    grace: float,
    leases: Leases | None = None,
    health: str = "after-failure",
) -> Any:
    """``run_isolated`` with the session's lease table (the fixture passes it); a call that
    leases GPUs has them judged as a test's are (``health``: settings.HEALTH_MODES)."""
    __tracebackhide__ = True
    if timeout is not None:
        timeout = parse_seconds(timeout, "run_isolated argument timeout", allow_zero=False)
    grace = parse_seconds(grace, "run_isolated argument grace", allow_zero=True)
    parse_count(gpus, "run_isolated argument gpus")
    name = _label(func)
    unavailable = native.missing()
    if unavailable:  # not Linux, or installed without the C extensions
        raise IsolationError(f"run_isolated({name}): {unavailable.split(';')[0]}")
    lease, env = None, {}
    checks: Health | None = None
    checked: Checkup | None = None
    outcome: Outcome | None = None
    have = held_lease(os.environ)
    if have is not None:  # inside an isolated test: use the GPUs it holds
        if gpus > len(have):
            raise IsolationError(
                f"run_isolated({name}) needs {gpus} GPUs, its test holds {len(have)}"
            )
        env = visible_env(have[:gpus])
    elif gpus > 0:
        devices = leases.devices if leases is not None else discover(None, "auto")
        missing = devices.shortfall(gpus)
        if missing is not None:
            raise IsolationError(f"run_isolated({name}) needs {missing}")
        if leases is None:
            leases = Leases(devices, 1)
        label = f"run_isolated({name}) in pid {os.getpid()}"
        checks = Health(leases, NvmlReader(), health)
        try:
            lease = checks.lease(gpus, label, None, None)
        except LeaseError as exc:  # quarantines left too few GPUs: it would wait forever
            checks.nvml.close()
            raise IsolationError(f"run_isolated({name}): {exc}") from None
        env = leases.child_env(lease)
    try:
        # Its sweep takes only the call's own processes, not what the caller starts
        # meanwhile (a helper, from a thread) or the session's (fork server, prewarmed).
        mark = Mark(f"{os.getpid()}-{next(_CALLS)}-{secrets.token_hex(4)}")
        launcher = Launcher(workdir.process_dir(), mark=mark)
        started = launcher.start(CallJob(func, args, kwargs), env)
        bounds = Bounds(timeout, DEFAULT_STARTUP_TIMEOUT, grace)
        outcome = supervisor.go(launcher, started, env, (), bounds).wait()
    except Exception as exc:
        raise IsolationError(f"run_isolated({name}): {exc}") from None
    finally:
        if lease is not None and checks is not None and leases is not None:
            if outcome is not None:  # its GPUs judged before anyone else may lease them
                checked = checks.after(label, lease, outcome.run_end(), leases.slots > 1)
            leases.release(lease)
            checks.nvml.close()
    return _result(func, outcome, timeout, checked)


def _result(
    func: Callable[..., Any], outcome: Outcome, timeout: float | None, checked: Checkup | None
) -> Any:
    """The call's return value, or its exception, with the faults its GPUs logged."""
    __tracebackhide__ = True
    faults = xids.faults_text(checked.xids if checked else (), during="the call")
    if faults is None:
        return _unwrap(func, outcome, timeout)
    try:  # an application Xid on a GPU it held alone: the call's own failure
        _unwrap(func, outcome, timeout)
    except Exception as exc:
        if hasattr(exc, "add_note"):  # Python 3.11 on
            exc.add_note(f"gpu-isolate: {faults}")
        raise
    raise IsolationError(f"run_isolated({_label(func)}): {faults}", outcome)


def _label(func: Callable[..., Any]) -> str:
    return getattr(func, "__qualname__", None) or repr(func)


def _unwrap(func: Callable[..., Any], outcome: Outcome, timeout: float | None) -> Any:
    __tracebackhide__ = True
    results = outcome.sent.results
    if results:  # the value the caller asked for, pickled by the function's process
        try:
            return pickle.loads(results[0])
        except Exception as exc:
            raise IsolationError(
                f"run_isolated({_label(func)}): its return value cannot be rebuilt in this "
                f"process: {exc!r}",
                outcome,
            ) from None
    exceptions = outcome.sent.exceptions
    if exceptions:
        info = exceptions[0]
        exc = None
        if info["pickled"] is not None:
            try:
                exc = pickle.loads(info["pickled"])
            except Exception:
                exc = None
        if isinstance(exc, BaseException):
            if hasattr(exc, "add_note"):
                exc.add_note(f"(raised in an isolated process, pid {outcome.end.pid})")
            raise exc from RemoteTraceback(info["traceback"])
        raise RemoteError(info["type"], info["message"], info["traceback"])
    name = _label(func)
    detail = "\n\n".join(
        part
        for part in (
            "\n".join(outcome.sent.errors),
            f"Stack at the timeout:\n{trim_stack(outcome.end.stack)}" if outcome.end.stack else "",
            f"Last output:\n{outcome.end.output_tail}" if outcome.end.output_tail else "",
        )
        if part
    )
    suffix = f"\n\n{detail}" if detail else ""
    if outcome.end.timed_out:
        raise IsolatedTimeout(
            f"run_isolated({name}) timed out after {timeout:g} s{suffix}", outcome
        )
    how = (
        f"crashed with {outcome.end.signal_name}"
        if outcome.end.signal_name
        else f"exited with code {outcome.end.exitcode}"
    )
    raise IsolationError(
        f"run_isolated({name}): the isolated process {how} (exit code {outcome.end.exitcode}) "
        f"without returning{suffix}",
        outcome,
    )
