"""Start the next isolated tests' processes while the current one runs.

A process started ahead of its test's turn bootstraps, imports the preload
modules, parses the configuration, configures pytest and collects its test's
module, then waits for its go (``child.Channel.wait_go``). Its start-up
overlaps the test before it (and the wait for a GPU), and it still runs exactly
one test. Which tests come next: pytest hands ``nextitem`` to
``pytest_runtest_protocol``; without xdist the session's item list says what
follows it, so up to ``depth`` processes warm at once. Under xdist only
``nextitem`` is known (the scheduler decides the rest).

Until its go, a prewarmed process of a test that gets GPUs sees none
(``CUDA_VISIBLE_DEVICES=""``): its GPUs are only known once leased. If plugin or
conftest code initialises CUDA at import anyway (or reads ``CUDA_VISIBLE_DEVICES``),
the process cannot switch to its GPUs; it says so at its go, a fresh one runs the
test, and prewarming stops for the session (``disabled``), which the plugin reports
once. If the test module's import did it, prewarmed processes only stop collecting
ahead (``Supervisor.collect_ahead``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .supervisor import Started, StartError, Supervisor

HIDDEN_GPUS = {"CUDA_VISIBLE_DEVICES": ""}  # until the go, a prewarmed process sees no GPU


class Prewarmer:
    """Keeps up to ``depth`` processes started for the tests that come next."""

    def __init__(self, supervisor: Supervisor, depth: int) -> None:
        self.supervisor = supervisor
        self.depth = depth
        self.warm: dict[str, Started] = {}  # by node id
        self.disabled: str | None = None

    def take(self, nodeid: str) -> Started | None:
        """The process started for this test, if there is one."""
        return self.warm.pop(nodeid, None)

    def refill(
        self, upcoming: list[str], prepare: Callable[[str], tuple[Any, dict[str, str]] | None]
    ) -> None:
        """Have processes started for the ``upcoming`` node ids, and only for them.

        ``prepare(nodeid)`` gives the job and the start environment, or None when
        that test will not run in a process (skipped, bad marker).
        """
        if self.disabled is not None:
            return
        wanted = upcoming[: self.depth]
        for nodeid in list(self.warm):
            if nodeid not in wanted:
                self.supervisor.discard(self.warm.pop(nodeid))
        for nodeid in wanted:
            if nodeid in self.warm:
                continue
            prepared = prepare(nodeid)
            if prepared is None:
                continue
            job, env = prepared
            try:
                self.warm[nodeid] = self.supervisor.start(job, env, warm=True)
            except StartError:
                return  # the test's own run will report it

    def disable(self, reason: str) -> None:
        self.disabled = reason
        self.close()

    def close(self) -> None:
        for started in self.warm.values():
            self.supervisor.discard(started)
        self.warm.clear()
