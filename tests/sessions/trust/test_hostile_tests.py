"""Hostile tests and hostile state: nothing a test's process
sends, no state in the lease table and no value on the command line, in the ini file,
a marker or the environment makes pytest crash, hang, or delete what is not ours."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import psutil
import pytest

from tests.helpers import REPORT, GpuIso

HUGE = "9" * 400  # parsed as a float, this was inf: an OverflowError INTERNALERROR


def test_a_size_of_400_digits_in_a_marker_fails_that_test_only(gpuiso_spawn: GpuIso, lease_region):
    gpuiso_spawn.pytester.makepyfile(
        test_sizes=f"""
        import pytest

        @pytest.mark.gpu_isolated(gpu_memory="8GiB")
        def test_ok():
            pass

        @pytest.mark.gpu_isolated(gpu_memory="{HUGE}")
        def test_huge():
            pass
        """
    )
    result = gpuiso_spawn.run("--gpu-isolate-devices=0:80GiB", "-rE")
    result.assert_outcomes(passed=1, errors=1)
    assert "INTERNALERROR" not in result.stdout.str() and "Traceback" not in result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "*invalid value '99999999999999999999999999999999999...' for gpu_isolated "
            "marker argument gpu_memory: expected bytes or a size*"
        ]
    )


@pytest.mark.parametrize(
    ("option", "culprit"),
    [
        (f"--gpu-isolate-gpu-memory={HUGE}", "--gpu-isolate-gpu-memory"),
        (f"--gpu-isolate-devices=0:{HUGE}", "--gpu-isolate-devices (device 0)"),
        ("--gpu-isolate-gpu-memory=1.5.5GiB", "--gpu-isolate-gpu-memory"),
        ("--gpu-isolate-gpu-memory=1e3", "--gpu-isolate-gpu-memory"),
    ],
)
def test_a_bad_size_option_is_one_line(gpuiso_spawn: GpuIso, lease_region, option, culprit):
    gpuiso_spawn.copy("test_where.py")
    result = gpuiso_spawn.run(option)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "Traceback" not in result.stderr.str()
    result.stderr.fnmatch_lines([f"ERROR: gpu-isolate: invalid value * for {culprit}: expected*"])


@pytest.mark.parametrize("inherited", ["\u00b2", "1", "99999999999999999999999"])
def test_an_inherited_memory_variable_caps_no_test(
    gpuiso_spawn: GpuIso, lease_region, monkeypatch, inherited
):
    """PYTEST_GPUISO_GPU_MEMORY in pytest's own environment never reaches a test that
    leased no memory: we set it (empty) for every isolated test."""
    monkeypatch.setenv("PYTEST_GPUISO_GPU_MEMORY", inherited)
    gpuiso_spawn.pytester.makepyfile(
        test_cap="""
        import os, pytest
        from pytest_gpuiso.child import memory_cap

        @pytest.mark.gpu_isolated(gpus=0)
        def test_no_gpu():
            assert os.environ["PYTEST_GPUISO_GPU_MEMORY"] == ""
            assert memory_cap.lease() == 0
        """
    )
    result = gpuiso_spawn.run("--gpu-isolate-devices=0:80GiB")
    result.assert_outcomes(passed=1)


@pytest.mark.parametrize("kind", ["private text", "shared text", "fifo"])
def test_reset_force_deletes_only_a_lease_table(tmp_path, kind):
    """A path that names a file of yours that is not a lease table: pytest's error
    says to choose another path (not to reset it), and reset --force leaves it alone."""
    path = tmp_path / "thesis.txt"
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    else:
        path.write_text("six months of work\n")
        path.chmod(0o600 if kind == "private text" else 0o644)
    out = subprocess.run(
        [sys.executable, "-m", "pytest_gpuiso", "reset", "--force", "--region", str(path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out
    assert out.stderr == f"error: {path} is not a pytest-gpuiso lease table: left alone\n"
    assert path.exists() and (kind == "fifo" or path.read_text() == "six months of work\n")


def test_a_memory_lease_runs_on_the_declared_gpu_beside_one_of_unknown_size(
    gpuiso_spawn: GpuIso, lease_region
):
    """--gpu-isolate-devices=0:80GiB,1 (n11a): an 8 GiB test fits on GPU 0 and runs there,
    where it was skipped because GPU 1's size is unknown; 100 GiB fits nowhere known."""
    gpuiso_spawn.pytester.makepyfile(
        test_sized="""
        import pytest

        @pytest.mark.gpu_isolated(gpu_memory="8GiB")
        def test_fits_on_gpu_0():
            pass

        @pytest.mark.gpu_isolated(gpu_memory="100GiB")
        def test_fits_nowhere_known():
            pass
        """
    )
    result = gpuiso_spawn.run("--gpu-isolate-devices=0:80GiB,1", "-rs", REPORT)
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*the memory of GPU 1 is unknown (no NVML): declare it*"])
    records = gpuiso_spawn.records()
    assert records["test_sized.py::test_fits_on_gpu_0"]["gpus"] == ["0"]


def test_an_exported_leased_variable_grants_no_gpu(lease_region, tmp_path):
    """PYTEST_GPUISO_LEASED=0 in the environment outside any test (n11b): run_isolated
    still leases its GPU from the table, and the call's process sees that lease."""
    code = (
        "import os\n"
        "from pytest_gpuiso import run_isolated\n"
        "print(run_isolated(os.getenv, 'PYTEST_GPUISO_LEASE_ID', gpus=1))\n"
    )
    env = {**os.environ, "PYTEST_GPUISO_LEASED": "0", "CUDA_VISIBLE_DEVICES": "0"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().isdigit(), out  # a lease of the table, not the exported claim
    assert lease_region.exists()


def test_a_lock_word_naming_a_running_process_is_one_line_not_a_hang(lease_region, tmp_path):
    """A table whose mutex names a live, running process that will never let go (a table
    scribbled over, n11d): status ends in one line within its bound, instead of waiting
    forever; reset --force deletes the table, saying how long it waited (formatted)."""
    import mmap
    import struct

    from pytest_gpuiso.gpu.leases import open_region

    region = open_region(str(lease_region))
    lease_id, _ = region.acquire(["0"], 1, 1, "x", None)
    region.release(lease_id)
    del region
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        with open(lease_region, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
            m[24:28] = struct.pack("i", sleeper.pid)  # glibc's mutex: __lock ...
            m[32:36] = struct.pack("i", sleeper.pid)  # ... and __owner
        env = {**os.environ, "PYTEST_GPUISO_LEASE_REGION": str(lease_region)}
        cli = [sys.executable, "-m", "pytest_gpuiso"]
        status = subprocess.run(
            [*cli, "status"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
        )
        assert status.returncode == 2
        [line] = status.stderr.splitlines()
        assert "has been locked for 10 s by thread" in line and "reset --force" in line, line
        reset = subprocess.run(
            [*cli, "reset", "--force"],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert reset.returncode == 0, reset.stderr
        assert "its lock was held for 3 s (the lease region" in reset.stdout, reset.stdout
        assert "%" not in reset.stdout and f"by thread {sleeper.pid}" in reset.stdout
        assert not lease_region.exists()
    finally:
        sleeper.kill()
        sleeper.wait()


HOLD_AND_FORK = """
import os, sys, time
from pytest_gpuiso._lease import Region
region = Region(sys.argv[1])
region.acquire(["0"], 1, 1, "held by a pytest that will be killed", None)
helper = os.fork()  # a conftest's helper: multiprocessing's fork context does this
if helper == 0:
    print(os.getpid(), flush=True)  # once running: past the fork's handlers
    time.sleep(120)
    os._exit(0)
time.sleep(120)
"""


def test_a_forked_helper_does_not_keep_a_killed_pytests_leases_alive(lease_region, tmp_path):
    """The table's open file description carries pytest's OFD key lock: a child
    forked from it, alive after pytest is SIGKILLed, must not hold that lock, else other
    pid namespaces see pytest's leases as alive until the helper ends."""
    import fcntl
    import signal
    import struct

    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_AND_FORK, str(lease_region)],
        stdout=subprocess.PIPE,
        cwd=tmp_path,  # not a source tree, which would shadow the installed package
    )
    helper = int(holder.stdout.readline())
    try:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        assert psutil.pid_exists(helper)
        fd = os.open(lease_region, os.O_RDONLY)
        try:  # is any byte of the table locked by anyone? (F_OFD_GETLK on the whole file)
            query = struct.pack("hh4xqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
            answer = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, query)
        finally:
            os.close(fd)
        assert struct.unpack("hh4xqqi4x", answer)[0] == fcntl.F_UNLCK, "the helper holds it"
    finally:
        holder.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(helper, signal.SIGKILL)


def test_a_session_goes_on_in_the_table_that_replaces_a_deleted_one(lease_region):
    """reset --force deletes a table whose lock is stuck: the running session's next
    lease is taken in the new table, not refused with "was deleted" for every later test."""
    from pytest_gpuiso.gpu.devices import Devices
    from pytest_gpuiso.gpu.leases import Leases, open_region

    leases = Leases(Devices(("0",), "test"), 1, path=str(lease_region))
    leases.release(leases.acquire(1, "before", None))
    os.unlink(lease_region)  # what reset --force does to a table it cannot clear
    again = leases.acquire(1, "after the reset", None)
    holders = open_region(str(lease_region)).snapshot()["holders"]
    assert [h["label"] for h in holders] == ["after the reset"]
    leases.release(again)
    assert open_region(str(lease_region)).snapshot()["holders"] == []


UNREBUILDABLE = """
class RunError(Exception):  # pickles, but unpickling calls RunError("1: x"): TypeError
    def __init__(self, code, why):
        super().__init__(f"{code}: {why}")
"""


def test_a_value_that_cannot_come_back_is_its_repr_not_the_tests_result(
    gpuiso_spawn: GpuIso, lease_region
):
    """n1: an exception with its own __init__ in a plugin's payload and in record_property
    (of a test that also prints 200 kB): in-process both pass; isolated, the payload's
    value comes back as its repr with one warning, the property as its str() (what
    junitxml writes of it in-process), the test passes, and nobody waits out a timeout."""
    gpuiso_spawn.pytester.makepyfile(helpers_n1=UNREBUILDABLE)
    gpuiso_spawn.pytester.makeconftest(
        """
        from helpers_n1 import RunError

        def pytest_gpuiso_child_payload(item, payload):
            payload["myplugin"] = {"last_error": RunError(3, "retry"), "count": 2}

        def pytest_gpuiso_parent_payload(item, payload, reports):
            with open("parent_got.txt", "w") as f:
                f.write(repr(payload["myplugin"]))
        """
    )
    gpuiso_spawn.pytester.makepyfile(
        test_values="""
        import pytest
        from helpers_n1 import RunError

        @pytest.mark.gpu_isolated(timeout=60)
        def test_prop(record_property):
            record_property("error", RunError(1, "x"))
            print("x" * 200_000)
        """
    )
    result = gpuiso_spawn.run("--junitxml=junit.xml", "-o", "junit_family=legacy")
    result.assert_outcomes(passed=1, warnings=1)
    text = result.stdout.str()
    assert (
        "pytest_gpuiso_child_payload['myplugin']['last_error'] is a helpers_n1.RunError, "
        "which pytest's process takes only as plain data"
    ) in text
    assert text.count("its repr() is sent instead") == 1, text[-3000:]
    got = (gpuiso_spawn.path / "parent_got.txt").read_text()
    assert got == "{'last_error': \"RunError('3: retry')\", 'count': 2}", got
    junit = (gpuiso_spawn.path / "junit.xml").read_text()
    assert 'name="error" value="1: x"' in junit, junit
