"""Parent side of one isolated run: start the child, wait, escalate, reap, sweep.

What happens on timeout, in order (all of it is in ``Supervisor.run``):

1. ask the child for a stack dump (faulthandler registered on ``STACK_SIGNAL``
   dumps every thread even when the test is stuck in C code);
2. SIGTERM to the child's process group;
3. wait ``grace`` seconds, still draining the pipe;
4. SIGKILL to the group (and to every descendant seen before step 2);
5. after the child is reaped, sweep descendants that escaped the group: this
   process is a child subreaper, so double-forked or ``setsid`` orphans of the
   test are re-parented here, where ``psutil`` finds them (``leaks.process``).

Leak probes (``leaks/``) take their snapshot just before the child starts and
check once the child and its descendants are gone; the process probe is the
sweep itself and always runs.

The parent waits on the pipe and on a pidfd of the child together with
``multiprocessing.connection.wait``; it never sleep-polls while the child runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import multiprocessing
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import psutil

from . import child
from .ipc import recv_frame
from .leaks import Leak, Probe, RunInfo
from .leaks.process import REAP_WAIT as _REAP_WAIT
from .leaks.process import ProcessProbe, alive

STACK_SIGNAL = int(signal.SIGRTMIN) + 2  # unlikely to collide with a test's own handlers
OUTPUT_TAIL_BYTES = 8192
OUTPUT_TAIL_LINES = 60
OUTPUT_KEEP_BYTES = 1 << 20  # of what the child wrote outside pytest's capture
_STACK_WAIT = 2.0  # upper bound for faulthandler to write the dump


_RUNS = itertools.count(1)  # unique file tags within this process, whatever the Supervisor


class StartError(RuntimeError):
    """The child could not be started (e.g. the job could not be pickled)."""


@dataclass
class Outcome:
    """What one isolated run produced and how the child ended."""

    frames: list[tuple[str, Any]]
    pid: int
    exitcode: int | None
    timed_out: bool
    duration: float
    stack: str = ""
    output: str = ""  # what the child wrote to fds 1/2 outside pytest's capture
    leaks: list[Leak] = field(default_factory=list)  # process leaks first, then the probes'
    cutoff: int | None = None  # on timeout: how many frames had arrived by the deadline
    captured: list[str] = field(default_factory=list)  # tails of the test's captured output

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
        return not self.timed_out and self.exitcode == 0 and bool(self.frames_of("done"))

    @property
    def started(self) -> bool:
        """The child finished its bootstrap (and can answer a stack-dump request)."""
        return any(kind == "ready" for kind, _ in self.frames)

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

    def frames_of(self, kind: str) -> list[Any]:
        """Payloads of one kind; after a timeout, only what arrived before the deadline."""
        return [payload for k, payload in self.frames_in_time if k == kind]


class Supervisor:
    """Runs jobs in fresh ``spawn`` processes, one at a time, with files under ``workdir``."""

    def __init__(self, workdir: Path, *, capture_output: bool = True) -> None:
        self.workdir = workdir
        self.capture_output = capture_output
        self._ctx = multiprocessing.get_context("spawn")

    def run(
        self,
        job: Any,
        *,
        timeout: float | None,
        grace: float,
        env: dict[str, str] | None = None,
        probes: tuple[Probe, ...] = (),
    ) -> Outcome:
        """Run ``job`` (an object with ``run(conn, boot)``) in a fresh process.

        ``probes`` are leak checks besides the process sweep, which always runs.
        """
        tag = f"{os.getpid()}-{next(_RUNS)}"
        output = self._private_file(f"out-{tag}.log") if self.capture_output else None
        stack_file = self._private_file(f"stack-{tag}.txt")
        capture_prefix = self.workdir / f"cap-{tag}-"
        boot = child.Bootstrap(
            parent_pid=os.getpid(),
            output=str(output) if output else None,
            stack_file=str(stack_file),
            stack_signal=STACK_SIGNAL,
            spill_dir=str(self.workdir),
            capture_prefix=str(capture_prefix),
            env=tuple(sorted((env or {}).items())),
        )
        reader, writer = self._ctx.Pipe(duplex=False)
        # The tracker is a long-lived helper of ours, not something the test left behind.
        _ensure_resource_tracker()
        probes = (ProcessProbe(), *probes)
        snapshots = [probe.snapshot() for probe in probes]
        wall_start = time.time()
        proc = self._ctx.Process(target=child.main, args=(boot, job, writer), daemon=False)
        exec_env: dict[str, str] = {}
        for probe in probes:
            exec_env.update(getattr(probe, "exec_env", {}))
        try:
            with _exec_environment(exec_env):
                proc.start()
        except Exception as exc:
            reader.close()
            _remove(output, stack_file)
            raise StartError(f"could not start the isolated process: {exc}") from exc
        finally:
            writer.close()
        started = time.monotonic()
        sentinel = _pidfd(proc)
        frames: list[tuple[str, Any]] = []
        timed_out = False
        cutoff = None
        stack = ""
        interrupted = False
        try:
            deadline = None if timeout is None else started + timeout
            if not _pump(reader, sentinel, frames, deadline):
                timed_out, cutoff = True, len(frames)
                # Before its bootstrap the child has no handler and the signal would kill it.
                if any(kind == "ready" for kind, _ in frames):
                    stack = _dump_stack(proc.pid, stack_file)
                _terminate(proc, reader, sentinel, frames, grace)
        except BaseException:  # KeyboardInterrupt: take the child's tree down before leaving
            interrupted = True
            _terminate(proc, reader, sentinel, frames, min(grace, 1.0))
            raise
        finally:
            duration = time.monotonic() - started
            _reap(proc, sentinel)
            run = RunInfo(proc.pid, wall_start, time.time(), grace, frozenset({proc.pid}))
            leaks: list[Leak] = []
            # Interrupted: only the sweep, which must never be skipped.
            checks = list(zip(probes, snapshots, strict=True))
            for probe, before in checks[:1] if interrupted else checks:
                found = probe.check(before, run)
                leaks += found
                pids = {leak.fields["pid"] for leak in found if leak.kind == "process"}
                run = dataclasses.replace(run, tree_pids=run.tree_pids | pids)
            reader.close()
            if isinstance(sentinel, int):
                os.close(sentinel)
            written = _read_output(output) if output else ""
            captures = sorted(
                self.workdir.glob(capture_prefix.name + "*"),
                key=lambda p: int(p.name.rsplit("-", 1)[1]),
            )
            captured = [text for text in map(_tail, captures) if text.strip()]
            _remove(output, stack_file, *captures)
        return Outcome(
            frames=frames,
            pid=proc.pid,
            exitcode=proc.exitcode,
            timed_out=timed_out,
            duration=duration,
            stack=stack,
            output=written,
            leaks=leaks,
            cutoff=cutoff,
            captured=captured,
        )

    def _private_file(self, name: str) -> Path:
        path = self.workdir / name
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        return path


@contextlib.contextmanager
def _exec_environment(extra: dict[str, str]) -> Iterator[None]:
    """Variables the new process must have when it is exec'd (LD_PRELOAD of a probe).

    ``spawn`` execs the interpreter with this process's environment, and setting
    them later, in the child, would be too late for the dynamic linker.
    """
    saved = {name: os.environ.get(name) for name in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _remove(*paths: Path | None) -> None:
    for path in paths:
        if path is not None:
            with contextlib.suppress(OSError):
                path.unlink()


def _pump(reader: Connection, sentinel: Any, frames: list, deadline: float | None) -> bool:
    """Collect frames until the child exits (True) or the deadline passes (False)."""
    waitables = [reader, sentinel]
    while True:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            return False
        ready = wait(waitables, remaining)
        if reader in ready and not _receive(reader, frames):
            waitables.remove(reader)
        if sentinel in ready:
            while reader in waitables and reader.poll(0) and _receive(reader, frames):
                pass
            return True


def _receive(reader: Connection, frames: list) -> bool:
    """Read one frame; False once the pipe is closed or unreadable."""
    try:
        frames.append(recv_frame(reader))
    except (EOFError, OSError):
        return False
    except Exception as exc:  # a garbled frame: keep the evidence, stop reading
        frames.append(("error", f"unreadable message from the test process: {exc!r}"))
        return False
    return True


def _reap(proc: multiprocessing.process.BaseProcess, sentinel: Any) -> None:
    """Collect the child's exit status.

    ``Process.join(timeout)`` waits on the sentinel pipe, which a forked grandchild
    may still hold; once the pidfd says the child exited, a blocking join is just
    ``waitpid`` on a zombie and returns at once.
    """
    if wait([sentinel], _REAP_WAIT):
        proc.join()
    else:
        proc.join(0)


def _pidfd(proc: multiprocessing.process.BaseProcess) -> Any:
    """A descriptor that becomes readable when the child exits.

    ``Process.sentinel`` is a pipe the child holds, which any process it forks
    also inherits, so it would not fire while a grandchild lives on; a pidfd does.
    """
    with contextlib.suppress(AttributeError, OSError):
        return os.pidfd_open(proc.pid)
    return proc.sentinel


def _dump_stack(pid: int, stack_file: Path) -> str:
    """Ask the child's faulthandler for a dump of every thread and read it back."""
    try:
        os.kill(pid, STACK_SIGNAL)
    except ProcessLookupError:
        return ""
    deadline = time.monotonic() + _STACK_WAIT
    size, text = -1, ""
    # faulthandler writes from the signal handler without any notification;
    # the only way to know it is done is that the file stopped growing.
    while time.monotonic() < deadline:
        time.sleep(0.05)
        text = stack_file.read_text(errors="replace")
        if text and len(text) == size:
            break
        size = len(text)
    return text.strip()


def _signal_tree(
    proc: multiprocessing.process.BaseProcess, sig: int, extra: list[psutil.Process]
) -> None:
    """Signal the child's process group (or the child alone before it made one) and ``extra``."""
    try:
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for p in extra:
        with contextlib.suppress(psutil.Error):
            p.send_signal(sig)


def _terminate(proc, reader: Connection, sentinel: Any, frames: list, grace: float) -> None:
    """SIGTERM the tree, wait ``grace`` (draining the pipe), then SIGKILL what is left."""
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        tree = []
    _signal_tree(proc, signal.SIGTERM, tree)
    deadline = time.monotonic() + grace
    if _pump(reader, sentinel, frames, deadline):
        rest = max(0.0, deadline - time.monotonic())
        _, running = psutil.wait_procs([p for p in tree if alive(p)], timeout=rest)
        if not running:
            return
    _signal_tree(proc, signal.SIGKILL, tree)
    wait([sentinel], _REAP_WAIT)


def _ensure_resource_tracker() -> None:
    with contextlib.suppress(Exception):
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()


def _read_output(path: Path) -> str:
    """What the child wrote outside capture; only the last ``OUTPUT_KEEP_BYTES`` if more."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - OUTPUT_KEEP_BYTES))
            data = f.read()
    except OSError:
        return ""
    text = data.decode("utf-8", "replace")
    if size > OUTPUT_KEEP_BYTES:
        text = f"[{size - OUTPUT_KEEP_BYTES} earlier bytes not kept]\n" + text.split("\n", 1)[-1]
    return text


def _tail(path: Path) -> str:
    """The last lines of the child's stdout/stderr."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - OUTPUT_TAIL_BYTES))
            data = f.read()
    except OSError:
        return ""
    lines = data.decode("utf-8", "replace").splitlines()
    if size > OUTPUT_TAIL_BYTES and lines:
        lines = lines[1:]  # the first line is probably cut
    return "\n".join(lines[-OUTPUT_TAIL_LINES:])
