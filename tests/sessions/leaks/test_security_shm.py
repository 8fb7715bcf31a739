"""What the /dev/shm check may attribute to a test and delete, when others share /dev/shm.

An entry counts as the test's creation only if it did not exist before the call that
made it (the shim tries O_EXCL first): an existing entry opened with O_CREAT is not the
test's. Nothing is deleted without --gpu-isolate-cleanup (but a segment left registered with
Python's resource tracker, which it would delete anyway); with it, only entries the
shim saw the test create, still that inode and ours. Another user's entry is never the
test's. The shim's log cannot be forged by a name, and sees directory-relative and
nested creations. Sessions run fixtures/programs/leaks/sec_shm_tests.py (and
sec_shm_conftest.py as conftest.py) through the ``gpuiso`` fixture, both start methods.
"""

from __future__ import annotations

import _posixshmem
import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pytest_gpuiso.leaks.shm_log import dispose_created, preload_env, read_log, shim_path
from pytest_gpuiso.wire.environment import LOG_ENV
from tests.helpers import REPORT, SHM, kill_quietly, make_gpuiso, pid_alive, wait_for_file

PROGRAM = "sec_shm_tests.py"

needs_shim = pytest.mark.skipif(shim_path() is None, reason="the shm shim is not built")


@pytest.fixture
def name(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[str]:
    """A unique prefix for every /dev/shm entry of the test; whatever is left is removed."""
    prefix = f"gpuiso-sec-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("GPUISO_SEC_NAME", prefix)
    monkeypatch.setenv("GPUISO_SEC_DIR", str(tmp_path))
    yield prefix
    for path in [*SHM.glob(f"*{prefix}*"), *SHM.glob(f"torch_*_{prefix}*")]:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def with_conftest(gpuiso, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUISO_SEC_MODE", mode)
    gpuiso.copy(PROGRAM, "sec_shm_conftest.py")
    (gpuiso.path / "sec_shm_conftest.py").rename(gpuiso.path / "conftest.py")


@contextlib.contextmanager
def outside(tmp_path: Path, make: Callable[[int], str]) -> Iterator[None]:
    """While it lasts, a thread of this process (outside the session's process trees,
    without the shim) answers a test's ``ask_outside()``: ``make(its pid)`` -> answer."""
    stop = threading.Event()

    def serve() -> None:
        want = tmp_path / "want"
        while not stop.is_set():
            if want.exists():
                answer = make(int(want.read_text()))
                (tmp_path / "made.tmp").write_text(answer)
                (tmp_path / "made.tmp").rename(tmp_path / "made")
                return
            time.sleep(0.02)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def shm_leaks(gpuiso, test: str) -> list[dict]:
    record = gpuiso.records()[f"{PROGRAM}::{test}"]
    return [leak for leak in record["leaks"] if leak["kind"] == "shm"]


def inode(path: Path) -> int:
    return os.lstat(path).st_ino


# --------------------------------------------------------------------------- opened, not created


@needs_shim
def test_an_existing_file_a_conftest_opens_with_o_creat_is_neither_created_nor_deleted(
    gpuiso, name, monkeypatch
):
    """A conftest opens an existing /dev/shm file with "a" in every process (the template
    too): nobody says it was created, no test reports it, and it is still there, the
    same file; the fork server's template serves every test."""
    pre = SHM / f"{name}-pre"
    pre.write_bytes(b"kept")
    before = inode(pre)
    with_conftest(gpuiso, "append", monkeypatch)
    result = gpuiso.run("--gpu-isolate", REPORT, PROGRAM, "-k", "plain")
    result.assert_outcomes(passed=1)
    assert (inode(pre), pre.read_bytes()) == (before, b"kept")
    assert f"/dev/shm/{name}-pre" not in result.stdout.str()
    assert shm_leaks(gpuiso, "test_plain") == []
    if gpuiso.start == "forkserver":
        [record] = gpuiso.records().values()
        assert record["start"]["collected"] is True, record["start"]


@needs_shim
def test_what_the_template_created_is_left_without_cleanup(pytester, monkeypatch, name):
    """The template gives up because a conftest created a /dev/shm entry: without
    --gpu-isolate-cleanup the entry is left in place and the reason says so."""
    gpuiso = make_gpuiso(pytester, monkeypatch, "forkserver")
    with_conftest(gpuiso, "create", monkeypatch)
    result = gpuiso.run("--gpu-isolate", REPORT, PROGRAM, "-k", "plain")
    result.assert_outcomes(passed=1, warnings=1)  # the test's own process made its own
    [record] = gpuiso.records().values()
    why = record["start"]["uncollected"]
    assert f"it created /dev/shm/{name}-" in why and "left in place" in why, why
    template_pid = int(why.split(f"/dev/shm/{name}-")[1].split()[0])
    assert template_pid != record["pid"]
    assert (SHM / f"{name}-{template_pid}").exists()
    [leak] = shm_leaks(gpuiso, "test_plain")
    assert leak["path"] == f"/dev/shm/{name}-{record['pid']}" and not leak["cleaned"]


@needs_shim
def test_what_a_discarded_prewarmed_process_created_is_left_without_cleanup(
    gpuiso, name, monkeypatch
):
    """-x after the first test discards the processes prewarmed for the next two; what
    their conftest created before their turn stays without --gpu-isolate-cleanup."""
    monkeypatch.setenv("GPUISO_SHM_NAME", name)
    tag = f"gpuiso-sec-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("GPUISO_PRE_GO_TAG", tag)
    monkeypatch.setenv("GPUISO_PRE_GO_DAEMON", "0")
    gpuiso.copy("test_discarded_prewarm.py", "start_pre_go_conftest.py")
    (gpuiso.path / "start_pre_go_conftest.py").rename(gpuiso.path / "conftest.py")
    result = gpuiso.run("--gpu-isolate", "-x", "--gpu-isolate-prewarm=2", REPORT)
    result.assert_outcomes(failed=1, warnings=2)
    [record] = gpuiso.records().values()
    mine = f"/dev/shm/{name}-{record['pid']}"
    [leak] = [leak for leak in record["leaks"] if leak["kind"] == "shm"]
    assert leak["path"] == mine
    left = sorted(str(p) for p in SHM.glob(f"{name}-*"))
    # The test's own, the two discarded processes', and the fork server's template's
    # (which gives up: its conftest started a process).
    assert len(left) == (4 if gpuiso.start == "forkserver" else 3) and mine in left, left


# --------------------------------------------------------------------------- attached, not created


def _make_pre(name: str) -> Callable[[int], str]:
    """The outer process's part: NAME-pre-{seg,sem,file}, made while the test runs."""

    def make(_pid: int) -> str:
        os.close(
            _posixshmem.shm_open(f"/{name}-pre-seg", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        )
        libc = ctypes.CDLL(None, use_errno=True)
        libc.sem_open.restype = ctypes.c_void_p
        libc.sem_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_uint]
        libc.sem_close.argtypes = [ctypes.c_void_p]
        sem = libc.sem_open(f"/{name}-pre-sem".encode(), os.O_CREAT | os.O_EXCL, 0o600, 1)
        assert sem, os.strerror(ctypes.get_errno())
        libc.sem_close(sem)
        (SHM / f"{name}-pre-file").write_text("theirs")
        return "done"

    return make


@needs_shim
def test_cleanup_deletes_what_the_test_created_not_what_it_attached_to(
    gpuiso, name, tmp_path: Path
):
    """While the test runs, another process makes a segment, a semaphore and a file; the
    test opens each with O_CREAT (create or attach), and makes three more the same way.
    With --gpu-isolate-cleanup the three it made are reported as created and deleted;
    the three it attached to are not reported, and still there."""
    gpuiso.copy(PROGRAM)
    with outside(tmp_path, _make_pre(name)):
        result = gpuiso.run(
            "--gpu-isolate", "--gpu-isolate-cleanup", REPORT, PROGRAM, "-k", "attach_and_create"
        )
    result.assert_outcomes(passed=1, warnings=3)
    theirs = [SHM / f"{name}-pre-seg", SHM / f"sem.{name}-pre-sem", SHM / f"{name}-pre-file"]
    assert [p.exists() for p in theirs] == [True, True, True]
    assert (SHM / f"{name}-pre-file").read_text() == "theirsa"  # appended to, as asked
    leaks = shm_leaks(gpuiso, "test_attach_and_create")
    assert sorted(leak["path"] for leak in leaks) == [
        f"/dev/shm/{name}-new-file",
        f"/dev/shm/{name}-new-seg",
        f"/dev/shm/sem.{name}-new-sem",
    ]
    for leak in leaks:
        assert leak["cleaned"] is True and ", created by pid " in leak["detail"], leak
        assert not Path(leak["path"]).exists()


# --------------------------------------------------------------------------- what the shim sees


@needs_shim
def test_nested_and_directory_relative_creations_are_traced_and_cleaned(gpuiso, name):
    """openat with a descriptor of /dev/shm, a path relative to a working directory of
    /dev/shm, mkdir and a file in the new directory, and a file in a directory that was
    there before: each is the test's, reported, and deleted (the old directory stays)."""
    old = SHM / f"{name}-old"
    old.mkdir()
    gpuiso.copy(PROGRAM)
    result = gpuiso.run(
        "--gpu-isolate", "--gpu-isolate-cleanup", REPORT, PROGRAM, "-k", "nested_and_relative"
    )
    result.assert_outcomes(passed=1, warnings=5)
    leaks = {leak["path"]: leak for leak in shm_leaks(gpuiso, "test_nested_and_relative")}
    assert sorted(leaks) == [
        f"/dev/shm/{name}-at",
        f"/dev/shm/{name}-cwd",
        f"/dev/shm/{name}-dir",
        f"/dev/shm/{name}-dir/inner",
        f"/dev/shm/{name}-old/inner",
    ]
    assert leaks[f"/dev/shm/{name}-dir"]["detail"].startswith("directory ")
    assert all(leak["cleaned"] for leak in leaks.values()), leaks
    assert [p.name for p in SHM.glob(f"{name}*")] == [old.name]
    assert list(old.iterdir()) == []


@needs_shim
def test_a_name_with_a_newline_cannot_forge_a_creation(gpuiso, name, tmp_path: Path):
    """While the test runs another process makes a file; the test then creates an entry
    whose name holds a newline and a line naming that file as its creation (pid, inode,
    name). Under --gpu-isolate-cleanup only the entry it made is reported and deleted."""
    victim = SHM / f"{name}-victim"

    def make(_pid: int) -> str:
        victim.write_text("theirs")
        return f"{inode(victim)} {victim.name}"

    gpuiso.copy(PROGRAM)
    with outside(tmp_path, make):
        result = gpuiso.run(
            "--gpu-isolate", "--gpu-isolate-cleanup", REPORT, PROGRAM, "-k", "newline"
        )
    result.assert_outcomes(passed=1, warnings=1)
    assert victim.read_text() == "theirs"
    [leak] = shm_leaks(gpuiso, "test_newline_in_a_name")
    assert leak["path"].startswith(f"/dev/shm/{name}-nl\n") and leak["cleaned"], leak


@needs_shim
def test_the_log_escapes_names_and_records_inodes(tmp_path: Path, name):
    """The shim's log, read back: one line per creation, whatever bytes the name holds."""
    log = tmp_path / "shm.log"
    log.touch()
    odd = f"{name}-a b%c\nd\x7f"
    code = f"open('/dev/shm/' + {odd!r}, 'w').close()"
    env = {**os.environ, **preload_env(), LOG_ENV: str(log)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    assert b"\n" not in log.read_bytes().rstrip(b"\n")
    [(logged, entry)] = read_log(str(log)).items()
    assert logged == odd and entry.inode == inode(SHM / odd)


def test_only_what_the_log_says_was_created_is_deleted(tmp_path: Path, name):
    """``dispose_created`` (a discarded process, the template giving up) deletes nothing
    without cleanup and says what it left; with it, only a logged entry that still has
    the logged inode and is ours, reached without following a symlink."""
    made = SHM / f"{name}-made"
    made.write_text("m")
    replaced = SHM / f"{name}-replaced"
    replaced.write_text("r")
    outside_dir = tmp_path / "elsewhere"
    outside_dir.mkdir()
    (outside_dir / "x").write_text("x")
    link = SHM / f"{name}-link"
    link.symlink_to(outside_dir)
    log = tmp_path / "shm.log"
    lines = [
        f"1 {inode(made)} {made.name}",
        f"1 {inode(replaced) + 1000} {replaced.name}",  # another inode: made again since
        f"1 {inode(outside_dir / 'x')} {link.name}/x",  # through a symlink
    ]
    theirs = SHM / f"{name}-theirs"
    if os.geteuid() == 0:
        theirs.write_text("t")
        os.chown(theirs, 65534, 65534)
        lines.append(f"1 {inode(theirs)} {theirs.name}")
    log.write_text("".join(line + "\n" for line in lines))
    left = dispose_created(str(log), cleanup=False)
    assert left == f"created /dev/shm/{made.name}; left in place " + (
        "(--gpu-isolate-cleanup deletes it)"
    )
    assert made.exists()
    assert dispose_created(str(log), cleanup=True) == ""
    assert not made.exists()
    assert replaced.exists() and (outside_dir / "x").exists() and link.is_symlink()
    if os.geteuid() == 0:
        assert theirs.exists()


# --------------------------------------------------------------------------- other users


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_another_users_torch_named_entry_is_never_the_tests(gpuiso, name, tmp_path: Path):
    """While the test runs, /dev/shm/torch_<the test's pid>_... appears, owned by another
    user: under shm=fail the test still passes, nothing is reported, nothing deleted."""
    made: list[Path] = []

    def make(pid: int) -> str:
        path = SHM / f"torch_{pid}_{name}_0"
        path.write_bytes(b"t")
        os.chown(path, 65534, 65534)
        made.append(path)
        return "done"

    gpuiso.copy(PROGRAM)
    with outside(tmp_path, make):
        result = gpuiso.run(
            "--gpu-isolate",
            "--gpu-isolate-leaks=shm=fail",
            "--gpu-isolate-cleanup",
            REPORT,
            PROGRAM,
            "-k",
            "torch_name",
        )
    result.assert_outcomes(passed=1)
    assert shm_leaks(gpuiso, "test_someone_elses_torch_name") == []
    assert made and made[0].exists()


# --------------------------------------------------------------------------- LD_PRELOAD


def test_the_users_preloads_come_before_the_shim(monkeypatch: pytest.MonkeyPatch):
    if shim_path() is None:
        assert preload_env() == {}
        return
    monkeypatch.setenv("LD_PRELOAD", "/opt/libasan.so.8 /opt/libother.so")
    monkeypatch.delenv("ASAN_OPTIONS", raising=False)
    env = preload_env()
    assert env["LD_PRELOAD"].split() == ["/opt/libasan.so.8", "/opt/libother.so", shim_path()]
    assert env["ASAN_OPTIONS"] == "verify_asan_link_order=0"
    monkeypatch.setenv("ASAN_OPTIONS", "detect_leaks=0")
    assert preload_env()["ASAN_OPTIONS"] == "detect_leaks=0:verify_asan_link_order=0"
    monkeypatch.setenv("ASAN_OPTIONS", "verify_asan_link_order=1:detect_leaks=0")
    assert "ASAN_OPTIONS" not in preload_env()  # the user's own choice stands


@pytest.fixture(scope="module")
def asan_program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("asan")
    source = where / "hello.c"
    source.write_text('#include <stdio.h>\nint main(void) { puts("asan ok"); return 0; }\n')
    binary = where / "hello"
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("no gcc")
    built = subprocess.run(
        [gcc, "-fsanitize=address", str(source), "-o", str(binary)], capture_output=True
    )
    if built.returncode != 0:
        pytest.skip("gcc -fsanitize=address does not work here (libasan missing?)")
    return binary


@needs_shim
def test_a_test_runs_a_program_built_with_asan(
    gpuiso, name, asan_program: Path, monkeypatch: pytest.MonkeyPatch
):
    """A test runs an ASan-linked program: it finds the shim in LD_PRELOAD ahead of its
    runtime and still runs (verify_asan_link_order=0 in its ASAN_OPTIONS)."""
    monkeypatch.setenv("GPUISO_SEC_ASAN", str(asan_program))
    monkeypatch.delenv("ASAN_OPTIONS", raising=False)
    gpuiso.copy(PROGRAM)
    result = gpuiso.run("--gpu-isolate", REPORT, PROGRAM, "-k", "asan")
    result.assert_outcomes(passed=1)


@needs_shim
def test_the_tests_run_when_the_user_preloads_libasan(gpuiso, monkeypatch: pytest.MonkeyPatch):
    """pytest runs with libasan in LD_PRELOAD: the tests' processes keep it first (ASan
    aborts a process whose first library is not its runtime) and run."""
    gcc = shutil.which("gcc")
    found = subprocess.run([gcc, "-print-file-name=libasan.so"], capture_output=True, text=True)
    libasan = os.path.realpath(found.stdout.strip()) if gcc and found.returncode == 0 else ""
    if not os.path.isabs(libasan) or not os.path.exists(libasan):
        pytest.skip("libasan is not installed")
    monkeypatch.setenv("LD_PRELOAD", libasan)
    monkeypatch.setenv("ASAN_OPTIONS", "detect_leaks=0")  # the interpreter's own, at exit
    monkeypatch.setenv("GPUISO_SEC_FIRST", libasan)
    monkeypatch.setenv("GPUISO_SEC_NAME", "unused")
    gpuiso.copy(PROGRAM)
    result = gpuiso.run("--gpu-isolate", PROGRAM, "-k", "preload_order")
    result.assert_outcomes(passed=1)


# --------------------------------------------------------------------------- Ctrl-C


def test_an_interrupted_tests_shm_entry_is_reported_and_cleaned(gpuiso, name, tmp_path: Path):
    """Ctrl-C while the test sleeps: the session ends (exit code 2), and the /dev/shm
    entry the test made is in its JSON record and the leak summary, and deleted under
    --gpu-isolate-cleanup."""
    gpuiso.copy(PROGRAM)
    proc = gpuiso.popen(
        "--gpu-isolate", "--gpu-isolate-cleanup", REPORT, PROGRAM, "-k", "interrupted"
    )
    child = None
    try:
        child = int(wait_for_file(tmp_path / "pid"))
        os.kill(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        text = out.decode(errors="replace")
        assert proc.returncode == 2, text
        assert "KeyboardInterrupt" in text
        assert not pid_alive(child)
        records = {
            t["nodeid"]: t for t in json.loads((gpuiso.path / "report.json").read_text())["tests"]
        }
        assert records[f"{PROGRAM}::test_interrupted"]["outcome"] == "interrupted"
        [leak] = records[f"{PROGRAM}::test_interrupted"]["leaks"]
        assert leak["path"] == f"/dev/shm/{name}-int" and leak["cleaned"] is True, leak
        assert f"{PROGRAM}::test_interrupted: 1 shm" in text
        assert not (SHM / f"{name}-int").exists()
    finally:
        kill_quietly([proc.pid] + ([child] if child else []))
        if proc.returncode is None:
            proc.communicate(timeout=30)
