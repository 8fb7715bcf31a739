"""The session's use of the fork server: the start method in force, the server while it
serves, why it stopped serving, and what the tests taught its template.

``Serving`` starts the ``forkserver.ForkServer`` on first use (it loads while pytest
collects: ``start_server``, ``collect``); when the server cannot serve, the session
falls back to ``spawn`` for good and says why once (``fall_back``; the plugin reads
the notices through ``news``, with every other start problem the launcher or the
prewarmer has to tell: ``notice``). What a forked test imported goes to the server
(``pass_on_imports``), which has its template's successor import it for the tests
after it; ``taught`` names the module whose next tests are better forked again.
The ``Launcher`` asks it for the server to fork from (``server_to_fork``) and owns the
processes; nothing here starts a test's process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..forkserver import LEARN_WEIGHT, ForkServer, ServerBoot, module_of
from ..proc.proctree import ensure_resource_tracker, exec_environment
from ..proc.workdir import owner, private_file, process_dir

if TYPE_CHECKING:
    from ..wire.payloads import Imported

_LOGS = itertools.count(1)  # unique log names within this process, whatever the Serving


def prestart(shm_shim: bool) -> None:
    """Start the fork server's interpreter now, before pytest's conftests load (best effort:
    else it starts at ``pytest_sessionstart``), exec'd as ``start_server`` would exec it:
    with the shim preloaded where the /dev/shm leak checks are on (``shm_shim``), and with
    this session's owner mark (the next session finds what it and its forks left, from
    the environment they were exec'd with)."""
    import multiprocessing

    from ..forkserver import prestart as start_early
    from ..leaks.shm_log import preload_env
    from ..wire.environment import OWNER_ENV

    with contextlib.suppress(Exception):
        env = {**(preload_env() if shm_shim else {}), OWNER_ENV: owner(process_dir())}
        start_early(multiprocessing.get_context("spawn"), env)


class Serving:
    """How the session's processes start: ``method`` (``spawn`` or ``forkserver``), and
    the fork server once started (None: not yet, or never again)."""

    def __init__(
        self,
        start: str,
        boot: ServerBoot | None,
        workdir: Path,
        exec_env: dict[str, str],
        ctx: Any,
        subreaper: bool = True,
    ) -> None:
        """``boot``: the server's (None: spawn only); ``exec_env``: what it, and so every
        process forked from it, is exec'd with; ``subreaper``: this process is a child
        subreaper, which the fork server relies on."""
        self.method = start
        self.boot = boot
        self.workdir = workdir
        self.exec_env = exec_env
        self.ctx = ctx
        self.server: ForkServer | None = None
        self.notices: list[str] = []  # start problems, for the plugin to show once
        self._told = 0  # how many of the notices ``news`` has handed out
        self._taught: str | None = None  # see ``taught``
        if start == "forkserver" and not subreaper:
            self.fall_back("the fork server needs PR_SET_CHILD_SUBREAPER (Linux)")

    def start_server(self) -> None:
        """Start the fork server now, if the session forks and it is not started."""
        if self.method == "forkserver" and self.server is None and self.boot:
            try:
                os.close(os.pidfd_open(os.getpid()))
            except (AttributeError, OSError) as exc:
                self.fall_back(f"the fork server needs pidfd_open (Linux 5.3+): {exc}")
                return
            log = private_file(self.workdir, f"forkserver-{next(_LOGS)}.log")
            boot = dataclasses.replace(self.boot, log=str(log))
            ensure_resource_tracker()
            try:
                with exec_environment(self.exec_env):  # its forks' too
                    self.server = ForkServer(self.ctx, boot)
            except Exception as exc:
                self.fall_back(f"the fork server could not be started: {exc}")

    def server_to_fork(self) -> ForkServer | None:
        """The server a test's process is forked by (started on first use); None: spawn."""
        if self.method == "forkserver":
            self.start_server()
        return self.server

    def collect(
        self, directories: list[str], modules: list[str], initial: tuple[str, ...] = ()
    ) -> None:
        """Have the fork server load the conftests of ``directories`` and collect
        ``modules`` (its template's session), when there is a server; ``initial``: the
        paths pytest's session started from."""
        if self.server is not None:
            self.server.collect(directories, modules, initial)

    def fall_back(self, reason: str) -> None:
        """The server cannot serve (``reason``): spawn from now on, said once."""
        if self.method != "spawn":
            self.notices.append(
                f"{reason}; isolated tests are started with spawn instead "
                "(--gpu-isolate-start=spawn chooses it from the start)"
            )
        self.method = "spawn"
        if self.server is not None:
            self.server.close()
            self.server = None

    def notice(self, text: str) -> None:
        """A problem of the session's starts, for the plugin to show once."""
        self.notices.append(text)

    def news(self) -> list[str]:
        """The notices not handed out yet."""
        fresh, self._told = self.notices[self._told :], len(self.notices)
        return fresh

    def pass_on_imports(self, imported: list[Imported], nodeid: str, took: float) -> None:
        """What a forked test (``nodeid``, its process ran ``took`` seconds) imported: the
        template imports it for the next ones; once that is worth a successor of its own,
        the module's next tests are forked from that successor (``taught``)."""
        if self.server is not None:
            for learnt in imported:
                sent = self.server.send_imports(learnt["names"], learnt["modules"], nodeid, took)
                if sent and learnt["modules"] >= LEARN_WEIGHT:
                    self._taught = module_of(nodeid)

    def taught(self) -> str | None:
        """The module (path) of the last test that taught the template enough to start a
        successor since this was asked: the processes started ahead for its next tests
        are better started again (``Prewarmer.restart``): the server holds them until
        the successor has imported what they will most likely import too."""
        taught, self._taught = self._taught, None
        return taught

    def pids(self) -> set[int]:
        """The server's and its template's pids (ours, never a test's leftovers)."""
        if self.server is None:
            return set()
        pids = {self.server.pid}
        if self.server.template_pid is not None:
            pids.add(self.server.template_pid)
        return pids

    def close(self) -> None:
        """Stop the fork server: it kills its template on its way out, and reaps both."""
        if self.server is not None:
            self.server.close()
            self.server = None
