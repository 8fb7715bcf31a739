"""The fork server's template: a configured pytest session that collected the isolated
tests' modules once, from which each test's process is forked (``start.collected``).

Covered, over real sessions of the programs in fixtures/programs/ (test_template_*.py,
template_conftest.py copied as conftest.py, which does what a template must not keep
when $GPUISO_TEMPLATE_CONFTEST asks):

* tests forked from the template keep pytest's semantics (rewritten asserts, captured
  output, tmp_path under --basetemp, skip/xfail/xpass, warnings, a module fixture per
  process, record_property in junitxml), with the same terminal output as under spawn;
* the template keeps its temporary directory away from the session's --basetemp;
* a template that loaded libcuda, kept a socket, a thread, a process or a /dev/shm entry
  gives up: every test passes, forked by the server, the records and the summary say
  why, and what the template made is gone after the session (tests' own leaks are
  reported as before); a log file kept open does not make it give up;
* collection errors, crashes and pytest.exit() are reported as under spawn;
* odd parameter ids and nested classes: every test pre-collected and run once, in its
  own process, with and without xdist.

``make_gpuiso(..., "forkserver")`` makes every fork wait for the template, so each run
takes one path. The session's private directory ($TMPDIR/pytest-gpuiso-<uid>, which holds
the template's temporary directory) must be empty after every run.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path

import psutil
import pytest

from pytest_gpuiso.wire.environment import FORK_TWICE_ENV, TEMPLATE_WAIT_ENV
from tests.helpers import REPORT, SHM, GpuIso, kill_quietly, make_gpuiso, wait_gone
from tests.helpers.output import normalized

# pytest's report formats, hooks and internals: CI's lowest-versions stage runs them all
pytestmark = pytest.mark.versions

IDS = "test_template_ids.py"
SEMANTICS = "test_template_semantics.py"
WHY = "after configuring and collecting: "
IDS_NODES = [
    *(f"{IDS}::test_odd_ids[{v}]" for v in ("a::b", "c[d]", "with space", "x]::[y z")),
    f"{IDS}::TestGroup::test_method",
    f"{IDS}::TestGroup::test_method_param[one::1]",
    f"{IDS}::TestGroup::test_method_param[two [2]]",
    f"{IDS}::TestGroup::TestNested::test_nested",
]


class Env:
    """The runs' environment: their log, a private $TMPDIR, unique /dev/shm and tag names."""

    def __init__(self, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
        self.iso = make_gpuiso(pytester, monkeypatch, "forkserver")
        self.monkeypatch = monkeypatch
        self.log = pytester.path / "template.log"
        self.shm_name = f"gpuiso-tpl-{uuid.uuid4().hex[:10]}"
        self.tag = f"gpuiso-tpl-tag-{uuid.uuid4().hex[:8]}"
        tmpdir = pytester.path / "tmpdir"
        tmpdir.mkdir()
        self.private = tmpdir / f"pytest-gpuiso-{os.getuid()}"
        for name, value in [
            ("GPUISO_TEMPLATE_LOG", self.log),
            ("GPUISO_SHM_NAME", self.shm_name),
            ("GPUISO_TEMPLATE_TAG", self.tag),
            ("TMPDIR", tmpdir),
        ]:
            monkeypatch.setenv(name, str(value))

    def conftest(self, modes: str) -> None:
        """template_conftest.py as conftest.py, doing what ``modes`` say (comma-separated)."""
        self.iso.copy("template_conftest.py")
        (self.iso.path / "template_conftest.py").rename(self.iso.path / "conftest.py")
        self.monkeypatch.setenv("GPUISO_TEMPLATE_CONFTEST", modes)

    def run(self, *args: str, start: str = "forkserver") -> pytest.RunResult:
        iso = self.iso if start == "forkserver" else GpuIso(self.iso.pytester, start)
        result = iso.run("--gpu-isolate", REPORT, *args)
        left = sorted(p.name for p in self.private.iterdir()) if self.private.exists() else []
        assert left == [], left  # the template's directory, the server's log: all gone
        return result

    def lines(self, kind: str) -> list[tuple[int, str]]:
        """(pid, rest) of the log's lines of this kind ("ran", "tmp_path", "mktemp", ...)."""
        text = self.log.read_text(encoding="utf-8") if self.log.exists() else ""
        rows = [line.split(" ", 2) + [""] for line in text.splitlines()]
        return [(int(row[1]), row[2]) for row in rows if row[0] == kind]

    def tagged(self) -> list[int]:
        procs = psutil.process_iter(["cmdline"])
        return [p.pid for p in procs if self.tag in (p.info["cmdline"] or [])]

    def cleanup(self) -> None:
        kill_quietly(self.tagged())
        for path in SHM.glob(f"{self.shm_name}*"):
            path.unlink(missing_ok=True)


# For what the forks' parentage changes (exit statuses and signals, reaping, zombies, the
# sweep): each test twice, its processes forked once as pytest's children (fork_sibling)
# and forked twice and re-parented (the fallback where clone3 is refused).
each_fork = pytest.mark.parametrize("env", ["sibling", "twice"], indirect=True)


@pytest.fixture
def env(request: pytest.FixtureRequest, pytester: pytest.Pytester, monkeypatch):
    """Tests' processes forked once, as pytest's children (fork_sibling), unless the test
    is marked ``each_fork``: what the template holds does not depend on the parentage."""
    found = Env(pytester, monkeypatch)
    if getattr(request, "param", "sibling") == "twice":
        monkeypatch.setenv(FORK_TWICE_ENV, "1")
    yield found
    found.cleanup()


def starts(iso: GpuIso) -> dict[str, tuple[bool, str | None]]:
    """Per test: (forked from the template, why not once it gave up)."""
    records = iso.records().items()
    return {n: (r["start"]["collected"], r["start"]["uncollected"]) for n, r in records}


def ran_once_each(env: Env, nodeids: list[str]) -> None:
    """Each test ran exactly once, in the process its record names, none sharing one."""
    records = env.iso.records()
    ran = env.lines("ran")
    assert sorted(nodeid for _, nodeid in ran) == sorted(nodeids)
    assert {nodeid: pid for pid, nodeid in ran} == {n: records[n]["pid"] for n in nodeids}
    assert len({pid for pid, _ in ran}) == len(nodeids)


def same_as_spawn(fork: pytest.RunResult, spawn: pytest.RunResult) -> None:
    """Same exit status, counts and output, but for pids, addresses, frame counts and the
    C extensions a crash dump lists (what each process imported)."""

    def text(result: pytest.RunResult) -> list[str]:
        lines = [line for line in normalized(result) if not line.startswith("Extension modules:")]
        return [re.sub(r"0x[0-9a-f]+|\d+", "N", line) for line in lines]

    assert fork.ret == spawn.ret
    assert fork.parseoutcomes() == spawn.parseoutcomes()
    assert text(fork) == text(spawn)


# --------------------------------------------------------------------------- semantics


def test_forked_tests_keep_pytest_semantics(env: Env) -> None:
    """Rewritten asserts with their `where` line, a failure's captured stdout, skip, xfail,
    xpass, a warning in the summary: as under spawn. tmp_path: one per test, under
    <--basetemp>/isolated-*; the module fixture and module state are fresh in each test's
    process; record_property reaches the junitxml. Every record says `collected`."""
    env.iso.copy(SEMANTICS)
    common = ("-rA", "-o", "junit_family=xunit1", SEMANTICS)
    spawn = env.run("-v", "--basetemp=bt-spawn", "--junitxml=spawn.xml", *common, start="spawn")
    env.log.unlink(missing_ok=True)
    result = env.run("-v", "--basetemp=bt", "--junitxml=fork.xml", *common)
    result.assert_outcomes(failed=2, passed=4, skipped=1, xfailed=1, xpassed=1, warnings=1)
    same_as_spawn(result, spawn)
    assert set(starts(env.iso).values()) == {(True, None)}
    result.stdout.fnmatch_lines(["gpu-isolate: started 9 forkserver; 8 prewarmed; 9 pre-collected"])
    result.stdout.fnmatch_lines(
        ["*_ test_rewritten_assert _*", ">       assert inc(1) == 3", "E       assert 2 == 3"]
    )
    result.stdout.fnmatch_lines(["E        +  where 2 = inc(1)"])
    result.stdout.fnmatch_lines(
        ["*_ test_output_of_a_failure _*", "*Captured stdout call*", "MARKER-TEMPLATE-STDOUT"]
    )
    result.stdout.fnmatch_lines(
        [
            "*= warnings summary =*",
            f"{SEMANTICS}::test_warning",
            "*UserWarning: MARKER-TEMPLATE-WARNING",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            f"SKIPPED [[]1] {SEMANTICS}:*: MARKER-TEMPLATE-SKIP",
            f"XFAIL {SEMANTICS}::test_xfail - MARKER-TEMPLATE-XFAIL",
            f"XPASS {SEMANTICS}::test_xpass - MARKER-TEMPLATE-XPASS",
        ]
    )
    records = env.iso.records()
    pids = [record["pid"] for record in records.values()]
    assert len(set(pids)) == 9
    # tmp_path: distinct, each in its own isolated-* directory of the session's basetemp.
    tmp_paths = [Path(rest) for _, rest in env.lines("tmp_path")]
    assert len(tmp_paths) == 2 and tmp_paths[0].parent != tmp_paths[1].parent
    for path in tmp_paths:
        assert path.parent.parent == env.iso.path / "bt", path
        assert path.parent.name.startswith("isolated-") and (path / "mine.txt").is_file()
    # The module fixture: set up once in each of the 3 processes of the tests using it.
    users = ("test_tmp_path[1]", "test_tmp_path[2]", "test_record_property")
    expected = sorted(records[f"{SEMANTICS}::{name}"]["pid"] for name in users)
    assert sorted(pid for pid, _ in env.lines("fixture")) == expected
    props = {
        case.get("name"): {p.get("name"): p.get("value") for p in case.iter("property")}
        for case in ET.parse(env.iso.path / "fork.xml").iter("testcase")
    }
    pid = records[f"{SEMANTICS}::test_record_property"]["pid"]
    assert props["test_record_property"] == {"template_pid": str(pid)}


def test_template_keeps_away_from_the_session_basetemp(env: Env) -> None:
    """pytest made its --basetemp at session start (a sentinel file in it) and one
    isolated-* directory per test; the template, whose collection makes a directory with
    its own tmp_path_factory, wipes none of it: its directory is elsewhere, and gone."""
    env.iso.copy(IDS)
    env.conftest("basetemp")
    result = env.run("--basetemp=bt", IDS)
    result.assert_outcomes(passed=8)
    assert set(starts(env.iso).values()) == {(True, None)}
    basetemp = env.iso.path / "bt"
    assert (basetemp / "sentinel.txt").read_text() == "made by pytest at session start"
    assert len(list(basetemp.glob("isolated-*"))) == 8
    [(template, made)] = env.lines("mktemp")  # collected once, by the template
    assert template not in {record["pid"] for record in env.iso.records().values()}
    assert basetemp not in Path(made).parents and not Path(made).exists()
    ran_once_each(env, IDS_NODES)


# --------------------------------------------------------------------------- an unusable template


@each_fork
@pytest.mark.parametrize("cause", ["libcuda", "socket", "thread", "process", "daemon", "shm"])
def test_unusable_template_falls_back(env: Env, request, cause: str) -> None:
    """A template that configured and collected into something it must not share says why
    and exits; the server forks every test from its parsed configuration: all pass, each
    once, `collected` false, `uncollected` and the summary give the reason. The template's
    process and /dev/shm entry are gone; the tests' own ones are their leaks, as ever."""
    nodeids = list(IDS_NODES)
    if cause == "libcuda":
        lib = request.getfixturevalue("fake_libcuda")
        env.monkeypatch.setenv("GPUISO_FAKE_LIBCUDA", str(lib))
        env.iso.copy(IDS, "test_template_cuda.py")
        nodeids += [f"test_template_cuda.py::test_cuda_module_{n}" for n in ("one", "two")]
        reason = re.escape(f"the CUDA driver is initialised ({lib})")
    else:
        env.iso.copy(IDS)
        env.conftest(cause)
        reason = {
            "socket": r"it opened socket:\[\d+\] \(descriptor \d+\)",
            "thread": r"the template has 2 threads \(collecting test modules started 1; "
            r"template-probe-thread\); .*",
            "process": r"it started process (\d+)",
            "daemon": r"it started process (\d+)(?: and \d+ more)?",
            "shm": re.escape(f"it created /dev/shm/{env.shm_name}-") + r"(\d+)",
        }[cause]
    # A daemon made before its test's go is charged to the test running then: no prewarm.
    result = env.run(
        "-v", "--gpu-isolate-cleanup", *(["--gpu-isolate-prewarm=0"] * (cause == "daemon"))
    )
    leaks = cause in ("process", "daemon", "shm")  # each test's own process made its own
    assert result.parseoutcomes() == {"passed": len(nodeids), **({"warnings": 8} if leaks else {})}
    [(collected, why)] = set(starts(env.iso).values())
    assert not collected
    match = re.fullmatch(re.escape(WHY) + reason, why)
    assert match, why
    summary = f"started {len(nodeids)} forkserver; * prewarmed; 0 pre-collected ({why})"
    result.stdout.fnmatch_lines(["gpu-isolate: " + summary.replace("[", "[[]")])
    ran_once_each(env, nodeids)
    records = env.iso.records().values()
    pids = {record["pid"] for record in records}
    if cause in ("process", "daemon"):
        assert int(match.group(1)) not in pids  # the template's own: killed by it
        for record in records:
            [leak] = record["leaks"]
            assert leak["kind"] == "process" and env.tag in leak["cmdline"], leak
        assert env.tagged() == []
    if cause == "shm":
        assert int(match.group(1)) not in pids  # the template's entry: removed by it
        for record in records:
            [leak] = record["leaks"]
            assert leak["path"] == f"/dev/shm/{env.shm_name}-{record['pid']}", leak
            assert leak["cleaned"], leak
        assert list(SHM.glob(f"{env.shm_name}*")) == []


def test_log_file_kept_open_keeps_the_template(env: Env) -> None:
    """A regular file opened for appending at configure and kept open is no reason to give
    up: every test is pre-collected and appends through the inherited file. Nor is a
    /dev/shm entry made and removed again at session start."""
    env.iso.copy(IDS)
    env.conftest("logfile,shm_unlinked")
    result = env.run("-v", IDS)
    result.assert_outcomes(passed=8)
    assert set(starts(env.iso).values()) == {(True, None)}
    result.stdout.fnmatch_lines(["gpu-isolate: started 8 forkserver; 7 prewarmed; 8 pre-collected"])
    ran_once_each(env, IDS_NODES)
    assert sorted(env.lines("call")) == sorted(env.lines("ran"))


# --------------------------------------------------------------------------- errors, crashes


def test_collection_errors_are_reported_as_under_spawn(env: Env) -> None:
    """A syntax error (seen by pytest itself) and a module that raises at import only in
    isolated processes, beside a good module (--continue-on-collection-errors): the good
    tests are pre-collected and pass, the errors are the ones spawn reports."""
    env.iso.copy(IDS, "test_template_import_error.py")
    env.iso.pytester.makepyfile(test_template_syntax="def test_broken(:\n    pass\n")
    args = ("-rA", "--continue-on-collection-errors")
    spawn = env.run(*args, start="spawn")
    env.log.unlink(missing_ok=True)
    result = env.run(*args)
    result.assert_outcomes(passed=8, errors=2)
    same_as_spawn(result, spawn)
    result.stdout.fnmatch_lines(
        [
            "*_ ERROR collecting test_template_syntax.py _*",
            "*_ ERROR at setup of test_never_runs_isolated _*",
            "The isolated test process could not run the test (exit code 0)",
            "the isolated process could not collect *test_never_runs_isolated*",
            "E   RuntimeError: MARKER-TEMPLATE-IMPORT-ERROR",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "ERROR test_template_syntax.py",
            "ERROR test_template_import_error.py::test_never_runs_isolated*",  # 8.0: no " - "
        ]
    )
    bad = "test_template_import_error.py::test_never_runs_isolated"
    assert starts(env.iso) == {**{n: (True, None) for n in IDS_NODES}, bad: (False, None)}
    assert env.iso.records()[bad]["outcome"] == "error"
    ran_once_each(env, IDS_NODES)


@each_fork
@pytest.mark.parametrize("program", ["test_crashes.py", "sem_exit.py"])
def test_crashes_and_exit_are_reported_as_under_spawn(env: Env, program: str) -> None:
    """Segfault, abort, SIGKILL, os._exit, sys.exit, and pytest.exit() ending the session,
    in processes forked from the template: the same outcomes, output and exits as spawn."""
    env.iso.copy(program)
    args = ("--gpu-isolate-grace=1", program)
    spawn = env.run(*args, start="spawn")
    spawn_records = env.iso.records()
    result = env.run(*args)
    same_as_spawn(result, spawn)
    assert set(starts(env.iso).values()) == {(True, None)}
    records = env.iso.records()
    assert {n: (r["outcome"], r["exit"]) for n, r in records.items()} == {
        n: (r["outcome"], r["exit"]) for n, r in spawn_records.items()
    }
    if program == "sem_exit.py":
        assert result.ret == 5 and list(records) == ["sem_exit.py::test_exit_first"]
        result.stdout.fnmatch_lines(["*_pytest.outcomes.Exit: MARKER-EXIT stop the session*"])
    else:
        result.assert_outcomes(failed=5, passed=1)
        result.stdout.fnmatch_lines(["*_ test_segfault _*", "Fatal Python error: Segmentation*"])
        exits = {n.split("::")[1]: r["exit"]["signal"] for n, r in records.items()}
        assert exits["test_segfault"] == "SIGSEGV" and exits["test_abort"] == "SIGABRT"


# --------------------------------------------------------------------------- node ids


@pytest.mark.parametrize("xdist", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_odd_ids_and_classes_run_once_each(env: Env, xdist: list[str]) -> None:
    """Ids with `::`, brackets and spaces, methods of nested classes: each test is found in
    the template (`collected`) and runs once, in its own process."""
    env.iso.copy(IDS)
    result = env.run(*xdist, "-v", IDS)
    result.assert_outcomes(passed=8)
    assert starts(env.iso) == {nodeid: (True, None) for nodeid in IDS_NODES}
    result.stdout.fnmatch_lines(["gpu-isolate: started 8 forkserver; * prewarmed; 8 pre-collected"])
    ran_once_each(env, IDS_NODES)


# --------------------------------------------------------------------------- switches, natives


def test_no_precollect_forks_from_the_parsed_configuration(env: Env) -> None:
    """--gpu-isolate-no-precollect (and its ini): no template; every test's process
    configures and collects for itself, and the header says so. A bad ini value is a
    one-line usage error naming it."""
    env.iso.copy(IDS)
    result = env.run("-v", "--gpu-isolate-no-precollect", IDS)
    result.assert_outcomes(passed=8)
    assert set(starts(env.iso).values()) == {(False, None)}
    result.stdout.fnmatch_lines(["*forks from a parsed configuration*", "*; 0 pre-collected"])
    env.iso.pytester.makeini("[pytest]\ngpu_isolate_precollect = false\n")
    result = env.run(IDS)
    assert set(starts(env.iso).values()) == {(False, None)}
    env.iso.pytester.makeini("[pytest]\ngpu_isolate_precollect = sometimes\n")
    result = env.run(IDS)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert [line for line in result.errlines if line] == [
        "ERROR: gpu-isolate: invalid value 'sometimes' for ini gpu_isolate_precollect: "
        "expected true or false (also yes/no, y/n, t/f, on/off, 1/0)"
    ]


# True while the fork server's template imports the module (its _template_main is on the
# stack); not in pytest, nor in a test's process forked by the server, which collects itself.
IN_TEMPLATE = """
import sys, time


def in_template():
    frame = sys._getframe()
    while frame is not None and frame.f_code.co_name != "_template_main":
        frame = frame.f_back
    return frame is not None
"""

SLOW_TEMPLATE = (
    IN_TEMPLATE
    + """

if in_template():
    time.sleep(2)


def test_a():
    pass


def test_b():
    pass
"""
)


def test_forks_wait_for_a_template_that_is_still_collecting(env: Env) -> None:
    """By default a fork request waits for the template (up to $PYTEST_GPUISO_TEMPLATE_WAIT
    seconds from its start, 30 unless set): with a module that takes 2 s to import in the
    template only, every test is still forked from it. With 0, the first one is forked by
    the server instead, while the template collects. A bad value (not seconds, or more
    than pytest waits for a fork's answer) is a one-line usage error naming the variable."""
    env.iso.pytester.makepyfile(test_template_slow=SLOW_TEMPLATE)
    env.monkeypatch.delenv(TEMPLATE_WAIT_ENV)
    env.run("test_template_slow.py").assert_outcomes(passed=2)
    assert set(starts(env.iso).values()) == {(True, None)}
    env.monkeypatch.setenv(TEMPLATE_WAIT_ENV, "0")
    env.run("test_template_slow.py").assert_outcomes(passed=2)
    assert starts(env.iso)["test_template_slow.py::test_a"] == (
        False,
        "the template was still collecting after 0 s",
    )
    for value in ("soon", "1e10"):  # both name the one range accepted
        env.monkeypatch.setenv(TEMPLATE_WAIT_ENV, value)
        result = env.run("test_template_slow.py")
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        assert [line for line in result.errlines if line] == [
            f"ERROR: gpu-isolate: invalid value {value!r} for environment variable "
            f"{TEMPLATE_WAIT_ENV}: expected a number of seconds from 0 to 240"
        ]


STUCK_TEMPLATE = (
    IN_TEMPLATE
    + """

if in_template():
    time.sleep(1000)


def test_a():
    pass


def test_b():
    pass


def test_c():
    pass
"""
)


def test_a_template_stuck_collecting_is_waited_for_only_until_its_deadline(env: Env) -> None:
    """A template that never finishes collecting (a module stuck at import, in the
    template only): fork requests wait for it until $PYTEST_GPUISO_TEMPLATE_WAIT seconds
    after its start, then the server forks every test; the records and the summary say
    why; the stuck template goes with the session."""
    env.iso.pytester.makepyfile(test_template_stuck=STUCK_TEMPLATE)
    env.monkeypatch.setenv(TEMPLATE_WAIT_ENV, "1")
    result = env.run("-v", "test_template_stuck.py")
    result.assert_outcomes(passed=3)
    why = "the template was still collecting after 1 s"
    assert set(starts(env.iso).values()) == {(False, why)}
    result.stdout.fnmatch_lines([f"*; 0 pre-collected ({why})"])
    here = str(env.iso.path)
    procs = psutil.process_iter(["cwd"])
    left = [p.pid for p in procs if p.info["cwd"] == here and p.pid != os.getpid()]
    # The template, still asleep in the module's import, was killed (it may be exiting).
    assert wait_gone(left, timeout=10) == []


LOOP_WRAPPER = """
import os

import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtestloop(session):
    with open(os.environ["GPUISO_TEMPLATE_LOG"], "a") as log:
        log.write(f"loop {os.getpid()} {os.environ.get('CUDA_VISIBLE_DEVICES', '-')}\\n")
    return (yield)
"""

GPU_TESTS = """
import os

import pytest


@pytest.mark.gpu_isolated
@pytest.mark.parametrize("i", range(3))
def test_gpu(i):
    with open(os.environ["GPUISO_TEMPLATE_LOG"], "a") as log:
        log.write(f"test {os.getpid()} {os.environ['CUDA_VISIBLE_DEVICES']}\\n")
"""


def test_hook_wrappers_around_the_run_loop_see_the_tests_gpus(env: Env) -> None:
    """A prewarmed process forked from the template waits for its go (and its GPUs) in
    pytest_collection, as under spawn: a conftest's pytest_runtestloop wrapper already
    sees CUDA_VISIBLE_DEVICES of the test's lease, not the prewarm's empty one."""
    env.iso.pytester.makeconftest(LOOP_WRAPPER)
    env.iso.pytester.makepyfile(test_template_gpus=GPU_TESTS)
    result = env.run("-v", "--gpu-isolate-devices=0", "test_template_gpus.py")
    result.assert_outcomes(passed=3)
    # every one prewarmed: the first while it waited for its lease
    result.stdout.fnmatch_lines(["*started 3 forkserver; 3 prewarmed; 3 pre-collected"])
    tests = dict(env.lines("test"))
    assert sorted(tests.values()) == ["0", "0", "0"]
    loops = dict(env.lines("loop"))
    assert {pid: loops.get(pid) for pid in tests} == tests


SIBLING = """
import os, signal, sys
from pytest_gpuiso._fork import fork_sibling

a = os.getpid()
b = os.fork()
if b == 0:
    c = fork_sibling()
    if c == 0:  # C: the child of A, with its own thread id for raise()
        got = []
        signal.signal(signal.SIGUSR1, lambda *_: got.append(1))
        signal.raise_signal(signal.SIGUSR1)
        os._exit(0 if os.getppid() == a and got == [1] else 3)
    os._exit(0)
os.waitpid(b, 0)
pid, status = os.waitpid(-1, 0)  # C is A's child: only A can reap it
print(pid != b, os.waitstatus_to_exitcode(status))
"""


def test_fork_sibling_makes_a_child_of_the_callers_parent(tmp_path: Path) -> None:
    """native/gpuiso_fork.c: B (A's child) forks C with fork_sibling(); C's parent is A,
    which reaps it; in C, raise() reaches C itself (glibc's idea of its thread id)."""
    # cwd: "-c" puts it first on sys.path, where a checkout's sources would shadow the install
    out = subprocess.run(
        [sys.executable, "-c", SIBLING], capture_output=True, text=True, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "0"], out.stdout


def test_marked_tests_are_pre_collected_from_their_modules_only(env: Env) -> None:
    """Without --gpu-isolate only the marked tests are isolated: the template collects the
    modules that hold them (once pytest has collected), and both marked tests of
    test_mixed.py are forked from it; the unmarked ones run in pytest."""
    env.iso.copy("test_mixed.py", IDS)
    result = env.iso.run("-v", REPORT, "test_mixed.py", IDS)
    result.assert_outcomes(passed=13)
    starts_ = starts(env.iso)
    assert starts_ == {
        "test_mixed.py::test_isolated_middle": (True, None),
        "test_mixed.py::TestClass::test_isolated_in_class": (True, None),
    }
    result.stdout.fnmatch_lines(["gpu-isolate: started 2 forkserver; 1 prewarmed; 2 pre-collected"])


# ------------------------------------------- what a module does at import, and forks


@pytest.mark.parametrize("cause", ["shared_mapping", "open_file"])
def test_shared_state_made_at_import_gives_up(env: Env, cause: str) -> None:
    """A MAP_SHARED anonymous mapping, or a regular file opened for reading and kept, made
    at import: forks would share it (a write, a file offset), so the template gives up and
    says why; both tests pass, each in its own process, as under spawn."""
    program = f"test_import_{cause}.py"
    env.iso.copy(program)
    data = env.iso.path / "import_open_file_data.json"
    data.write_text('{"answer": 42}')
    spawn = env.run(program, start="spawn")
    result = env.run(program)
    result.assert_outcomes(passed=2)
    same_as_spawn(result, spawn)
    [(collected, why)] = set(starts(env.iso).values())
    assert not collected and why.startswith(WHY), why
    wanted = ["shared mapping"] if cause == "shared_mapping" else ["opened", str(data.resolve())]
    assert all(word in why for word in wanted), why
    assert len({record["pid"] for record in env.iso.records().values()}) == 2


def test_threaded_fork_server_falls_back_to_spawn(env: Env) -> None:
    """A conftest starts a thread ("heartbeat") at import in isolated processes: the fork
    server has two threads, so no test is forked (nor from a template it forked while
    threaded); every test is started with spawn, said once, and has its thread."""
    program = "test_import_thread.py"
    env.iso.copy(program, "conftest_heartbeat_thread.py")
    (env.iso.path / "conftest_heartbeat_thread.py").rename(env.iso.path / "conftest.py")
    result = env.run(program)
    result.assert_outcomes(passed=2, warnings=1)
    [warning] = [line for line in result.outlines if ": GpuIsoStartWarning: " in line]
    assert "2 threads" in warning and "heartbeat" in warning, warning
    assert {r["start"]["method"] for r in env.iso.records().values()} == {"spawn"}


@pytest.mark.parametrize("filter_", ["error", "error::pytest.PytestWarning", "named"])
def test_a_fallback_notice_under_a_projects_error_filter(env: Env, filter_: str) -> None:
    """The fork server falls back to spawn (a conftest's thread) in a project whose
    filters make warnings errors: a blanket filter is about the project's code, so the
    notice is shown and every test runs; a filter naming GpuIsoStartWarning is the
    user's wish to stop, which ends the session with one line after the first test."""
    program = "test_import_thread.py"
    env.iso.copy(program, "conftest_heartbeat_thread.py")
    (env.iso.path / "conftest_heartbeat_thread.py").rename(env.iso.path / "conftest.py")
    named = filter_ == "named"
    result = env.run("-W", "error::pytest_gpuiso.GpuIsoStartWarning" if named else filter_, program)
    if named:
        assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
        result.stdout.fnmatch_lines(
            ["*gpu-isolate: *2 threads*(GpuIsoStartWarning is an error by -W/filterwarnings)*"]
        )
        result.assert_outcomes(passed=1)
    else:
        result.assert_outcomes(passed=2, warnings=1)
        [warning] = [line for line in result.outlines if ": GpuIsoStartWarning: " in line]
        assert "2 threads" in warning, warning


@pytest.mark.parametrize("seed", ["1234", ""], ids=["seeded", "unseeded"])
def test_random_state_as_under_spawn(env: Env, seed: str) -> None:
    """random.seed() at import: each forked test's first draw is the seed's, as under spawn.
    Unseeded: two tests' processes draw different numbers (the template's state is not
    handed to every fork)."""

    program = "test_import_random_seed.py"
    env.iso.copy(program)
    env.monkeypatch.setenv("GPUISO_RANDOM_SEED", seed)
    for start in ("spawn", "forkserver"):
        env.log.unlink(missing_ok=True)
        env.run(program, start=start).assert_outcomes(passed=2)
        draws = [float(value) for _, value in env.lines("random")]
        if seed:
            assert draws == [random.Random(int(seed)).random()] * 2, (start, draws)
        else:
            assert len(draws) == 2 and draws[0] != draws[1], (start, draws)
    assert set(starts(env.iso).values()) == {(True, None)}


def test_tmpdir_factory_is_under_the_session_basetemp(env: Env) -> None:
    """tmpdir_factory.mktemp() in a test forked from the template: under --basetemp, like
    tmp_path_factory's, not in the template's own (removed) directory."""
    program = "test_tmpdir_factory_paths.py"
    env.iso.copy(program)
    env.run("--basetemp=bt", program).assert_outcomes(passed=1)
    assert set(starts(env.iso).values()) == {(True, None)}
    basetemp = env.iso.path / "bt"
    for kind in ("tmpdir", "tmp_path"):
        [(_, made)] = env.lines(kind)
        assert basetemp in Path(made).parents and Path(made).name.startswith("data"), made
    assert (Path(env.lines("tmpdir")[0][1]) / "mine.txt").is_file()


def test_exited_background_job_keeps_the_template(env: Env) -> None:
    """`sleep 0.05 &` run by a shell at import, gone before collection ends: nothing the
    forks would share, so every test is forked from the template."""
    program = "test_import_background_job.py"
    env.iso.copy(program)
    env.run(program).assert_outcomes(passed=2)
    assert set(starts(env.iso).values()) == {(True, None)}


@each_fork
def test_repeated_sessions_in_one_process_leave_no_zombies(env: Env) -> None:
    """Three pytest.main() runs with the fork server in one Python process: each test forked
    from a template each time, and no zombie child of that process left afterwards."""

    env.iso.copy("sessions_in_one_process.py", "test_import_random_seed.py")
    command = [sys.executable, "sessions_in_one_process.py", "test_import_random_seed.py"]
    out = subprocess.run(command, cwd=env.iso.path, capture_output=True, text=True, timeout=300)
    lines = [line for line in out.stdout.splitlines() if line.startswith("DRIVER ")]
    assert len(lines) == 1, out.stdout + out.stderr
    found = json.loads(lines[0].removeprefix("DRIVER "))
    assert found["codes"] == [0, 0, 0], out.stdout + out.stderr
    zombies = [child for child in found["children"] if child["status"] == "zombie"]
    assert zombies == [], found["children"]
    for i in range(3):
        records = env.iso.records(f"report-{i}.json").values()
        assert {(r["start"]["collected"], r["start"]["uncollected"]) for r in records} == {
            (True, None)
        }, i
    assert len(env.lines("random")) == 6
    left = sorted(p.name for p in env.private.iterdir()) if env.private.exists() else []
    assert left == [], left


@pytest.mark.parametrize("which", ["server", "template"])
def test_a_stopped_fork_server_or_template_is_given_up_at_once(
    pytester, tmp_path, monkeypatch, which
) -> None:
    """SIGSTOP (a tool pausing its user's processes): the fork server, or its template, is
    given up on at once (never waited for without bound), the tests after start (spawned,
    or forked by the server) and pass, the session ends and says why."""
    iso = make_gpuiso(pytester, monkeypatch, "forkserver")
    paused = tmp_path / "paused"
    monkeypatch.setenv("PAUSE", which)
    monkeypatch.setenv("PAUSED_FILE", str(paused))
    iso.copy("test_start_paused_helper.py")
    try:
        result = iso.run(
            "--gpu-isolate-startup-timeout=20",
            REPORT,
            "-p",
            "no:randomly",
            "test_start_paused_helper.py",
            timeout=90,
        )
    finally:
        if paused.exists():  # pytest killed it at its end; never leave one stopped
            pid = int(paused.read_text())
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
    result.assert_outcomes(passed=4)
    said = "it is stopped (SIGSTOP: another process paused it)"
    if which == "server":
        assert f"the fork server did not answer (fork): {said}" in result.stdout.str()
    else:
        notes = {r["start"]["uncollected"] for r in iso.records().values()}
        assert f"the template did not fork: {said}" in notes, notes
