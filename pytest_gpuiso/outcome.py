"""What one isolated run produced: the frames, how the process ended, what it left."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import frames
from .leaks import Leak
from .workdir import read_end

OUTPUT_TAIL_LINES = 60  # lines of the process's own output shown with a failure
OUTPUT_TAIL_BYTES = 8192  # of a captured output file, read after a crash
OUTPUT_KEEP_BYTES = 1 << 20  # of what the child wrote outside pytest's capture


@dataclass
class Outcome:
    """What one isolated run produced and how the child ended (data only)."""

    frames: list[tuple[str, Any]]
    pid: int
    exitcode: int | None
    # The bound that ran out, after which the process was stopped: "startup" (its test
    # never began), "test" (the test's timeout) or "exit" (it did not end after its
    # test); None: none did.
    expired: str | None
    duration: float  # seconds from the go to the process's end
    began: float | None = None  # seconds from the go to the test's start (None: never)
    stack: str = ""
    output: str = ""  # what the child wrote to fds 1/2 outside pytest's capture
    leaks: list[Leak] = field(default_factory=list)  # process leaks first, then the probes'
    cutoff: int | None = None  # on timeout: how many frames had arrived by the deadline
    captured: list[str] = field(default_factory=list)  # tails of the test's captured output
    method: str = "spawn"  # how the process was started: spawn or forkserver
    prewarmed: bool = False  # started ahead of its turn (prewarm)
    collected: bool = False  # forked from the fork server's collected session
    uncollected: str | None = None  # why the fork server had no collected session to fork

    @property
    def timed_out(self) -> bool:
        """A bound ran out (start-up, test or exit) and the process was stopped for it."""
        return self.expired is not None

    @property
    def phase(self) -> str:
        """What the process said it was doing last while it started ("" before it said)."""
        said = [payload for kind, payload in self.frames if kind == frames.PHASE]
        return said[-1] if said else ""

    @property
    def escaped(self) -> list[dict[str, Any]]:
        """Descendants still running after the test's process ended (then killed)."""
        return [
            {"pid": leak.fields["pid"], "cmdline": leak.fields["cmdline"]}
            for leak in self.leaks
            if leak.kind == "process"
        ]

    @property
    def output_tail(self) -> str:
        return "\n".join(self.output.splitlines()[-OUTPUT_TAIL_LINES:])

    @property
    def finished(self) -> bool:
        """The child said it was done, in time, and exited normally."""
        return not self.timed_out and self.exitcode == 0 and bool(self.frames_of(frames.DONE))

    @property
    def bootstrapped(self) -> bool:
        """The child finished its bootstrap (and could answer a stack-dump request)."""
        return any(kind == frames.READY for kind, _ in self.frames)

    @property
    def frames_in_time(self) -> list[tuple[str, Any]]:
        """Frames that arrived before the deadline; a timed-out test's later reports don't count."""
        return self.frames if self.cutoff is None else self.frames[: self.cutoff]

    @property
    def signal_name(self) -> str | None:
        if self.exitcode is None or self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    @property
    def interrupted(self) -> bool:
        """Ctrl-C (or a ``KeyboardInterrupt`` the test raised) ended the session in this test."""
        return any(stop.get("interrupt") for stop in self.frames_of(frames.EXIT))

    def frames_of(self, kind: str) -> list[Any]:
        """Payloads of one kind; after a timeout, only what arrived before the deadline."""
        if kind not in frames.KINDS:
            raise frames.FrameError(f"unknown frame kind {kind!r}")
        return [payload for k, payload in self.frames_in_time if k == kind]


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
