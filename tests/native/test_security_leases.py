"""The GPU lease table against other users, other pid namespaces, full disks, stopped
processes and bad device lists.

Each case ends in a one-line error naming the culprit (never a traceback, a hang or an
INTERNALERROR) or, for liveness across pid namespaces, in the holder keeping its GPU.
Cases that need root, a second user, ``unshare`` or ``mount`` skip when those are not
permitted.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import psutil
import pytest
from pytest_gpuiso._lease import LABEL_LEN, MAX_DEVICES, Region, RegionError

from pytest_gpuiso.gpu.devices import Devices
from pytest_gpuiso.gpu.leases import Leases, LeaseTimeout, open_region
from pytest_gpuiso.wire.environment import REGION_ENV
from tests.helpers import GpuIso, program
from tests.helpers.lease_table import (
    Client,
    lock_table_mutex,
    lock_table_mutex_and_sleep,
    needs_layout,
    wait_until,
    waiting_pids,
)

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown, mount, setpriv)")
NOBODY = 65534


@pytest.fixture
def table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private lease table path for this test, seen by every process it starts."""
    path = tmp_path / "leases"
    monkeypatch.setenv(REGION_ENV, str(path))
    return path


@pytest.fixture
def region_path(table: Path) -> str:
    """The lease clients' table (tests/conftest.py's ``clients``) is the test's ``table``."""
    return str(table)


def _cli(table: Path, *args: str, user: int | None = None) -> subprocess.CompletedProcess:
    """``python -m pytest_gpuiso --region TABLE ARGS`` (as uid ``user`` when given)."""
    command = [sys.executable, "-m", "pytest_gpuiso", "--region", str(table), *args]
    if user is not None:
        command = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *command]
    return subprocess.run(
        command, cwd="/", capture_output=True, text=True, timeout=60, env=dict(os.environ)
    )


def _one_line(text: str) -> str:
    """The only line of ``text``; fails when there are more (a traceback, say)."""
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


def _no_crash(result: pytest.RunResult) -> None:
    out = result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in out and "Traceback" not in out, out


# ------------------------------------------------------------------ pid namespaces


def _unshare() -> list[str]:
    command = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
    try:
        ok = subprocess.run([*command, "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    if not ok:
        pytest.skip("unshare --pid --fork --mount-proc is not permitted here")
    return command


def test_a_holder_in_another_pid_namespace_keeps_its_gpu_until_it_dies(table: Path) -> None:
    """A process in another pid namespace (a container sharing /dev/shm) holds device 0:
    its pid means another process here, yet it is not taken for dead. An acquire here
    with a timeout times out, the holder stays listed as alive; once it is SIGKILLed, a
    waiter here gets the device (woken by its 100 ms re-check, not by a timeout)."""
    holder = subprocess.Popen(
        [*_unshare(), sys.executable, str(program("sec_lease_holder.py")), str(table), "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        region = Region(str(table))
        [entry] = region.snapshot()["holders"]
        assert entry["alive"] and not entry["here"]
        assert region.acquire(["0"], 1, 1, "here", 0.5) is None
        assert [h["alive"] for h in region.snapshot()["holders"]] == [True]
        for child in psutil.Process(holder.pid).children():
            child.kill()  # the holder itself, pid 1 of its namespace
        got = region.acquire(["0"], 1, 1, "here", 60)
        assert got is not None and got[1] == ["0"]
        assert [h["pid"] for h in region.snapshot()["holders"]] == [os.getpid()]
    finally:
        holder.kill()
        holder.wait(10)


# ------------------------------------------------------------------ another user's file


@needs_root
def test_a_table_file_of_another_user_is_a_one_line_error_naming_the_owner(
    gpuiso_spawn: GpuIso, table: Path
) -> None:
    """Another user pre-created the victim's table path. A session that leases a GPU
    stops with one usage error naming that user and the variable that picks another
    path; status and reset --force (as root too) give one line and leave the file alone."""
    table.write_bytes(b"planted")
    os.chown(table, NOBODY, NOBODY)
    table.chmod(0o600)
    gpuiso_spawn.copy("sec_lease_gpu.py")
    result = gpuiso_spawn.run("--gpu-isolate-devices=0", "sec_lease_gpu.py")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            f"ERROR: gpu-isolate: lease table {table} belongs to user nobody (uid {NOBODY}), "
            f"not to uid 0: choose another path with {REGION_ENV}=PATH"
        ]
    )
    _no_crash(result)
    for command in (("status",), ("reset",), ("reset", "--force")):
        done = _cli(table, *command)
        assert done.returncode == 2, (command, done.stdout, done.stderr)
        assert f"belongs to user nobody (uid {NOBODY})" in _one_line(done.stderr), command
    assert table.read_bytes() == b"planted" and table.stat().st_uid == NOBODY


@needs_root
def test_reset_force_as_the_victim_of_a_planted_table_is_one_line(table: Path) -> None:
    """As an unprivileged user (nobody) whose table path root has taken in a sticky
    directory: status and reset --force end with one line naming the owner (reset used
    to crash with PermissionError trying to delete it)."""
    probe = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    probe += [sys.executable, "-c", "import pytest_gpuiso._lease"]
    if subprocess.run(probe, cwd="/", capture_output=True, timeout=60).returncode != 0:
        # e.g. CI's venvs live in a private (0700) temporary directory
        pytest.skip("user nobody cannot run this Python with pytest_gpuiso installed")
    shared = Path(tempfile.mkdtemp(prefix="gpuiso-sticky-"))
    try:
        shared.chmod(0o1777)
        planted = shared / "leases"
        Region(str(planted))  # a valid table, but root's
        for command in (("status",), ("reset", "--force")):
            done = _cli(planted, *command, user=NOBODY)
            assert done.returncode == 2, (command, done.stdout, done.stderr)
            line = _one_line(done.stderr)
            assert "belongs to user root (uid 0)" in line and REGION_ENV in line, line
        assert planted.exists()
    finally:
        shutil.rmtree(shared)


# ------------------------------------------------------------------ long labels


def test_long_non_ascii_test_ids_round_trip_through_status_and_reset(
    table: Path, clients: Callable[[], Client]
) -> None:
    """A test id longer than a label, of 2-byte characters placed so that the cut falls
    inside one: the table keeps a prefix cut at a character boundary; status, reset,
    reset --force and a lease timeout naming the holder all work."""
    label = "tests/test_ü.py::test_x[" + "é" * 200 + "]"
    assert len(label.encode()) > LABEL_LEN
    holder = clients()
    assert holder.acquire(["0"], 1, 1, label) is not None
    [entry] = Region(str(table)).snapshot()["holders"]
    assert label.startswith(entry["label"]) and len(entry["label"].encode()) >= LABEL_LEN - 2
    status = _cli(table, "status")
    assert status.returncode == 0 and entry["label"] in status.stdout, status.stderr
    refused = _cli(table, "reset")
    assert refused.returncode == 1 and entry["label"] in _one_line(refused.stderr)
    leases = Leases(Devices(("0",), "test"), 1, str(table))
    with pytest.raises(LeaseTimeout, match=f"held by: GPU 0: pid {holder.pid} \\(tests/"):
        leases.acquire(1, "waiter", 0.2)
    assert _cli(table, "reset", "--force").returncode == 0


@needs_layout
def test_a_label_with_broken_utf8_written_by_anyone_never_crashes_a_reader(
    table: Path, clients: Callable[[], Client]
) -> None:
    """A table written by another version (or by hand) whose label ends inside a UTF-8
    character: snapshots decode it with a replacement character; status works."""
    from tests.helpers.lease_table import slot_offset

    holder = clients()
    assert holder.acquire(["0"], 1, 1, "x") is not None
    with open(table, "r+b") as f:
        f.seek(slot_offset(0, 0) + 48)  # the label, after owner (24), lease, amount, since_ns
        f.write(b"tests/test_\xc3\0")
    [entry] = Region(str(table)).snapshot()["holders"]
    assert entry["label"] == "tests/test_\ufffd"
    assert _cli(table, "status").returncode == 0


# ------------------------------------------------------------------ full /dev/shm


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs (the table needs ~300 KiB), unmounted at the end."""
    where = tmp_path / "tiny"
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    mount = ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)]
    if subprocess.run(mount, capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs is not permitted here")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def test_a_full_file_system_fails_the_gpu_tests_with_one_line_and_leaves_nothing(
    gpuiso_spawn: GpuIso, tiny_tmpfs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The table's file system has no room for it: no SIGBUS; the test that leases a GPU
    errors with one line naming the directory and the way to pick another path, the
    session goes on (the other test passes), and no temporary file is left there."""
    path = tiny_tmpfs / "leases"
    with pytest.raises(RegionError) as info:
        open_region(str(path))
    assert "\n" not in str(info.value)
    assert f"no space left in {tiny_tmpfs}" in str(info.value) and REGION_ENV in str(info.value)
    monkeypatch.setenv(REGION_ENV, str(path))
    gpuiso_spawn.copy("sec_lease_gpu.py")
    result = gpuiso_spawn.run("--gpu-isolate-devices=0", "sec_lease_gpu.py")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        [f"*cannot create the lease table {path}: no space left in {tiny_tmpfs}*{REGION_ENV}=*"]
    )
    _no_crash(result)
    assert os.listdir(tiny_tmpfs) == []


# ------------------------------------------------------------------ stopped processes


def test_a_stopped_waiter_does_not_hold_back_the_waiters_behind_it(
    table: Path, clients: Callable[[], Client]
) -> None:
    """W1 queues for device 0 before W2; W1 is stopped (SIGSTOP, as by Ctrl-Z). When the
    holder releases, W2 gets the device; W1 keeps its place and, resumed, gets it next."""
    region = Region(str(table))
    holder, first, second = clients(), clients(), clients()
    got = holder.acquire(["0"], 1, 1, "H")
    assert got is not None
    first.start_acquire(["0"], 1, 1, "W1")
    wait_until(lambda: first.pid in waiting_pids(region), "W1 to queue")
    second.start_acquire(["0"], 1, 1, "W2", 60)
    wait_until(lambda: second.pid in waiting_pids(region), "W2 to queue")
    os.kill(first.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: psutil.Process(first.pid).status() == "stopped", "W1 to stop")
        status = _cli(table, "status")
        assert f"waiting: pid {first.pid} for 1 GPU(s)" in status.stdout
        assert "(stopped: not holding others back) W1" in status.stdout
        assert holder.release(got[0]) == 1
        later = second.granted(60)
        assert later is not None and later[1] == ["0"]
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert first.pid in waiting_pids(region)
    assert not first.answered(0.2)
    assert second.release(later[0]) == 1
    assert first.granted(60) is not None


def _lock_table_mutex_and_stop(path: str, conn: Connection) -> None:
    """Hold the table's mutex and stop, as a process stopped inside the critical section."""
    mapping = lock_table_mutex(path, conn)
    os.kill(os.getpid(), signal.SIGSTOP)
    signal.pause()
    mapping.close()


@pytest.fixture
def locker(table: Path) -> Iterator[Callable[[Callable[[str, Connection], None]], int]]:
    """Start a process that takes the table's mutex (and, say, stops); killed at the end."""
    Region(str(table))
    started: list[multiprocessing.process.BaseProcess] = []

    def start(target: Callable[[str, Connection], None]) -> int:
        ctx = multiprocessing.get_context("fork")
        parent, child = ctx.Pipe()
        process = ctx.Process(target=target, args=(str(table), child), daemon=True)
        process.start()
        started.append(process)
        assert parent.poll(30) and parent.recv() == 0
        assert process.pid is not None
        return process.pid

    try:
        yield start
    finally:
        for process in started:
            process.kill()
            process.join(10)


@needs_layout
def test_a_stopped_holder_of_the_table_lock_is_named_and_hangs_nothing(
    gpuiso_spawn: GpuIso, table: Path, locker
) -> None:
    """A process stopped while it holds the table's mutex: a pytest session's GPU test
    errors with one line naming it and the way out (kill -CONT, reset --force), the other
    test passes; status says the same; reset --force deletes the table instead of waiting."""
    pid = locker(_lock_table_mutex_and_stop)
    wait_until(lambda: psutil.Process(pid).status() == "stopped", "the locker to stop")
    named = f"is locked by pid {pid}, which is stopped: resume it with `kill -CONT {pid}`"
    gpuiso_spawn.copy("sec_lease_gpu.py")
    result = gpuiso_spawn.run("--gpu-isolate-devices=0", "sec_lease_gpu.py")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines([f"*{named}*reset --force*"])
    _no_crash(result)
    status = _cli(table, "status")
    assert status.returncode == 2 and named in _one_line(status.stderr)
    reset = _cli(table, "reset", "--force")
    assert reset.returncode == 0 and "deleted the lease table" in _one_line(reset.stdout)
    assert not table.exists()


@needs_layout
def test_ctrl_c_reaches_a_process_waiting_for_the_table_lock(
    table: Path, locker, clients: Callable[[], Client]
) -> None:
    """A process waits for the mutex that another (running, not stopped) process holds:
    a signal whose handler raises gets it out of acquire(), as Ctrl-C does."""
    locker(lock_table_mutex_and_sleep)
    client = clients()
    client.start_acquire(["0"], 1, 1, "behind the lock")
    assert not client.answered(0.5), "acquire went through a locked table"
    os.kill(client.pid, signal.SIGUSR1)
    kind, text, *_ = client.reply(30)
    assert (kind, text) == ("error", "Interrupted: signal 10")


# ------------------------------------------------------------------ device lists, slots


@pytest.mark.parametrize(
    ("env", "args", "culprit"),
    [
        (
            {"CUDA_VISIBLE_DEVICES": "0,0"},
            [],
            "invalid device list CUDA_VISIBLE_DEVICES=0,0: device 0 is listed twice",
        ),
        (
            {"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(MAX_DEVICES + 1)))},
            [],
            f"{MAX_DEVICES + 1} devices from CUDA_VISIBLE_DEVICES: the lease table holds at "
            f"most {MAX_DEVICES}",
        ),
        (
            {},
            ["--gpu-isolate-devices=" + ",".join(map(str, range(MAX_DEVICES + 1)))],
            f"{MAX_DEVICES + 1} devices from --gpu-isolate-devices: the lease table holds at "
            f"most {MAX_DEVICES}",
        ),
    ],
    ids=["duplicate", "too-many-visible", "too-many-option"],
)
def test_device_lists_the_table_cannot_hold_are_usage_errors(
    gpuiso_spawn: GpuIso,
    table: Path,
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    args: list[str],
    culprit: str,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    gpuiso_spawn.copy("sec_lease_gpu.py")
    result = gpuiso_spawn.run(*args, "sec_lease_gpu.py")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: gpu-isolate: {culprit}"])
    _no_crash(result)


def test_two_sessions_that_disagree_on_a_gpus_memory_is_a_setup_error(
    gpuiso_spawn: GpuIso, table: Path
) -> None:
    """Device 0 is held as an 80 GiB GPU (here); a session declaring it 40 GiB errors its
    GPU test in setup with one line naming the device, the holder, both sizes and the
    option; its other test passes. (Sessions with other slot counts just share the GPU by
    their shares, tests/native/test_lease_table.py.)"""
    region = Region(str(table))
    got = region.acquire(["0"], 1, 1, "held as 80 GiB", None, amount=1 << 30, capacities=[80 << 30])
    assert got is not None
    gpuiso_spawn.copy("sec_lease_gpu.py")
    result = gpuiso_spawn.run("--gpu-isolate-devices=0:40GiB", "sec_lease_gpu.py")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            f"*device 0 is leased as 80 GiB of memory by pid {os.getpid()} (held as 80 GiB); "
            "this session says 40 GiB (--gpu-isolate-devices)*"
        ]
    )
    _no_crash(result)
    region.release(got[0])
