"""A test's (or a call's) process once started, waiting for its go: its pipes and files."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ..proc.proctree import pidfd
from ..wire import frames


@dataclass(eq=False)
class Started:
    """A started child, waiting for its go (prewarmed, or about to be run)."""

    job: Any
    reader: frames.Reader  # frames from the child
    go: Connection  # the go (and its environment) to the child; open until it ended
    method: str
    output: Path | None
    stack_file: Path
    capture_prefix: Path
    created: float = 0.0  # time.time() when it was started
    shm_log: str | None = None  # the /dev/shm shim's log, given to the child at its start
    warm: bool = False  # started ahead of its turn (prewarmed, or while its GPUs were awaited)
    # multiprocessing's Process (spawn) or a ``Forked``; None until the fork server answers
    proc: Any = None
    sentinel: Any = None  # readable once the child has exited
    failed: str | None = None  # the fork server could not fork it
    collected: bool = False  # forked from the fork server's collected session (template)
    uncollected: str | None = None  # why it was not, when the template gave up

    @property
    def pid(self) -> int:
        return self.proc.pid

    def attach(self, proc: Any) -> None:
        self.proc = proc
        fd = pidfd(proc.pid)
        self.sentinel = proc.sentinel if fd is None else fd

    def close(self) -> None:
        """Close our ends of the pipes and the pidfd."""
        for conn in (self.reader, self.go):
            conn.close()
        if isinstance(self.sentinel, int):
            with contextlib.suppress(OSError):
                os.close(self.sentinel)
        self.sentinel = None

    def capture_files(self) -> list[Path]:
        """The files pytest captured the test's output into, in order."""
        prefix = self.capture_prefix
        return sorted(
            prefix.parent.glob(prefix.name + "*"), key=lambda p: int(p.name.rsplit("-", 1)[1])
        )
