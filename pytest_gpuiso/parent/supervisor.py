"""One isolated run, parent side, in two calls: ``go``, then ``Running.wait``.

``go`` takes a started process (``launcher``'s) to its go: its probes
learn how it was started and take their snapshots, it gets its go (with the
environment of its GPUs and of its probes), and the probes that sample during the
run start. The caller may then do other work (prewarm the next tests) while the
test runs. ``Running.wait`` has ``watch.Watch`` read its frames under the three
bounds and stop it past one (stack dump, SIGTERM, grace, SIGKILL), then reaps it,
sweeps the descendants that escaped its process group (this process is a child
subreaper, so double-forked or ``setsid`` orphans of the test are re-parented here,
where ``psutil`` finds them: ``leaks.process``), runs the probes' checks and
decodes what the process sent into an ``Outcome``.

A test's process that says it is exiting, is past its exit and left no process is
not waited for while the kernel tears it down (``leaving``): the launcher reaps it
later. The parent waits on the pipe and on a pidfd of the child together with
``multiprocessing.connection.wait``; it never sleep-polls while the child runs.

A process that died before it read its go, without a word (killed by whoever cleans
up its user's processes, after the launcher's last look at it), ran none of its test's
code: the go is still in its pipe, or could not be written there. ``Running.unstarted``
says so, and the runner starts another (``REPLACEMENTS`` at most). One that read it is
the test's: its death is the test's crash, never run again. One that said why it could
not go on before its test began failed to start (``start_failures``): none is started.
"""

from __future__ import annotations

import array
import dataclasses
import fcntl
import os
import termios
import time
from typing import Any

from ..leaks import Leak, Probe, RunInfo
from ..leaks.process import ProcessProbe
from ..proc.proctree import Child, children, descendant_keys
from ..proc.workdir import remove
from ..wire import jobs
from . import leaving
from .launcher import Launcher
from .outcome import (
    End,
    Launch,
    Outcome,
    SessionStop,
    captured_tail,
    read_output,
    signal_name,
)
from .started import Started
from .watch import Bounds, Watch

REPLACEMENTS = 2  # processes started in turn for a test whose process died before its go


def unstarted_error(how: str, died: int) -> str:
    """Why a test did not run: ``died`` processes in a row ended before their go."""
    return (
        f"the test's process died before the test started ({how}), and so did the "
        f"{died - 1} started to replace it: another process kills this session's waiting "
        "processes (a test or a tool that kills its user's processes, such as pkill -f)"
    )


def go(
    launcher: Launcher,
    started: Started,
    env: dict[str, str],
    probes: tuple[Probe, ...],
    bounds: Bounds,
) -> Running:
    """Give ``started`` (a process of ``launcher``'s) its go (``env`` with its probes'
    ``child_env``) once its probes have their snapshots; ``probes``: the leak checks
    besides the process sweep, which always runs. ``bounds``: ``timeout`` bounds the test
    (or call) itself, from when the child says it begins; ``startup`` bounds what comes
    before it from the go, and the process's exit after it."""
    # The test's own process is spared in the snapshot: what it started before its go
    # (plugins, conftests) is then new, and swept with the rest of its tree.
    sweep = ProcessProbe(spare=launcher.spare(), mark=launcher.mark)
    every = (sweep, *probes)
    for probe in every:
        probe.before_start(started)
    snapshots = [probe.snapshot() for probe in every]
    go_env = dict(env)
    for probe in every:
        go_env.update(probe.child_env())
    go_at = time.monotonic()
    try:  # kept open until the process ended: whether it read its go (``unstarted``)
        started.go.send(go_env)
        sent = True
    except OSError:  # it died before its go: no process holds the other end
        sent = False
    for probe in every:  # probes that sample while the test runs (GPU memory's peak)
        probe.during(started.pid)
    return Running(launcher, started, sweep, every, snapshots, bounds, go_at, sent)


class Running:
    """A process that has its go; ``wait`` for its outcome (once)."""

    def __init__(
        self,
        launcher: Launcher,
        started: Started,
        sweep: ProcessProbe,
        probes: tuple[Probe, ...],
        snapshots: list[Any],
        bounds: Bounds,
        go_at: float,
        sent: bool = True,
    ) -> None:
        self.launcher = launcher
        self.started = started
        self.sweep = sweep
        self.probes = probes  # the sweep first
        self.snapshots = snapshots
        self.bounds = bounds
        self.go_at = go_at
        self.waited = False  # ``wait`` was entered: the process is its to end and reap
        self.sent = sent  # its go reached the pipe
        # It ended before it read its go, by this signal's name or its exit status:
        # none of its test's code ran, another process may run the test (``wait`` sets it)
        self.unstarted: str | None = None
        self._watch: Watch | None = None

    def watch(self) -> Watch:
        """What reads its frames under its bounds (one, made on first use: by ``wait``, or
        by its group's wait to stop it with the others)."""
        if self._watch is None:
            s, settles = self.started, any(probe.settles for probe in self.probes)
            leave = self._leavable() and not settles
            args = (s.proc, s.reader, s.sentinel, s.stack_file, self.go_at, self.bounds)
            self._watch = Watch(*args, may_leave=leave)
        return self._watch

    def wait(self) -> Outcome:
        """Watch the process to its end under its bounds, reap it, sweep, check, decode."""
        self.waited = True
        started, launcher = self.started, self.launcher
        proc = started.proc
        watched = self.watch()
        interrupted = False
        try:
            if watched.run():  # it says it is exiting
                if self._past_exit():
                    watched.leave()
                else:
                    watched.run()
        except BaseException as exc:  # Ctrl-C: take the child's tree down before leaving
            interrupted = True
            watched.escalate(min(self.bounds.grace, 1.0))
            if not (isinstance(exc, KeyboardInterrupt) and isinstance(started.job, jobs.ItemJob)):
                raise  # a test's Ctrl-C is its outcome; run_isolated's caller gets its own
        finally:
            duration = time.monotonic() - self.go_at
            launcher.finished(started, watched.left)
            died = None  # before its go; not yet known whether it said why (``decode``)
            if not interrupted and watched.expired is None and not watched.left:
                died = self._died_before_go()
            leaks = self._check(interrupted, watched.left)
            started.close()
            written = read_output(started.output) if started.output else ""
            captures = started.capture_files()
            captured = [text for text in map(captured_tail, captures) if text.strip()]
            remove(started.output, started.stack_file, *captures)
        end = End(
            pid=proc.pid,
            exitcode=proc.exitcode,
            expired=watched.expired,
            duration=duration,
            began=None if watched.began is None else watched.began - self.go_at,
            stack=watched.stack,
            why=watched.why,
            output=written,
            leaks=leaks,
            captured=captured,
        )
        launch = Launch(started.method, started.warm, started.collected, started.uncollected)
        outcome = Outcome(end, launch).decode(watched.received, watched.cutoff)
        outcome.launch.collected = outcome.launch.collected or outcome.launch.ahead
        self.unstarted = died if not outcome.sent.errors else None  # one that said why: its own
        if interrupted and watched.cutoff is None:  # a test's Ctrl-C (not past a bound):
            # its leaks are reported, then the session ends
            outcome.sent.exits.append(SessionStop(True, "KeyboardInterrupt"))
        if outcome.launch.method == "forkserver":
            # the template imports them for the next ones
            launcher.serving.pass_on_imports(
                outcome.sent.imported, getattr(started.job, "nodeid", ""), duration
            )
        return outcome

    def _died_before_go(self) -> str | None:
        """How the ended process ended when it never read its go (the go never reached
        its pipe, or is still in it), else None: it took its go, the test is its own."""
        if self.sent and not _unread(self.started.go):
            return None
        code = self.started.proc.exitcode
        name = signal_name(code)
        return f"killed by {name}" if name else f"exit status {code}"

    def _leavable(self) -> bool:
        """Whether the process may be left to the kernel's teardown once it says it is
        exiting (``leaving``): a forked test's process (not a call's), with a pidfd to reap
        it by later."""
        started = self.started
        return (
            isinstance(started.proc, Child)
            and isinstance(started.sentinel, int)
            and hasattr(os, "P_PIDFD")
            and isinstance(started.job, jobs.ItemJob)
            and self.launcher.mark is None
        )

    def _past_exit(self) -> bool:
        """A test's process that said ``EXITING``: whether it is past its exit and left no
        process, so that it may be left to the kernel's teardown (``leaving``)."""
        pid = self.started.pid
        status = leaving.ended(pid)
        if status is None or children(pid):  # its children first: see leaving
            return False
        spare = self.launcher.spare(settle=True) - {pid}
        if any(other != pid for other, _ in descendant_keys(spare) - self.snapshots[0]):
            return False  # it left a process: the sweep waits for its end, as ever
        self.started.proc.exitcode = status
        return True

    def _check(self, interrupted: bool, left: bool) -> list[Leak]:
        """The probes' checks, the sweep first. Interrupted: the sweep, which must never be
        skipped, and what the test left in /dev/shm; not the GPU memory, which its killed
        tree may still be releasing. Left past its exit: ``_past_exit`` listed our
        descendants already."""
        self.sweep.spare = self.launcher.spare(settle=True)  # children forked during the test
        started = self.started
        pid = started.pid
        run = RunInfo(pid, started.created, time.time(), self.bounds.grace, frozenset({pid}))
        leaks: list[Leak] = []
        for probe, before in zip(self.probes, self.snapshots, strict=True):
            if (interrupted and probe.settles) or (left and probe is self.sweep):
                continue
            found = probe.check(before, run)
            leaks += found
            pids = {leak.fields["pid"] for leak in found if leak.kind == "process"}
            run = dataclasses.replace(run, tree_pids=run.tree_pids | pids)
        return leaks


def _unread(conn: Any) -> int:
    """Bytes written to ``conn`` (a pipe's write end) that no process has read."""
    count = array.array("i", [0])
    try:
        fcntl.ioctl(conn.fileno(), termios.FIONREAD, count)
    except OSError:
        return 0  # not a pipe we can ask: as read (the test's own outcome stands)
    return count[0]
