"""Parent side of one isolated run: start the child, give its go, watch, reap, sweep.

``Supervisor.run`` starts the child (or takes its prewarmed one), gives it its go,
has ``watch.Watch`` read its frames under the three bounds (start-up, the test's
timeout, exit) and stop it past one (stack dump, SIGTERM, grace, SIGKILL), then
reaps it and sweeps the descendants that escaped its process group: this process
is a child subreaper, so double-forked or ``setsid`` orphans of the test are
re-parented here, where ``psutil`` finds them (``leaks.process``).

Leak probes (``leaks/``) take their snapshot just before the child gets its go
(it may have been started earlier: prewarmed) and check once the child and its
descendants are gone; the process probe is the sweep itself and always runs. A
test's process that says it is exiting, is past its exit and left no process is
not waited for while the kernel tears it down (``leaving``): reaped later.

The parent waits on the pipe and on a pidfd of the child together with
``multiprocessing.connection.wait``; it never sleep-polls while the child runs.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from . import child, frames, imports, leaving
from .dead_sessions import OWNER_ENV
from .forkserver import ForkServer, ServerBoot, Unavailable
from .leaks import Leak, Probe, RunInfo
from .leaks.process import Mark, ProcessProbe
from .leaks.shm import LOG_ENV, dispose_created
from .outcome import Outcome, captured_tail, read_output
from .proctree import (
    REAP_WAIT,
    Child,
    children,
    descendant_keys,
    ensure_resource_tracker,
    exec_environment,
    kill_tree,
    main_not_rerun,
    reap,
    signal_group,
    unlist,
)
from .settings import DEFAULT_STARTUP_TIMEOUT
from .started import Started
from .watch import STACK_SIGNAL, Watch
from .workdir import describe, private_file, remove

_SERVER_WAIT = 300.0  # seconds the first fork may wait for the server to import everything


_RUNS = itertools.count(1)  # unique file tags within this process, whatever the Supervisor


class StartError(RuntimeError):
    """The child could not be started (e.g. the job could not be pickled)."""


class Supervisor:
    """Runs jobs in fresh processes, one at a time, with files under ``workdir``.

    ``start="forkserver"`` forks them from a ``forkserver.ForkServer`` (started on
    first use); when it cannot serve, the supervisor falls back to ``spawn`` for
    good and says why once in ``notices``. Fork requests are answered in order
    and read only when needed, so a prewarm fork costs the running test nothing.
    """

    # A call's (run_isolated): its processes carry it, and its sweep takes only them.
    mark: Mark | None = None

    def __init__(
        self,
        workdir: Path,
        *,
        capture_output: bool = True,
        start: str = "spawn",
        exec_env: dict[str, str] | None = None,
        server_boot: ServerBoot | None = None,
        shm_cleanup: bool = False,
    ) -> None:
        self.workdir = workdir
        self.capture_output = capture_output
        self.method = start
        self.exec_env = dict(exec_env or {})  # must be there at exec (LD_PRELOAD of a probe)
        # In all it starts, and all they start: ended by the next session if this one dies
        self.owner = {OWNER_ENV: workdir.name}
        self.server_boot = server_boot  # None: no fork server (spawn only)
        # imported by the fork server, and by spawned processes started ahead of their turn
        self.preload = server_boot.preload if server_boot is not None else ()
        self.server: ForkServer | None = None
        self.notices: list[str] = []  # start-method problems, for the plugin to show once
        self.shm_cleanup = shm_cleanup  # what a discarded process created: deleted, else said
        self._told_shm_left = False
        # Why a prewarmed child had to be replaced, once seen (``child.Channel._stale``):
        # its plugins or conftests touched CUDA (prewarming is turned off) ...
        self.stale: str | None = None
        # ... or its test module did: prewarmed processes then stop collecting ahead.
        self.collect_ahead = True
        self.live: dict[int, Started] = {}  # started children not yet reaped, by id()
        self.ending = leaving.Ending()  # tests' processes left while past their exit
        self._awaiting: collections.deque[Started] = collections.deque()  # fork answers due
        self._ctx = multiprocessing.get_context("spawn")

    def start_server(self) -> None:
        """Start the fork server now (it loads while pytest collects)."""
        if self.method == "forkserver" and self.server is None and self.server_boot:
            try:
                os.close(os.pidfd_open(os.getpid()))
            except (AttributeError, OSError) as exc:
                self._fall_back(f"the fork server needs pidfd_open (Linux 5.3+): {exc}")
                return
            log = private_file(self.workdir, f"forkserver-{next(_RUNS)}.log")
            boot = dataclasses.replace(self.server_boot, log=str(log))
            ensure_resource_tracker()
            try:
                with exec_environment({**self.exec_env, **self.owner}):  # its forks' too
                    self.server = ForkServer(self._ctx, boot)
            except Exception as exc:
                self._fall_back(f"the fork server could not be started: {exc}")

    def _preload(self, job: Any) -> tuple[str, ...]:
        """The preload modules a spawned process started ahead of ``job`` imports: those
        its test's module or its conftests import (a call's: all)."""
        if not isinstance(job, child.ItemJob):
            return self.preload
        module = Path(job.invocation_dir, job.collect_arg.split("::", 1)[0])
        return imports.needed(self.preload, module)

    def _fall_back(self, reason: str) -> None:
        if self.method != "spawn":
            self.notices.append(f"{reason}; isolated tests are started with spawn instead")
        self.method = "spawn"
        if self.server is not None:
            self.server.close()
            self.server = None

    def _settle(self, until: Started | None = None, *, everything: bool = False) -> None:
        """Read the fork server's answers that are in (or due: up to ``until``, or all)."""
        while self._awaiting:
            first = self._awaiting[0]
            server = self.server
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
                self._fall_back(payload)

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
            self.notices.append(f"a process started ahead of its test and not used {left}")
        remove(started.output, started.stack_file, shm_log, *started.capture_files())

    def close(self) -> None:
        """Discard children that never got their go, and stop the fork server."""
        for started in list(self.live.values()):
            self.discard(started)
        if self.server is not None:
            self.server.close()  # it kills its template on its way out, and reaps both
            self.server = None
        self.ending.reap(REAP_WAIT)

    def spare(self, *, settle: bool = False) -> frozenset[int]:
        """Our processes that are not a test's leftovers: the server and waiting children.

        ``settle``: wait for pending fork answers first, so that every child counts.
        """
        self._settle(everything=settle)
        pids = {s.pid for s in self.live.values() if s.proc is not None} | self.ending.reap()
        if self.server is not None:
            pids.add(self.server.pid)
            if self.server.template_pid is not None:
                pids.add(self.server.template_pid)
        return frozenset(pids)

    def start(self, job: Any, env: dict[str, str] | None = None, *, warm: bool = False) -> Started:
        """Start ``job``'s process; it runs up to its go and waits.

        ``env`` is applied first thing in the child. A ``warm`` child (prewarmed
        ahead of its turn) also imports the preload modules while it waits (the
        fork server has them already), and its fork may still be under way.
        ``StartError`` (one line) when it cannot: the job does not pickle, or a resource
        ran out (processes, descriptors, disk), which fails only the test that needed it.
        """
        tag = f"{os.getpid()}-{next(_RUNS)}"
        made: list[Any] = []  # files and pipes to undo if the start fails
        try:
            started = self._start(job, dict(env or {}), warm, tag, made)
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

    def _start(
        self, job: Any, env: dict[str, str], warm: bool, tag: str, made: list[Any]
    ) -> Started:
        """``start``'s work; what it makes goes into ``made`` first, for ``start`` to undo."""

        def private(name: str) -> Path:
            path = private_file(self.workdir, name)
            made.append(path)
            return path

        output = private(f"out-{tag}.log") if self.capture_output else None
        stack_file = private(f"stack-{tag}.txt")
        capture_prefix = self.workdir / f"cap-{tag}-"
        if self.method == "forkserver":
            self.start_server()
        method = "forkserver" if self.server is not None else "spawn"
        shm_log = None
        if self.exec_env:  # the shim is preloaded: it logs from the process's start on
            shm_log = str(private(f"shm-{tag}.log"))
            env[LOG_ENV] = shm_log
        exec_env = {**self.exec_env, **self.owner}
        env.update(self.owner)
        if self.mark is not None:  # in the block it is exec'd with, which its forks share
            exec_env.update(self.mark.env)
            env.update(self.mark.env)  # a forked child's os.environ: what its execs inherit
        boot = child.Bootstrap(
            parent_pid=os.getpid(),
            output=str(output) if output else None,
            stack_file=str(stack_file),
            stack_signal=STACK_SIGNAL,
            spill_prefix=str(self.workdir / f"spill-{tag}-"),
            capture_prefix=str(capture_prefix),
            env=tuple(sorted(env.items())),
            preload=self._preload(job) if warm and method == "spawn" else (),
            collect_ahead=warm and method == "spawn" and self.collect_ahead,
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
            output=output,
            stack_file=stack_file,
            capture_prefix=capture_prefix,
            created=time.time(),
            shm_log=shm_log,
        )
        # The tracker is a long-lived helper of ours, not something the test left behind.
        ensure_resource_tracker()
        try:
            if self.server is not None:
                try:
                    fds = [writer.fileno(), go_reader.fileno()]
                    self.server.request_fork(boot, job, fds, _SERVER_WAIT)
                    self._awaiting.append(started)
                except Unavailable as exc:
                    self._fall_back(str(exc))
                    started.method = "spawn"
            if started.method == "spawn":
                proc = self._ctx.Process(
                    target=child.main, args=(boot, job, writer, go_reader), daemon=False
                )
                # A test needs nothing of pytest's __main__; run_isolated's function may
                # live there (a script's), so only a call re-runs it, as multiprocessing does.
                keep_main = isinstance(job, child.CallJob)
                main = contextlib.nullcontext() if keep_main else main_not_rerun()
                with exec_environment(exec_env), main:
                    proc.start()
                unlist(proc)
                started.attach(proc)
        finally:
            writer.close()
            go_reader.close()
        return started

    def run(
        self,
        job: Any,
        *,
        timeout: float | None,
        grace: float,
        startup: float = DEFAULT_STARTUP_TIMEOUT,
        env: dict[str, str] | None = None,
        probes: tuple[Probe, ...] = (),
        started: Started | None = None,
        after_go: Callable[[], None] | None = None,
    ) -> Outcome:
        """Run ``job`` (an object with ``run(channel, boot)``) in a fresh process.

        ``started``: the job's prewarmed process, if there is one. ``probes`` are
        leak checks besides the process sweep, which always runs. ``timeout``
        bounds the test (or call) itself, from when the child says it begins;
        ``startup`` bounds what comes before it from the go, and the process's
        exit after it (``_wait``). ``after_go()`` is called once the child has its
        go (while it runs).
        """
        if started is not None:
            self._settle(started)
            # The fork server could not fork it after all, or it died while it waited
            # (killed by someone who cleans up processes): its test starts afresh.
            if started.failed is not None or wait([started.sentinel], 0):
                self.discard(started)
                started = None
        prewarmed = started is not None
        if started is None:
            started = self.start(job, env)
        how = dict(timeout=timeout, grace=grace, startup=startup, env=env, probes=probes)
        outcome = self._run(started, after_go=after_go, **how)
        stale = outcome.frames_of(frames.STALE)
        if stale:  # it initialised CUDA before it knew its GPUs: run a fresh one
            self._replaced(stale[0])
            prewarmed = False
            outcome = self._run(self.start(job, env), **how)
        if self.server is not None and outcome.method == "forkserver":
            for learnt in outcome.frames_of(frames.IMPORTED):  # the template imports them
                self.server.learn(learnt["names"], learnt["modules"])
        outcome.prewarmed = prewarmed
        return outcome

    def _leave(
        self, started: Started, probes: tuple[Probe, ...], before: set[tuple[int, float]]
    ) -> Callable[[], bool] | None:
        """Whether a test's process that says ``EXITING`` may be left to the kernel's
        teardown (``leaving``): None where it never may, else the check, for ``Watch``."""
        proc = started.proc
        if not (
            isinstance(proc, Child)
            and isinstance(started.sentinel, int)  # its pidfd, for the reaping later
            and hasattr(os, "P_PIDFD")
            and isinstance(started.job, child.ItemJob)
            and self.mark is None
            and all(probe.kind in ("process", "shm") for probe in probes)
        ):
            return None

        def leave() -> bool:
            status = leaving.ended(proc.pid)
            if status is None or children(proc.pid):  # its children first: see leaving
                return False
            spare = self.spare(settle=True) - {proc.pid}
            if any(pid != proc.pid for pid, _ in descendant_keys(spare) - before):
                return False  # it left a process: the sweep waits for its end, as ever
            proc.exitcode = status
            return True

        return leave

    def _replaced(self, why: dict[str, Any]) -> None:
        """A prewarmed child could not take its GPUs (``why``: ``child.Channel._stale``):
        say so once, and stop prewarming (plugins, conftests) or collecting ahead."""
        if why["module"] is None:
            if self.stale is None:
                self.stale = why["cuda"] or why["read"]  # the plugin turns prewarming off
                self.notices.append(child.stale_notice(why))
        elif self.collect_ahead:
            self.collect_ahead = False
            self.notices.append(child.stale_notice(why))

    def _run(
        self,
        started: Started,
        *,
        timeout: float | None,
        grace: float,
        startup: float,
        env: dict[str, str] | None,
        probes: tuple[Probe, ...],
        after_go: Callable[[], None] | None = None,
    ) -> Outcome:
        proc, reader, sentinel = started.proc, started.reader, started.sentinel
        # The test's own process is spared in the snapshot: what it started before its go
        # (plugins, conftests) is then new, and swept with the rest of its tree.
        sweep = ProcessProbe(spare=self.spare(), mark=self.mark)
        probes = (sweep, *probes)
        for probe in probes:
            use_log = getattr(probe, "use_log", None)
            if use_log is not None and started.shm_log is not None:
                use_log(started.shm_log)
        snapshots = [probe.snapshot() for probe in probes]
        go_env = dict(env or {})
        for probe in probes:
            go_env.update(getattr(probe, "child_env", {}))
        go_at = time.monotonic()
        with contextlib.suppress(OSError):  # a child that already died has no use for it
            started.go.send(go_env)
        started.go.close()
        for probe in probes:  # probes that sample while the test runs (GPU memory's peak)
            if (watch := getattr(probe, "watch", None)) is not None:
                watch(proc.pid)
        if after_go is not None:
            try:
                after_go()
            except Exception as exc:  # prewarming the next test must not cost this one
                self.notices.append(f"prewarming failed: {exc}")
        watched = Watch(proc, reader, sentinel, started.stack_file)
        interrupted = False
        try:
            watched.run(go_at, timeout, startup, grace, self._leave(started, probes, snapshots[0]))
        except BaseException as exc:  # Ctrl-C: take the child's tree down before leaving
            interrupted = True
            watched.escalate(min(grace, 1.0))
            if not (isinstance(exc, KeyboardInterrupt) and isinstance(started.job, child.ItemJob)):
                raise  # a test's Ctrl-C is its outcome; run_isolated's caller gets its own
        finally:
            duration = time.monotonic() - go_at
            if watched.left:  # past its exit: the kernel tears it down while we go on
                self.ending.add(proc.pid, sentinel)
                started.sentinel = None  # the pidfd is the reaper's now
            else:
                reap(proc, sentinel)
            self.live.pop(id(started), None)
            sweep.spare = self.spare(settle=True)  # children forked during the test included
            run = RunInfo(proc.pid, started.created, time.time(), grace, frozenset({proc.pid}))
            leaks: list[Leak] = []
            # Interrupted: the sweep, which must never be skipped, and what the test left
            # in /dev/shm; not the GPU memory, which its killed tree may still be releasing.
            checks = list(zip(probes, snapshots, strict=True))
            for probe, before in checks:
                if interrupted and probe.kind not in ("process", "shm"):
                    continue
                if watched.left and probe is sweep:
                    continue  # leave() listed our descendants once the process was past its exit
                found = probe.check(before, run)
                leaks += found
                pids = {leak.fields["pid"] for leak in found if leak.kind == "process"}
                run = dataclasses.replace(run, tree_pids=run.tree_pids | pids)
            started.close()
            written = read_output(started.output) if started.output else ""
            captures = started.capture_files()
            captured = [text for text in map(captured_tail, captures) if text.strip()]
            remove(started.output, started.stack_file, *captures)
        received = list(watched.received)
        if interrupted:  # a test's Ctrl-C: its leaks are reported, then the session ends
            stop = {"interrupt": True, "message": "KeyboardInterrupt", "returncode": None}
            received.append((frames.EXIT, stop))
        return Outcome(
            frames=received,
            pid=proc.pid,
            exitcode=proc.exitcode,
            expired=watched.expired,
            duration=duration,
            began=None if watched.began is None else watched.began - go_at,
            stack=watched.stack,
            output=written,
            leaks=leaks,
            cutoff=watched.cutoff,
            captured=captured,
            method=started.method,
            collected=started.collected or any(k == frames.AHEAD for k, _ in watched.received),
            uncollected=started.uncollected,
        )
