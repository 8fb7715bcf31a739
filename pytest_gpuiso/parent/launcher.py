"""How an isolated test's process starts: spawn or the fork server, and its life until its run.

The ``Launcher`` owns every process it starts until that process's run has ended
(``finished``):

* each starts with ``spawn``, or is forked by the fork server its ``serving`` gives
  (``serving.Serving``: the start method in force, the fallback to ``spawn``, the
  notices said once, what tests taught the template);
* the fork server's answers, read in order and only when needed (``_settle``), so a
  prewarm fork costs the running test nothing;
* processes started ahead of their turn (``warm``), which import the preload modules
  and may collect their test's module before their go (``collect_ahead``; when to stop
  is the prewarmer's policy);
* discarding a process that will not run, the processes that are ours but no test's
  (``spare``), those left to the kernel's teardown (``leave``, ``reap_ending``), and
  closing it all at the session's end.

Nothing outside this module writes a launcher's state: the runner and the supervisor
ask it through these methods.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import multiprocessing
import os
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from ..child import bootstrap as child
from ..child import imports
from ..forkserver import ServerBoot, Unavailable
from ..leaks.process import Mark
from ..leaks.shm_log import dispose_created
from ..proc.proctree import (
    REAP_WAIT,
    Child,
    ensure_resource_tracker,
    exec_environment,
    kill_tree,
    main_not_rerun,
    reap,
    signal_group,
    unlist,
)
from ..proc.workdir import describe, owner, private_file, remove
from ..wire import frames, jobs
from ..wire.environment import LOG_ENV, OWNER_ENV
from . import leaving
from .serving import Serving
from .started import Started
from .watch import STACK_SIGNAL

_SERVER_WAIT = 300.0  # seconds the first fork may wait for the server to import everything
_RUNS = itertools.count(1)  # unique file tags within this process, whatever the Launcher


@dataclass(frozen=True)
class _Files:
    """A process's private files, and the environment it is exec'd with."""

    output: Path | None  # its stdout and stderr (None: not captured, as with -s)
    stack_file: Path  # where it dumps its stack when asked (a timeout)
    capture_prefix: Path  # pytest's global capture's files in it: PREFIX1, PREFIX2...
    shm_log: str | None  # what the /dev/shm shim saw it create (None: no shim)
    exec_env: dict[str, str]


class StartError(RuntimeError):
    """The child could not be started (e.g. the job could not be pickled)."""


class Launcher:
    """Starts jobs' processes, with files under ``workdir``, and keeps them until run."""

    def __init__(
        self,
        workdir: Path,
        *,
        capture_output: bool = True,
        start: str = "spawn",
        subreaper: bool = True,
        exec_env: dict[str, str] | None = None,
        server_boot: ServerBoot | None = None,
        shm_cleanup: bool = False,
        mark: Mark | None = None,
    ) -> None:
        """``subreaper``: this process is a child subreaper (the fork server relies on it);
        ``mark``: a call's (``run_isolated``): its processes carry it, and its sweep takes
        only them."""
        self.workdir = workdir
        self.capture_output = capture_output
        self.mark = mark
        self.exec_env = dict(exec_env or {})  # must be there at exec (LD_PRELOAD of a probe)
        # In all it starts, and all they start: ended by the next session if this one dies
        self.owner = {OWNER_ENV: owner(workdir)}
        # imported by the fork server, and by spawned processes started ahead of their turn
        self.preload = server_boot.preload if server_boot is not None else ()
        self.shm_cleanup = shm_cleanup  # what a discarded process created: deleted, else said
        self._told_shm_left = False
        self.live: dict[int, Started] = {}  # started children not yet run, by id()
        self.reaper = leaving.Reaper()  # tests' processes left while past their exit
        self._awaiting: collections.deque[Started] = collections.deque()  # fork answers due
        self._ctx = multiprocessing.get_context("spawn")
        self.serving = Serving(
            start, server_boot, workdir, {**self.exec_env, **self.owner}, self._ctx, subreaper
        )

    # ------------------------------------------------------------------ processes

    def start(
        self,
        job: Any,
        env: dict[str, str] | None = None,
        *,
        warm: bool = False,
        collect_ahead: bool = False,
    ) -> Started:
        """Start ``job``'s process; it runs up to its go and waits.

        ``env`` is applied first thing in the child. A ``warm`` child (prewarmed
        ahead of its turn) also imports the preload modules while it waits (the
        fork server has them already), and its fork may still be under way; spawned,
        it may also collect its test's module before its go (``collect_ahead``).
        ``StartError`` (one line) when it cannot: the job does not pickle, or a resource
        ran out (processes, descriptors, disk), which fails only the test that needed it.
        """
        tag = f"{os.getpid()}-{next(_RUNS)}"
        made: list[Any] = []  # files and pipes to undo if the start fails
        try:
            started = self._start(job, dict(env or {}), warm, collect_ahead, tag, made)
        except Exception as exc:
            remove(*[thing for thing in made if isinstance(thing, Path)])
            for conn in (thing for thing in made if not isinstance(thing, Path)):
                conn.close()  # a Connection or a Reader: closing it twice is harmless
            detail = describe(exc) if isinstance(exc, OSError) else str(exc)
            raise StartError(f"could not start the isolated process: {detail}") from exc
        self.live[id(started)] = started
        if not warm:
            self._settle(started)
            if started.failed is not None:  # refused: we use spawn from now on
                self.discard(started)
                return self.start(job, env)
        return started

    def ready(self, started: Started | None, job: Any, env: dict[str, str]) -> Started:
        """The process that runs ``job``: ``started`` (prewarmed) once its fork is in and it
        still waits; else a fresh one. The fork server could not fork it after all, or it
        died while it waited (killed by someone who cleans up processes): started afresh."""
        if started is not None:
            self._settle(started)
            if started.failed is None and not wait([started.sentinel], 0):
                return started
            self.discard(started)
        return self.start(job, env)

    def finished(self, started: Started, left: bool) -> None:
        """``started``'s run is over: reaped, or ``left`` to the kernel's teardown past its
        exit (its pidfd is then the launcher's, reaped later: ``reap_ending``)."""
        self.live.pop(id(started), None)
        if left:
            self.reaper.add(started.proc.pid, started.sentinel)
            started.sentinel = None
        else:
            reap(started.proc, started.sentinel)

    def reap_ending(self, patience: float = REAP_WAIT) -> None:
        """Reap the processes left past their exit that are gone by now."""
        self.reaper.reap(patience)

    def discard(self, started: Started) -> None:
        """Kill a child that will not run (its test is not next after all), reap it, tidy up."""
        if self.live.pop(id(started), None) is None:
            return  # already run or discarded: its pid may belong to someone else by now
        self._settle(started)
        if started.proc is not None:
            kill_tree(started.proc.pid)  # with the daemons it started (its subreaper's)
            signal_group(started.proc.pid, signal.SIGKILL)
            reap(started.proc, started.sentinel)
        started.close()
        shm_log = Path(started.shm_log) if started.shm_log else None
        left = dispose_created(str(shm_log), self.shm_cleanup) if shm_log else ""
        if left and not self._told_shm_left:  # what it created before its turn
            self._told_shm_left = True
            self.serving.notice(f"a process started ahead of its test and not used {left}")
        remove(started.output, started.stack_file, shm_log, *started.capture_files())

    def close(self) -> None:
        """Discard children that never got their go, and stop the fork server."""
        for started in list(self.live.values()):
            self.discard(started)
        self.serving.close()
        self.reaper.reap(REAP_WAIT)

    def spare(self, *, settle: bool = False) -> frozenset[int]:
        """Our processes that are not a test's leftovers: the server and waiting children.

        ``settle``: wait for pending fork answers first, so that every child counts.
        """
        self._settle(everything=settle)
        pids = {s.pid for s in self.live.values() if s.proc is not None} | self.reaper.reap()
        pids |= self.serving.pids()
        return frozenset(pids)

    def _settle(self, until: Started | None = None, *, everything: bool = False) -> None:
        """Read the fork server's answers that are in (or due: up to ``until``, or all)."""
        while self._awaiting:
            first = self._awaiting[0]
            server = self.serving.server
            must = everything or (until is not None and until in self._awaiting)
            if server is not None and not must and not server.conn.poll(0):
                return
            self._awaiting.popleft()  # first: an interrupted read must not shift the answers
            if server is None:
                kind, payload = "failed", "the fork server is gone"
            else:
                kind, payload = server.answer(_SERVER_WAIT)
            if kind == "forked":
                pid, source, first.uncollected = payload
                first.attach(Child(pid))
                first.collected = source == "template"
            else:
                first.failed = payload
                self.serving.fall_back(payload)

    def _preload(self, job: Any) -> tuple[str, ...]:
        """The preload modules a spawned process started ahead of ``job`` imports: those
        its test's module or its conftests import (a call's: all)."""
        if not isinstance(job, jobs.ItemJob):
            return self.preload
        module = Path(job.invocation_dir, job.collect_arg.split("::", 1)[0])
        return imports.needed(self.preload, module)

    def _start(
        self,
        job: Any,
        env: dict[str, str],
        warm: bool,
        collect_ahead: bool,
        tag: str,
        made: list[Any],
    ) -> Started:
        """``start``'s work; what it makes goes into ``made`` first, for ``start`` to undo."""
        files = self._files(tag, env, made)
        server = self.serving.server_to_fork()
        method = "forkserver" if server is not None else "spawn"
        spawned_warm = warm and method == "spawn"
        boot = jobs.Bootstrap(
            parent_pid=os.getpid(),
            output=str(files.output) if files.output else None,
            stack_file=str(files.stack_file),
            stack_signal=STACK_SIGNAL,
            spill_prefix=str(self.workdir / f"spill-{tag}-"),
            capture_prefix=str(files.capture_prefix),
            env=tuple(sorted(env.items())),
            preload=self._preload(job) if spawned_warm else (),
            collect_ahead=spawned_warm and collect_ahead,
        )
        pipe, writer = self._ctx.Pipe(duplex=False)
        made += [pipe, writer]
        reader = frames.Reader(pipe, self.workdir, f"spill-{tag}-")
        made.append(reader)
        go_reader, go_writer = self._ctx.Pipe(duplex=False)
        made += [go_reader, go_writer]
        started = Started(
            job=job,
            reader=reader,
            go=go_writer,
            method=method,
            output=files.output,
            stack_file=files.stack_file,
            capture_prefix=files.capture_prefix,
            created=time.time(),
            shm_log=files.shm_log,
            warm=warm,
        )
        # The tracker is a long-lived helper of ours, not something the test left behind.
        ensure_resource_tracker()
        try:
            if server is not None:
                self._request_fork(server, started, boot, job, [writer, go_reader])
            if started.method == "spawn":
                self._spawn(started, boot, job, [writer, go_reader], files.exec_env)
        finally:
            writer.close()
            go_reader.close()
        return started

    def _files(self, tag: str, env: dict[str, str], made: list[Any]) -> _Files:
        """The process's private files (in ``made``), and the environments it starts with:
        ``env`` (what a forked process applies) is completed here, like the exec's."""

        def private(name: str) -> Path:
            path = private_file(self.workdir, name)
            made.append(path)
            return path

        output = private(f"out-{tag}.log") if self.capture_output else None
        stack_file = private(f"stack-{tag}.txt")
        shm_log = None
        if self.exec_env:  # the shim is preloaded: it logs from the process's start on
            shm_log = str(private(f"shm-{tag}.log"))
            env[LOG_ENV] = shm_log
        exec_env = {**self.exec_env, **self.owner}
        env.update(self.owner)
        if self.mark is not None:  # in the block it is exec'd with, which its forks share
            exec_env.update(self.mark.env)
            env.update(self.mark.env)  # a forked child's os.environ: what its execs inherit
        return _Files(output, stack_file, self.workdir / f"cap-{tag}-", shm_log, exec_env)

    def _request_fork(
        self, server: Any, started: Started, boot: jobs.Bootstrap, job: Any, ends: list[Any]
    ) -> None:
        """Ask the fork server for ``started``'s process (its answer is read later:
        ``_settle``); where it is unavailable, ``started`` is spawned instead."""
        try:
            server.request_fork(boot, job, [end.fileno() for end in ends], _SERVER_WAIT)
            self._awaiting.append(started)
        except Unavailable as exc:
            self.serving.fall_back(str(exc))
            started.method = "spawn"

    def _spawn(
        self,
        started: Started,
        boot: jobs.Bootstrap,
        job: Any,
        ends: list[Any],
        exec_env: dict[str, str],
    ) -> None:
        proc = self._ctx.Process(target=child.main, args=(boot, job, *ends), daemon=False)
        # A test needs nothing of pytest's __main__; run_isolated's function may
        # live there (a script's), so only a call re-runs it, as multiprocessing does.
        keep_main = isinstance(job, jobs.CallJob)
        main = contextlib.nullcontext() if keep_main else main_not_rerun()
        with exec_environment(exec_env), main:
            proc.start()
        unlist(proc)
        started.attach(proc)
