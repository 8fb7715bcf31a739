"""What one isolated run produced: how its process started, how it ended and what it
left, and what it sent (its frames, decoded once)."""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..gpu.health import RunEnd
from ..leaks import Leak
from ..leaks.gpu_memory import left_on_gpus
from ..proc.workdir import read_end
from ..reports.record import Escaped
from ..wire import frames
from ..wire.payloads import ExceptionData, ExitData, Imported, Stale, TorchLeak, WarningData

OUTPUT_TAIL_LINES = 60  # lines of the process's own output shown with a failure
OUTPUT_TAIL_BYTES = 8192  # of a captured output file, read after a crash
OUTPUT_KEEP_BYTES = 1 << 20  # of what the child wrote outside pytest's capture


def signal_name(exitcode: int | None) -> str | None:
    """The name of the signal that ended a process of exit code ``exitcode`` (negative,
    as multiprocessing gives it), None when no signal did."""
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


@dataclass(frozen=True)
class SessionStop:
    """The test's ``pytest.exit()`` or Ctrl-C (a ``KeyboardInterrupt``): pytest's session
    ends after it too, as in-process (``runner.stop_session``)."""

    interrupt: bool  # Ctrl-C, or a KeyboardInterrupt the test raised
    message: str
    returncode: int | None = None  # pytest.exit(returncode=...)

    @classmethod
    def of(cls, payload: ExitData) -> SessionStop:
        """From an ``EXIT`` frame's payload (its shape checked by ``frames.check``)."""
        return cls(bool(payload["interrupt"]), str(payload["message"]), payload["returncode"])


@dataclass
class Launch:
    """How the test's process started, and how far its start-up got."""

    method: str = "spawn"  # how the process was started: spawn or forkserver
    prewarmed: bool = False  # started ahead of its turn (prewarm)
    collected: bool = False  # forked from the fork server's collected session
    uncollected: str | None = None  # why the fork server had no collected session to fork
    # From its frames, at any time (after a deadline too):
    bootstrapped: bool = False  # it finished its bootstrap (and could answer a stack-dump request)
    phase: str = ""  # what it said it was doing last while it started
    ahead: bool = False  # it collected its test's module before its go


@dataclass
class End:
    """How the test's process ended, and what it left (seen from pytest's side)."""

    pid: int
    exitcode: int | None
    # The bound that ran out, after which the process was stopped: "startup" (its test
    # never began), "test" (the test's timeout), "exit" (it did not end after its test)
    # or "group" (another process of its group ended: ``group.wait_group``); None: none.
    expired: str | None
    duration: float  # seconds from the go to the process's end
    began: float | None = None  # seconds from the go to the test's start (None: never)
    stack: str = ""
    why: str = ""  # expired "group": why the group was stopped ("rank 1 ended ...")
    output: str = ""  # what the child wrote to fds 1/2 outside pytest's capture
    leaks: list[Leak] = field(default_factory=list)  # process leaks first, then the probes'
    captured: list[str] = field(default_factory=list)  # tails of the test's captured output

    @property
    def gpu_left(self) -> dict[str, list[str]]:
        """Device -> what the GPU memory check found still on it."""
        return left_on_gpus(self.leaks)

    @property
    def timed_out(self) -> bool:
        """A bound ran out (start-up, test or exit) and the process was stopped for it."""
        return self.expired is not None

    @property
    def escaped(self) -> list[Escaped]:
        """Descendants still running after the test's process ended (then killed)."""
        return [
            Escaped(pid=leak.fields["pid"], cmdline=leak.fields["cmdline"])
            for leak in self.leaks
            if leak.kind == "process"
        ]

    @property
    def output_tail(self) -> str:
        return "\n".join(self.output.splitlines()[-OUTPUT_TAIL_LINES:])

    @property
    def signal_name(self) -> str | None:
        return signal_name(self.exitcode)


@dataclass
class Sent:
    """What the test's process sent, before the deadline where one ran out."""

    done: bool = False  # it said its job finished
    stale: Stale | None = None  # it could not take its GPUs (``child.Channel``)
    reports: list[dict[str, Any]] = field(default_factory=list)  # serialized pytest reports
    warnings: list[WarningData] = field(default_factory=list)
    junit: list[tuple[str, str | None, str, str]] = field(default_factory=list)
    torch_leaks: list[TorchLeak] = field(default_factory=list)
    driver: list[str] = field(default_factory=list)  # CUDA libraries loaded with no GPU
    imported: list[Imported] = field(default_factory=list)  # learnable imports
    fixtures: list[tuple[str, str]] = field(default_factory=list)  # broader than the test
    exits: list[SessionStop] = field(default_factory=list)  # pytest.exit() or Ctrl-C
    errors: list[str] = field(default_factory=list)
    results: list[bytes] = field(default_factory=list)  # run_isolated: the value, pickled
    exceptions: list[ExceptionData] = field(default_factory=list)  # run_isolated's raise
    payloads: list[dict[str, Any]] = field(default_factory=list)  # other plugins' data

    @property
    def interrupted(self) -> bool:
        """Ctrl-C (or a ``KeyboardInterrupt`` the test raised) ended the session in this test."""
        return any(stop.interrupt for stop in self.exits)


@dataclass
class Outcome:
    """What one isolated run produced (data only): how its process started (``launch``),
    how it ended (``end``) and what it sent (``sent``).

    The frames the process sent are decoded once, by ``decode``, into ``sent`` and the
    start-up marks of ``launch``; nothing else reads frames. After a timeout only what
    arrived before the deadline counts (``cutoff``), except what says how far its
    start-up got.
    """

    end: End
    launch: Launch = field(default_factory=Launch)
    sent: Sent = field(default_factory=Sent)

    def decode(self, received: list[tuple[str, Any]], cutoff: int | None = None) -> Outcome:
        """Take in the frames the process sent (``cutoff``: how many had arrived by the
        deadline); every kind has its handler here, and a kind without one is an error."""
        for at, (kind, payload) in enumerate(received):
            handler = _HANDLERS.get(kind)
            if handler is None:
                raise frames.FrameError(f"unknown frame kind {kind!r}")
            always, take = handler
            if always or cutoff is None or at < cutoff:
                take(self, payload)
        return self

    @property
    def finished(self) -> bool:
        """The child said it was done, in time, and exited normally."""
        return not self.end.timed_out and self.end.exitcode == 0 and self.sent.done

    def run_end(self) -> RunEnd:
        """How the run ended, as the GPU health probe reads it: plain data."""
        end = self.end
        return RunEnd(
            end.timed_out, end.signal_name, self.sent.errors, self.sent.reports, end.gpu_left
        )


def _set(part: str, name: str, value: Any = None) -> Callable[[Outcome, Any], None]:
    """A handler that sets a field of ``part`` (``launch`` or ``sent``): to ``value``, or
    to the payload."""
    return lambda outcome, payload: setattr(
        getattr(outcome, part), name, payload if value is None else value
    )


def _first(name: str) -> Callable[[Outcome, Any], None]:
    """A handler that keeps the first payload of its kind."""
    return lambda outcome, payload: (
        getattr(outcome.sent, name) or setattr(outcome.sent, name, payload)
    )


def _add(name: str) -> Callable[[Outcome, Any], None]:
    return lambda outcome, payload: getattr(outcome.sent, name).append(payload)


def _ignore(outcome: Outcome, payload: Any) -> None:
    """Heeded while the process runs (``watch``): its bounds' marks."""


# kind -> (taken after the deadline too, handler): the one dispatcher of the parent side
_HANDLERS: dict[str, tuple[bool, Callable[[Outcome, Any], None]]] = {
    frames.READY: (True, _set("launch", "bootstrapped", True)),
    frames.PHASE: (True, _set("launch", "phase")),
    frames.AHEAD: (True, _set("launch", "ahead", True)),
    frames.BEGIN: (True, _ignore),
    frames.END: (True, _ignore),
    frames.EXITING: (True, _ignore),
    frames.DONE: (False, _set("sent", "done", True)),
    frames.STALE: (False, _first("stale")),
    frames.REPORT: (False, _add("reports")),
    frames.WARNING: (False, _add("warnings")),
    frames.JUNIT: (False, _add("junit")),
    frames.TORCH_LEAK: (False, _add("torch_leaks")),
    frames.DRIVER: (False, _first("driver")),
    frames.IMPORTED: (False, _add("imported")),
    frames.FIXTURE: (False, _add("fixtures")),
    frames.EXIT: (
        False,
        lambda outcome, payload: outcome.sent.exits.append(SessionStop.of(payload)),
    ),
    frames.ERROR: (False, _add("errors")),
    frames.RESULT: (False, _add("results")),
    frames.EXCEPTION: (False, _add("exceptions")),
    frames.PAYLOAD: (False, _add("payloads")),
}


def read_output(path: Path) -> str:
    """What the child wrote outside capture; only the last ``OUTPUT_KEEP_BYTES`` if more."""
    text, size = read_end(path, OUTPUT_KEEP_BYTES)
    if size > OUTPUT_KEEP_BYTES:
        text = f"[{size - OUTPUT_KEEP_BYTES} earlier bytes not kept]\n" + text
    return text


def captured_tail(path: Path) -> str:
    """The last lines of the child's captured stdout/stderr."""
    text, _ = read_end(path, OUTPUT_TAIL_BYTES)
    return "\n".join(text.splitlines()[-OUTPUT_TAIL_LINES:])
