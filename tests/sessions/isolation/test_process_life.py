"""A test's process lives as a Python process does for the code it runs. Dead
classes are collected before what exists is frozen out of garbage collection, and at its
end threading's exit hooks, the test's own atexit handlers and multiprocessing's
finalizers run, under both start methods. What it held through
a descriptor is free when the next test starts, also where pytest does not wait for the
kernel's teardown of its memory (``leaving``)."""

from __future__ import annotations

import contextlib
import os
import socket
import struct

from pytest_gpuiso.child import exiting
from pytest_gpuiso.parent import leaving
from tests.helpers import GpuIso

PROGRAM = "process_life.py"


def test_garbage_is_collected_and_the_exit_ends_what_multiprocessing_started(
    gpuiso: GpuIso, lease_region
):
    gpuiso.copy(PROGRAM)
    result = gpuiso.run(
        "--gpu-isolate",
        "--gpu-isolate-leaks=fail",
        "--gpu-isolate-report=report.json",
        "-p",
        "no:randomly",
        PROGRAM,
    )
    text = result.stdout.str()
    result.assert_outcomes(passed=5)
    assert "leaked semaphore" not in text + result.stderr.str()
    assert "gpu-isolate leaks" not in text
    # the test's own atexit handler ran at its process's exit, as in-process at pytest's
    [ran] = gpuiso.path.glob("atexit-*.txt")
    assert ran.read_text() == "ran"
    [record] = [r for r in gpuiso.records().values() if r["nodeid"].endswith("atexit_handler")]
    assert ran.name == f"atexit-{record['pid']}.txt"


def test_a_spawned_process_preloads_only_what_its_test_imports(gpuiso_spawn: GpuIso, lease_region):
    """Prewarmed spawned processes import a preload module only for tests whose module
    (or conftest) imports it: test_plain's never import it, test_uses' get it ahead."""
    gpuiso_spawn.copy("preload_used")
    used = gpuiso_spawn.path / "preload_used"
    (used / "heavy_mod.py").rename(gpuiso_spawn.path / "heavy_mod.py")  # on sys.path
    result = gpuiso_spawn.run(
        "--gpu-isolate",
        "--gpu-isolate-preload=heavy_mod",
        "--gpu-isolate-prewarm=2",
        "-v",
        "-p",
        "no:randomly",
        # test_plain[0] again after test_uses: a process prewarmed for a plain test once
        # the heavy module was preloaded (pytest 9 drops the repeat without the flag; 8.0 not)
        "--keep-duplicates",
        "preload_used/test_plain.py",
        "preload_used/test_uses.py",
        "preload_used/test_plain.py::test_plain[0]",
    )
    result.assert_outcomes(passed=7)
    assert "prewarmed" in result.stdout.str()


def test_a_child_counts_as_ended_once_past_its_exit_with_its_status():
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(write)
        os.read(read, 1)
        os._exit(3)
    ending = leaving.Reaper()
    try:
        assert leaving.ended(pid, patience=0.01) is None  # running
        os.write(write, b"x")
        assert leaving.ended(pid, patience=5.0) == 3
        ending.add(pid, os.pidfd_open(pid))
        assert ending.reap(patience=5.0) == frozenset()
        assert leaving.exit_status(pid) is None  # reaped: nothing to read
    finally:
        os.close(write)  # a child still waiting reads the end of the pipe and exits
        os.close(read)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def test_the_linger_check_leaves_a_shared_socket_blocking():
    """say_exiting asks each socket whether it lingers through a socket object made on
    its descriptor: with a default timeout set (by a test, a conftest) that object
    would switch the socket, which other processes may share, to non-blocking."""
    a, b = socket.socketpair()
    default = socket.getdefaulttimeout()
    socket.setdefaulttimeout(2.0)
    try:
        assert exiting._lingers(a.fileno()) is False
        a.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 5))
        assert exiting._lingers(a.fileno()) is True
        assert os.get_blocking(a.fileno()) and a.fileno() >= 0  # still ours, still blocking
    finally:
        socket.setdefaulttimeout(default)
        a.close()
        b.close()
