"""Work directories, run_isolated's sweep, start failures and bad values.

A work directory name taken by another user costs a session without isolated tests
nothing and an isolated one a one-line error; sessions in other pid namespaces keep
each other's live work directories; run_isolated's sweep takes only the call's own
processes; a test whose process cannot start (no descriptor, no process left) fails
alone; out-of-range values are one line naming the option, ini key or argument.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pytest_gpuiso import run_isolated
from pytest_gpuiso.reports import files, record
from tests.helpers import USAGE_ERROR, program

NOBODY = 65534


def _need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (to make a directory owned by another user)")


def _no_traceback(result: pytest.RunResult) -> None:
    text = result.stdout.str() + result.stderr.str()
    assert "Traceback" not in text and "INTERNALERROR" not in text, text


# -- a work directory name taken by someone else ------------------------------------

TAKEN_SESSION = """
import os

import pytest
from pytest_gpuiso import IsolationError


def test_plain():
    pass


@pytest.mark.gpu_isolated
def test_marked():
    pass


def test_call(gpu_isolated_run):
    with pytest.raises(IsolationError) as info:
        gpu_isolated_run(os.getpid)
    print("CALL:", info.value)
"""


@pytest.fixture
def taken_tmpdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A TMPDIR whose pytest-gpuiso-<uid> is another user's (nobody's) directory."""
    _need_root()
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    taken = tmpdir / f"pytest-gpuiso-{os.getuid()}"
    taken.mkdir(mode=0o700)
    os.chown(taken, NOBODY, NOBODY)
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    return taken


def _taken_line(taken: Path) -> str:
    return (
        f"the work directory {taken} is owned by * (uid {NOBODY}), not by * (uid 0); "
        "set TMPDIR to a directory of yours to have pytest-gpuiso work there instead"
    )


def test_a_taken_work_directory_costs_a_session_without_isolated_tests_nothing(
    gpuiso_spawn, taken_tmpdir
):
    gpuiso_spawn.pytester.makepyfile(test_plain="def test_plain():\n    pass\n")
    result = gpuiso_spawn.run()
    result.assert_outcomes(passed=1)
    _no_traceback(result)
    assert sorted(os.listdir(taken_tmpdir)) == []  # nothing made in someone else's directory


def test_a_taken_work_directory_fails_only_what_needs_it(gpuiso, taken_tmpdir):
    """The isolated test and the run_isolated call fail with one line naming the owner and
    the way out; the session goes on (under the fork server too)."""
    gpuiso.pytester.makepyfile(test_taken=TAKEN_SESSION)
    result = gpuiso.run("-rA")
    result.assert_outcomes(passed=2, errors=1)
    _no_traceback(result)
    line = _taken_line(taken_tmpdir)
    result.stdout.fnmatch_lines([f"gpu-isolate: {line}", f"CALL: run_isolated(getpid): {line}"])


def test_a_taken_work_directory_is_a_usage_error_when_every_test_is_isolated(
    gpuiso_spawn, taken_tmpdir
):
    gpuiso_spawn.pytester.makepyfile(test_plain="def test_plain():\n    pass\n")
    result = gpuiso_spawn.run("--gpu-isolate")
    assert result.ret == USAGE_ERROR
    assert [line for line in result.errlines if line] == [
        "ERROR: gpu-isolate: "
        + _taken_line(taken_tmpdir).replace("*", "user nobody", 1).replace("*", "user root")
    ]


def test_a_symlink_or_open_work_directory_is_refused(gpuiso_spawn, tmp_path, monkeypatch):
    """Our own name as a symlink (to a directory of ours) or open to others: refused too."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    name = tmpdir / f"pytest-gpuiso-{os.getuid()}"
    name.symlink_to(tmp_path / "elsewhere")
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    gpuiso_spawn.pytester.makepyfile(test_plain="def test_plain():\n    pass\n")
    result = gpuiso_spawn.run("--gpu-isolate")
    assert result.ret == USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: gpu-isolate: the work directory {name} is a symbolic*"])
    name.unlink()
    name.mkdir(mode=0o700)
    name.chmod(0o777)
    result = gpuiso_spawn.run("--gpu-isolate")
    assert result.ret == USAGE_ERROR
    result.stderr.fnmatch_lines(
        [f"ERROR: gpu-isolate: the work directory {name} is open to other users (mode 0777);*"]
    )


# -- work directories of sessions in other pid namespaces ----------------------------


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = ["unshare", "--pid", "--fork", "--mount-proc", "true"]
    return subprocess.run(probe, capture_output=True).returncode == 0


def test_live_work_directories_in_another_pid_namespace_are_kept(
    gpuiso_spawn, tmp_path, monkeypatch
):
    """A session in its own pid namespace (its pytest is pid 1 there) keeps its work
    directory while a session outside cleans stale ones from the same TMPDIR; a dead
    process's directory (lock free) goes, one without a lock file stays."""
    if not _unshare_works():
        pytest.skip("unshare --pid --fork --mount-proc is not permitted here")
    tmpdir, signals = tmp_path / "tmp", tmp_path / "signals"
    tmpdir.mkdir()
    signals.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    gpuiso_spawn.copy("sec_misc_test_wait.py")
    env = {**os.environ, "SEC_MISC_DIR": str(signals)}
    inside = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m", "pytest"]
        + ["-p", "no:cacheprovider", "-p", "no:randomly", "--basetemp", str(tmp_path / "bt")]
        + ["--gpu-isolate-preload=none", "sec_misc_test_wait.py"],
        cwd=gpuiso_spawn.path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait_exists(signals / "started", inside)
        work = tmpdir / f"pytest-gpuiso-{os.getuid()}"
        live = sorted(os.listdir(work))
        assert len(live) == 1, live
        dead = work / "4242-deadbeef"  # a crashed process's: its lock file, nobody holds it
        dead.mkdir(mode=0o700)
        (dead / "lock").write_text("")
        unknown = work / "4343-nolock"  # no lock file: not ours to judge
        unknown.mkdir(mode=0o700)
        gpuiso_spawn.pytester.makepyfile(test_plain="def test_plain():\n    pass\n")
        gpuiso_spawn.run("--gpu-isolate", "test_plain.py").assert_outcomes(passed=1)
        left = sorted(os.listdir(work))
        assert live[0] in left, "the other namespace's live work directory was removed"
        assert "4343-nolock" in left
        assert "4242-deadbeef" not in left
    finally:
        (signals / "release").write_text("")
        out, _ = inside.communicate(timeout=120)
    assert inside.returncode == 0, out
    assert "1 passed" in out, out


def _wait_exists(path: Path, proc: subprocess.Popen) -> None:
    """Wait for ``path`` while ``proc`` runs."""
    deadline = time.monotonic() + 60
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the session ended early:\n{proc.stdout.read()}")
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)


# -- run_isolated's sweep -------------------------------------------------------------


def test_run_isolated_spares_the_callers_processes(gpuiso):
    """A helper the caller starts (from a thread) while the call runs, and the session's
    fork server and template, are not the call's: they live on; the call's own leftovers
    (a setsid double fork without exec, an exec'd process in its own session) are killed."""
    gpuiso.copy("sec_misc_funcs.py", "sec_misc_test_call_helper.py")
    result = gpuiso.run("-p", "no:randomly", "sec_misc_test_call_helper.py")
    result.assert_outcomes(passed=2)


# -- a test whose process cannot start ------------------------------------------------


def _starved(gpuiso) -> None:
    shutil.copy(program("sec_misc_test_starved.py"), gpuiso.path / "test_starved.py")
    shutil.copy(program("sec_misc_conftest_limits.py"), gpuiso.path / "conftest.py")


def test_no_descriptor_left_fails_only_the_test_it_hit(gpuiso):
    """EMFILE while starting a test's process: that test fails with one line saying why;
    the tests after it run (the limit is back)."""
    _starved(gpuiso)
    result = gpuiso.run("-rA", "-p", "no:randomly", "--gpu-isolate-prewarm=0")
    result.assert_outcomes(passed=2, errors=1)
    _no_traceback(result)
    assert (
        "gpu-isolate: could not start the isolated process: [Errno 24] Too many open "
        "files; this process's open file limit (ulimit -n) is reached"
    ) in result.outlines
    result.stdout.fnmatch_lines(
        ["PASSED test_starved.py::test_before", "PASSED test_starved.py::test_after"]
    )


def test_no_descriptor_left_while_prewarming_costs_no_other_test(gpuiso):
    """Prewarmed: the starved test's process had started, but watching it needs files
    (one line, that test only); prewarming the next test fails quietly and it starts
    once the limit is back."""
    _starved(gpuiso)
    result = gpuiso.run("-rA", "-p", "no:randomly", "--gpu-isolate-prewarm=1")
    result.assert_outcomes(passed=2, errors=1)
    _no_traceback(result)
    assert (
        "gpu-isolate: could not watch the isolated process: [Errno 24] Too many open "
        "files; this process's open file limit (ulimit -n) is reached"
    ) in result.outlines
    result.stdout.fnmatch_lines(["PASSED test_starved.py::test_after"])


def test_no_process_left_fails_only_the_test_it_hit(gpuiso_spawn, tmp_path):
    """EAGAIN (ulimit -u) while spawning a test's process, as an unprivileged user: root's
    process limit is not enforced, so the session runs as nobody, keeping only the right
    to read and write root's files."""
    _need_root()
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv")
    caps = "+dac_override,+dac_read_search"
    as_nobody = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    as_nobody += [f"--inh-caps={caps}", f"--ambient-caps={caps}"]
    if subprocess.run([*as_nobody, "true"], capture_output=True).returncode != 0:
        pytest.skip("setpriv cannot run a command as another user here")
    _starved(gpuiso_spawn)
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir(mode=0o777)
    tmpdir.chmod(0o777)
    result = _run_as(gpuiso_spawn, as_nobody, tmp_path, tmpdir)
    assert result.returncode == 1, result.stdout
    assert "INTERNALERROR" not in result.stdout and "Traceback" not in result.stdout
    assert (
        "gpu-isolate: could not start the isolated process: [Errno 11] Resource temporarily "
        "unavailable; the process limit (ulimit -u, or the machine's) is reached"
    ) in result.stdout.splitlines(), result.stdout
    assert "PASSED test_starved.py::test_after" in result.stdout


def _run_as(gpuiso, prefix: list[str], tmp_path: Path, tmpdir: Path):
    command = [*prefix, sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
    command += ["-p", "no:randomly", "--basetemp", str(tmp_path / "bt"), "-rA"]
    command += [*gpuiso.start_options, "--gpu-isolate-prewarm=0"]
    env = {**os.environ, "SEC_MISC_LIMIT": "nproc", "TMPDIR": str(tmpdir)}
    return subprocess.run(
        command,
        cwd=gpuiso.path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=120,
    )


# -- values out of range ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "culprit"),
    [
        (["--gpu-isolate-timeout=1e10"], "'1e10' for --gpu-isolate-timeout: * > 0, at most 604800"),
        (["--gpu-isolate-timeout=inf"], "'inf' for --gpu-isolate-timeout: * > 0, at most 604800"),
        (["--gpu-isolate-startup-timeout=1e10"], "'1e10' for --gpu-isolate-startup-timeout: *"),
        (["--gpu-isolate-startup-timeout=nan"], "'nan' for --gpu-isolate-startup-timeout: *"),
        (["--gpu-isolate-grace=1e400"], "'1e400' for --gpu-isolate-grace: * from 0 to 604800"),
        (["--gpu-isolate-grace=-0.5"], "'-0.5' for --gpu-isolate-grace: * from 0 to 604800"),
        (["--gpu-isolate-lease-timeout=1e10"], "'1e10' for --gpu-isolate-lease-timeout: *"),
        (
            ["--gpu-isolate-lease-timeout=-1"],
            "'-1' for --gpu-isolate-lease-timeout: * > 0, at most *",
        ),
        (["--gpu-isolate-gpu-tolerance=inf"], "'inf' for --gpu-isolate-gpu-tolerance: * MiB >= 0"),
    ],
)
def test_durations_out_of_range_are_one_line_usage_errors(gpuiso_spawn, args, culprit):
    gpuiso_spawn.copy("test_where.py")
    result = gpuiso_spawn.run(*args)
    assert result.ret == USAGE_ERROR
    assert len([line for line in result.errlines if line]) == 1, result.errlines
    result.stderr.fnmatch_lines([f"ERROR: gpu-isolate: invalid value {culprit}"])
    _no_traceback(result)


def test_durations_out_of_range_in_the_ini_file(gpuiso_spawn):
    gpuiso_spawn.copy("test_where.py")
    gpuiso_spawn.pytester.makeini("[pytest]\ngpu_isolate_startup_timeout = 1e10\n")
    result = gpuiso_spawn.run()
    assert result.ret == USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "ERROR: gpu-isolate: invalid value '1e10' for ini gpu_isolate_startup_timeout: "
            "expected a number of seconds > 0, at most 604800"
        ]
    )


MARKERS = """
import pytest


@pytest.mark.gpu_isolated(timeout=1e10)
def test_huge_timeout():
    pass


@pytest.mark.gpu_isolated(startup_timeout=float("inf"))
def test_inf_startup():
    pass


@pytest.mark.gpu_isolated(grace=10**400)
def test_huge_int_grace():
    pass


@pytest.mark.gpu_isolated(timeout=float("nan"))
def test_nan_timeout():
    pass


@pytest.mark.gpu_isolated(timeout=5)
def test_neighbour():
    pass
"""


def test_marker_durations_out_of_range_fail_only_their_test(gpuiso_spawn):
    gpuiso_spawn.pytester.makepyfile(test_bad_markers=MARKERS)
    result = gpuiso_spawn.run("-rA")
    result.assert_outcomes(passed=1, errors=4)
    _no_traceback(result)
    result.stdout.fnmatch_lines_random(
        [
            "gpu-isolate: invalid value 10000000000.0 for gpu_isolated marker argument "
            "timeout: expected a number of seconds > 0, at most 604800",
            "gpu-isolate: invalid value inf for gpu_isolated marker argument startup_timeout: "
            "expected a number of seconds > 0, at most 604800",
            "gpu-isolate: invalid value 1000* for gpu_isolated marker argument grace: "
            "expected a number of seconds from 0 to 604800",
            "gpu-isolate: invalid value nan for gpu_isolated marker argument timeout: "
            "expected a number of seconds > 0, at most 604800",
            "PASSED test_bad_markers.py::test_neighbour",
        ]
    )


def test_run_isolated_timeout_out_of_range_names_the_argument():
    with pytest.raises(
        ValueError, match=r"^invalid value 1e\+20 for run_isolated argument timeout"
    ):
        run_isolated(os.getpid, timeout=1e20)


@pytest.mark.parametrize(
    ("option", "value", "problem"),
    [
        ("--gpu-isolate-report", "/proc/report.json", "(cannot write in /proc: *)"),
        ("--gpu-isolate-summary", "afile/summary.md", "(*/afile is not a directory)"),
        ("--gpu-isolate-report", "adir", "(*/adir is a directory)"),
    ],
)
def test_an_unwritable_report_path_is_a_usage_error_at_configure(
    gpuiso_spawn, option, value, problem
):
    gpuiso_spawn.copy("test_where.py")
    (gpuiso_spawn.path / "afile").write_text("")
    (gpuiso_spawn.path / "adir").mkdir()
    result = gpuiso_spawn.run(f"{option}={value}")
    assert result.ret == USAGE_ERROR
    assert [line for line in result.errlines if line] == [
        line for line in result.errlines if line.startswith("ERROR: gpu-isolate: invalid value")
    ]
    forms = "a file in a folder that can be written, or a device or FIFO to write into"
    result.stderr.fnmatch_lines(
        [f"ERROR: gpu-isolate: invalid value {value!r} for {option}: expected {forms} {problem}"]
    )
    assert "test_where" not in result.stdout.str()  # no test ran


def test_an_unwritable_report_path_from_the_ini_file_names_the_key(gpuiso_spawn):
    gpuiso_spawn.copy("test_where.py")
    gpuiso_spawn.pytester.makeini("[pytest]\ngpu_isolate_report = /proc/gpu.json\n")
    result = gpuiso_spawn.run()
    assert result.ret == USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: gpu-isolate: invalid value '/proc/gpu.json' for ini gpu_isolate_report: *"]
    )


@pytest.mark.parametrize("source", ["/dev/zero", "fifo", "big.json"])
def test_merge_refuses_what_is_not_a_report_file(tmp_path, source):
    """A device or a FIFO (read forever, or blocking at open) and a file over the size cap
    are refused with one line, without reading them."""
    if source == "fifo":
        os.mkfifo(tmp_path / "fifo")
        source, problem = str(tmp_path / "fifo"), "not a regular file"
    elif source == "big.json":
        with open(tmp_path / "big.json", "wb") as f:
            f.truncate((1 << 30) + 1)  # sparse: no disk used
        source = str(tmp_path / "big.json")
        problem = f"{(1 << 30) + 1} bytes, more than a report can be ({1 << 30} at most)"
    else:
        problem = "not a regular file"
    result = subprocess.run(
        [sys.executable, "-m", "pytest_gpuiso", "merge", source, "--json", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2  # unusable input
    assert result.stderr == f"error: {source}: {problem}\n"
    assert not (tmp_path / "o").exists()


# -- report paths that are not regular files --------------------------------------------


def test_a_report_path_that_is_a_device_is_written_into_not_replaced(gpuiso_spawn):
    """``--gpu-isolate-report=/dev/null``-like paths: written into; renaming a temporary
    file over one would turn root's device node into a regular file."""
    _need_root()
    gpuiso_spawn.pytester.makepyfile(test_one="def test_one():\n    pass\n")
    null = gpuiso_spawn.path / "null"
    try:
        os.mknod(null, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # a /dev/null of our own
    except OSError as exc:
        pytest.skip(f"cannot make a device node here: {exc}")
    result = gpuiso_spawn.run(
        "--gpu-isolate", f"--gpu-isolate-report={null}", f"--gpu-isolate-summary={null}"
    )
    assert result.ret == 0, result.stdout.str()
    assert stat.S_ISCHR(os.stat(null).st_mode)
    assert "could not write" not in result.stdout.str()


def test_the_report_can_go_to_stdout(gpuiso_spawn):
    """``/dev/stdout`` (here a pipe) is checked at configure and written into at the end,
    not resolved into /proc/<pid>/fd/pipe:[...] nor replaced. (Where stdout is a regular
    file opened without O_APPEND, pytest's later output may overwrite the report.)"""
    gpuiso_spawn.pytester.makepyfile(test_one="def test_one():\n    pass\n")
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly"]
    command += [*gpuiso_spawn.start_options, "--gpu-isolate"]
    command += ["--gpu-isolate-report=/dev/stdout"]
    done = subprocess.run(
        command, cwd=gpuiso_spawn.path, stdout=subprocess.PIPE, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout
    assert '"nodeid": "test_one.py::test_one"' in done.stdout
    assert "JSON report written to /dev/stdout" in done.stdout
    assert os.path.islink("/dev/stdout")


CALL_INSIDE = """
import os

import pytest


@pytest.mark.gpu_isolated
def test_calls(gpu_isolated_run):
    assert gpu_isolated_run(os.getpid) != os.getpid()
"""


def test_a_call_inside_an_isolated_test_leaves_no_work_directory(gpuiso, tmp_path, monkeypatch):
    """The test's process made a directory for its run_isolated call; it ends with
    os._exit(), which runs no atexit handler, so it removes the directory itself."""
    gpuiso.pytester.makepyfile(test_call_inside=CALL_INSIDE)
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    result = gpuiso.run("test_call_inside.py")
    result.assert_outcomes(passed=1)
    work = tmpdir / f"pytest-gpuiso-{os.getuid()}"
    assert not work.exists() or list(work.iterdir()) == []


def test_a_report_path_linked_to_a_file_replaces_the_file_and_keeps_the_link(tmp_path):
    """The rename goes to the link's target, in the target's folder: the link stays."""
    target = tmp_path / "reports" / "gpu.json"
    target.parent.mkdir()
    target.write_text("old")
    link = tmp_path / "gpu.json"
    link.symlink_to(target)
    files.write_json(link, [])
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert json.loads(target.read_text()) == {"version": record.SCHEMA_VERSION, "tests": []}
