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
test, and prewarming stops for the session (``stale``, then ``disabled``), which the
plugin reports once. If the test module's import did it, prewarmed processes only stop
collecting ahead (``collect_ahead``). That policy is the prewarmer's (``replaced``);
the launcher only starts what it is asked to.

A waiting process killed by someone else (a test or a tool that kills its user's
processes) is the plugin's loss, never its test's: found dead at its turn, a fresh one
is started (``Launcher.ready``); dead before it read its go, another runs the test
(``supervisor.Running.unstarted``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..child import bootstrap as child
from ..forkserver import module_of
from .launcher import Launcher, StartError
from .started import Started

if TYPE_CHECKING:
    from ..wire.payloads import Stale

HIDDEN_GPUS = {"CUDA_VISIBLE_DEVICES": ""}  # until the go, a prewarmed process sees no GPU
LOOKAHEAD = 64  # items scanned past nextitem for the next isolated ones


@dataclass(frozen=True)
class WarmJob:
    """What a test's process is started with ahead of its turn: its job and the
    environment it starts with (built once per test, with the test's plan)."""

    nodeid: str
    job: Any
    env: dict[str, str]


class Prewarmer:
    """Keeps up to ``depth`` processes started for the tests that come next."""

    def __init__(self, launcher: Launcher, depth: int) -> None:
        self.launcher = launcher
        self.depth = depth
        self.warm: dict[str, tuple[WarmJob, Started]] = {}  # by node id: job and process
        self.disabled: str | None = None
        # Why a prewarmed process had to be replaced, once seen (``child.Channel._stale``):
        # its plugins or conftests touched CUDA (prewarming is turned off) ...
        self.stale: str | None = None
        # ... or its test module did: prewarmed processes then stop collecting ahead.
        self.collect_ahead = True
        self._positions: dict[int, int] | None = None  # id(item) -> its index in the session

    def following(self, items: Sequence[Any], nextitem: Any, parallel: bool) -> list[Any]:
        """The items that may come next, ``nextitem`` first: the session's following
        ``LOOKAHEAD`` items; under xdist (``parallel``) only ``nextitem`` is known."""
        if nextitem is None:
            return []
        if not parallel:
            if self._positions is None:
                self._positions = {id(it): i for i, it in enumerate(items)}
            at = self._positions.get(id(nextitem))
            if at is not None:
                return list(items[at : at + LOOKAHEAD])
        return [nextitem]

    def replaced(self, why: Stale) -> None:
        """A prewarmed process could not take its GPUs (``why``: ``child.Channel._stale``):
        say so once, and stop prewarming (plugins, conftests) or collecting ahead."""
        if why["module"] is None:
            if self.stale is None:
                self.stale = why["cuda"] or why["read"]  # the runner turns prewarming off
                self.launcher.serving.notice(child.stale_notice(why))
        elif self.collect_ahead:
            self.collect_ahead = False
            self.launcher.serving.notice(child.stale_notice(why))

    def take(self, nodeid: str) -> Started | None:
        """The process started for this test, if there is one."""
        warm = self.warm.pop(nodeid, None)
        return warm[1] if warm is not None else None

    def restart(self, module: str) -> None:
        """Start again the forked processes waiting for tests of ``module`` (a path): a
        test of it taught the fork server's template modules that its next tests will
        most likely import too (``Launcher.taught``), and the server holds their forks
        until its successor has them."""
        for nodeid, (job, started) in list(self.warm.items()):
            if started.method == "forkserver" and module_of(nodeid) == module:
                del self.warm[nodeid]
                self.launcher.discard(started)
                self._start(job)

    def refill(self, upcoming: list[WarmJob]) -> None:
        """Have processes started for the ``upcoming`` tests (those that will run in a
        process, in order), and only for the first ``depth`` of them."""
        if self.disabled is not None:
            return
        wanted = {job.nodeid: job for job in upcoming[: self.depth]}
        for nodeid in list(self.warm):
            if nodeid not in wanted:
                self.launcher.discard(self.warm.pop(nodeid)[1])
        for nodeid, job in wanted.items():
            if nodeid not in self.warm and not self._start(job):
                return  # the test's own run will report it

    def start_waiting(self, job: Any) -> Started | None:
        """Start a test's process while it waits for its lease, as prewarming does (it
        sees no GPU until its go); None when prewarming is off, or when it cannot be
        started (its run starts it again, and says why)."""
        return self._launch(job, dict(HIDDEN_GPUS)) if self.disabled is None else None

    def _start(self, job: WarmJob) -> bool:
        """Start ``job``'s process ahead of its turn; False when it could not be started."""
        started = self._launch(job.job, job.env)
        if started is not None:
            self.warm[job.nodeid] = (job, started)
        return started is not None

    def _launch(self, job: Any, env: dict[str, str]) -> Started | None:
        """One process started ahead of its turn, under this policy (``collect_ahead``);
        None when it could not be started."""
        try:
            return self.launcher.start(job, env, warm=True, collect_ahead=self.collect_ahead)
        except StartError:
            return None

    def disable(self, reason: str) -> None:
        self.disabled = reason
        self.close()

    def close(self) -> None:
        for _, started in self.warm.values():
            self.launcher.discard(started)
        self.warm.clear()
