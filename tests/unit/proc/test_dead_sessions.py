"""What the tests of a pytest that died left running (daemons re-parented to init) is
ended by the next session, which says so once (``dead_sessions``); a process without
that session's exact owner name is never touched."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from pytest_gpuiso.proc import dead_sessions, workdir
from pytest_gpuiso.wire.environment import OWNER_ENV
from tests.helpers import GpuIso, kill_quietly, pid_alive, wait_gone

DEVICES = "--gpu-isolate-devices=0"  # one stand-in GPU, in the test's own lease table
PROGRAM = "dead_session_daemons.py"


@contextlib.contextmanager
def _killed_session(gpuiso: GpuIso, tmp_path: Path) -> Iterator[tuple[int, list[int]]]:
    """Run the program's first test, which leaves two daemons and SIGKILLs its pytest.

    Yields the dead pytest's pid and the daemons' pids, which are killed at the end.
    The daemons hold its output pipe (through multiprocessing's resource tracker, whose
    pipe they share), so it is read only once they are gone.
    """
    gpuiso.copy(PROGRAM)
    pidfile = tmp_path / "daemons"
    proc = gpuiso.popen(
        DEVICES,
        f"{PROGRAM}::test_leaves_daemons_and_kills_pytest",
        env={"GPUISO_PIDFILE": str(pidfile)},
    )
    daemons: list[int] = []
    try:
        try:
            proc.wait(timeout=120)
        finally:
            kill_quietly([proc.pid])
            daemons += [int(pid) for pid in pidfile.read_text().split()] if pidfile.exists() else []
        if proc.returncode != -signal.SIGKILL or len(daemons) != 2:
            kill_quietly(daemons)
            out = proc.communicate(timeout=30)[0].decode(errors="replace")
            raise AssertionError(f"exit {proc.returncode}, daemons {daemons}:\n{out}")
        time.sleep(0.5)  # what pdeathsig would end is gone by now: these run on
        assert [pid for pid in daemons if pid_alive(pid)] == daemons
        yield proc.pid, daemons
    finally:
        kill_quietly(daemons)
        proc.communicate(timeout=30)


def _ended_lines(result: pytest.RunResult) -> list[str]:
    return [line for line in result.outlines if "left running by a pytest session" in line]


def test_the_next_session_ends_a_dead_sessions_daemons_and_says_so_once(
    gpuiso, lease_region, private_tmpdir, tmp_path
):
    """Two daemons (one a bare fork of the test's process, one of a program it ran) outlive
    their SIGKILLed pytest; the next session ends both before its tests, says so in one
    line naming the dead pytest and the processes, and removes its work directory; the
    session after that has nothing to say."""
    with _killed_session(gpuiso, tmp_path) as (dead, daemons):
        assert [p.name.split("-")[0] for p in private_tmpdir.iterdir()] == [str(dead)]
        result = gpuiso.run(DEVICES, f"{PROGRAM}::test_next")
        # and, from the lease table, the test it died in (a second warning)
        result.assert_outcomes(passed=1, warnings=2)
        assert f"the pytest session of pid {dead} died during " in result.stdout.str()
        [line] = _ended_lines(result)
        where, _, said = line.strip().partition(": ")
        assert re.fullmatch(r".*/pytest_gpuiso/[\w/]+\.py:\d+", where), line  # our line
        head = (
            "GpuIsoStartWarning: gpu-isolate: ended 2 processes left running "
            f"by a pytest session that died (pid {dead}): pid "
        )
        assert said.startswith(head), line
        assert sorted(map(int, re.findall(r"(?:\): |; )pid (\d+) ", line))) == sorted(daemons)
        assert wait_gone(daemons, timeout=5) == []
        assert list(private_tmpdir.iterdir()) == []
        again = gpuiso.run(DEVICES, f"{PROGRAM}::test_next")
        again.assert_outcomes(passed=1)
        assert _ended_lines(again) == []


def test_under_xdist_the_controller_ends_them_and_says_so_once(
    gpuiso_spawn, lease_region, private_tmpdir, tmp_path
):
    """With workers, the controller ends them before it starts its workers; the line is
    in the session's warnings once."""
    with _killed_session(gpuiso_spawn, tmp_path) as (_, daemons):
        result = gpuiso_spawn.run(DEVICES, "-n", "2", f"{PROGRAM}::test_next")
        result.assert_outcomes(passed=1, warnings=1)
        assert len(_ended_lines(result)) == 1, result.stdout.str()
        assert wait_gone(daemons, timeout=5) == []


# -- unit: only the exact name of a dead directory is taken ---------------------------


def _sleeper(env: dict[str, str]) -> subprocess.Popen:
    """A ``sleep 60`` child with ``env`` added, once it runs as such (exec'd: its
    environment is its own, not ours)."""
    sleeper = subprocess.Popen(["sleep", "60"], env={**os.environ, **env})
    deadline = time.monotonic() + 10
    while psutil.Process(sleeper.pid).cmdline() != ["sleep", "60"]:
        assert time.monotonic() < deadline, "sleep did not start"
        time.sleep(0.01)
    return sleeper


def _made(path: Path) -> Path:
    """A work directory as ``workdir.process_dir`` makes one: its lock file holds its
    identity (then its lock is free: its process is dead)."""
    path.mkdir(mode=0o700)
    lock = path / workdir.LOCK
    lock.write_text("")
    lock.write_text(workdir.owner(path))  # the same inode: the identity stays
    return path


@pytest.fixture
def work(tmp_path, monkeypatch) -> Path:
    """This process's work directory root, in a fresh temporary directory."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    path = workdir.root()
    assert path.parent == tmp_path
    return path


def test_only_processes_with_a_dead_directorys_exact_name_are_ended(work, monkeypatch):
    """Of processes with no owner name, with a live session's, with one that differs by a
    character or is a prefix, and with the name under another variable, none is touched;
    the one with the dead directory's exact name is ended and reported."""
    monkeypatch.setattr(dead_sessions, "KILL_WAIT", 0.5)  # our own children: reaped below
    name = f"4242-{secrets.token_hex(4)}"  # a run beside this one makes its own
    dead, live = work / name, work / f"4343-{secrets.token_hex(4)}"
    for path in (dead, live):
        _made(path)
    own = workdir.owner(dead)
    assert own.startswith(f"{os.path.realpath(dead)}@")
    envs = [
        {OWNER_ENV: own},
        {},
        {OWNER_ENV: workdir.owner(live)},
        {OWNER_ENV: own[:-1] + ("0" if own[-1] != "0" else "1")},
        {OWNER_ENV: own[:-1]},
        {OWNER_ENV: f"{own}-x"},
        {f"X_{OWNER_ENV}": own},
        {OWNER_ENV: name},  # the directory's name alone, as any copy of it has
    ]
    sleepers = [_sleeper(env) for env in envs]
    try:
        with open(live / workdir.LOCK) as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            ended = workdir.clean_stale()
        assert ended == [{"pid": sleepers[0].pid, "cmdline": "sleep 60", "session": "4242"}]
        assert sleepers[0].wait(timeout=10) == -signal.SIGTERM
        assert [s.poll() for s in sleepers[1:]] == [None] * (len(envs) - 1)
        assert sorted(work.iterdir()) == [live]
    finally:
        kill_quietly([s.pid for s in sleepers])
        for sleeper in sleepers:
            sleeper.wait(timeout=10)


def test_a_copy_of_a_live_directory_elsewhere_ends_nothing(work, tmp_path, monkeypatch):
    """A dead-looking directory of a live session's name under another TMPDIR (forged
    by a test, or a copied TMPDIR: a CI cache, a backup) is removed, but the live
    session's processes carry their own directory's path and inode, not its copy's."""
    monkeypatch.setattr(dead_sessions, "KILL_WAIT", 0.5)
    name = f"4444-{secrets.token_hex(4)}"
    live = tmp_path / "other-tmpdir" / work.name / name
    live.parent.mkdir(parents=True)
    _made(live)
    forged = work / name
    _made(forged)
    sleeper = _sleeper({OWNER_ENV: workdir.owner(live)})
    try:
        with open(live / workdir.LOCK) as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            assert workdir.clean_stale() == []
        assert sleeper.poll() is None
        assert list(work.iterdir()) == []  # the copy itself is removed
    finally:
        kill_quietly([sleeper.pid])
        sleeper.wait(timeout=10)


def test_no_process_is_listed_without_a_dead_directory(work, monkeypatch):
    """A start-up that finds only live directories does not look at processes at all."""

    def listed():
        raise AssertionError("processes were listed")

    monkeypatch.setattr(psutil, "pids", listed)
    live = work / "4343-alive"
    _made(live)
    with open(live / workdir.LOCK) as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert workdir.clean_stale() == []
    assert sorted(work.iterdir()) == [live]


def test_the_report_is_one_line_with_the_first_processes_cut_short() -> None:
    ended = [
        {"pid": 11, "cmdline": "python -c import os\nos.fork()", "session": "7"},
        {"pid": 12, "cmdline": "x" * 100, "session": "5"},
        {"pid": 13, "cmdline": "sleep 60", "session": "7", "not_killed": "it survived SIGKILL"},
        {"pid": 14, "cmdline": "sleep 61", "session": "7"},
    ]
    assert dead_sessions.describe(ended) == (
        "ended 4 processes left running by pytest sessions that died (pids 5, 7): "
        "pid 11 python -c import os os.fork(); "
        f"pid 12 {'x' * 57}...; "
        "pid 13 sleep 60 (not ended: it survived SIGKILL); and 1 more"
    )
    assert dead_sessions.describe(ended[:1]) == (
        "ended 1 process left running by a pytest session that died (pid 7): "
        "pid 11 python -c import os os.fork()"
    )


def test_a_directory_whose_lock_does_not_hold_its_identity_ends_nothing(work, monkeypatch):
    """A lock file that is not the directory's own (replaced while its session lives,
    its real lock moved aside; or written by no one) proves nothing: no process is
    ended, and the directory is kept while a process of ours has a file open in it."""
    monkeypatch.setattr(dead_sessions, "KILL_WAIT", 0.5)
    used, unused = _made(work / "4545-used"), _made(work / "4646-unused")
    sleepers = []
    for path in (used, unused):
        own = workdir.owner(path)
        (path / workdir.LOCK).rename(path / "lock.aside")
        (path / workdir.LOCK).write_text("")  # unlocked, and not the one ``own`` names
        sleepers.append(_sleeper({OWNER_ENV: own}))
    try:
        with open(used / "out", "w") as out:
            holder = subprocess.Popen(["sleep", "60"], stdout=out)
        sleepers.append(holder)
        assert workdir.clean_stale(on_dead=lambda *args: pytest.fail(f"handed over: {args}")) == []
        assert [s.poll() for s in sleepers] == [None] * 3
        assert sorted(work.iterdir()) == [used]
    finally:
        kill_quietly([s.pid for s in sleepers])
        for sleeper in sleepers:
            sleeper.wait(timeout=10)


def test_a_dead_directory_is_handed_over_before_it_is_removed(work):
    """``on_dead`` gets the directory while it is still there, with its dead pytest's pid."""
    dead = _made(work / "4747-dead")
    (dead / "shm-1.log").write_text("")
    seen = []

    def on_dead(path: Path, pid: str) -> None:
        seen.append((path, pid, path.is_dir()))

    assert workdir.clean_stale(on_dead=on_dead) == []
    assert seen == [(dead, "4747", True)] and list(work.iterdir()) == []
