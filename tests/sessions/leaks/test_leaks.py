"""Leak checks over real pytest sessions: /dev/shm entries, leftover processes, policies,
reports. Each test runs the programs in fixtures/programs/ through the ``gpuiso`` fixture
and asserts on outcomes, the JSON report, the terminal and what is left on the machine."""

from __future__ import annotations

import contextlib
import json
import os
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path

import psutil
import pytest

from tests.helpers import REPORT, SHM, kill_quietly, pid_alive, wait_gone

MOD = "test_leak_shm.py"


@contextlib.contextmanager
def leftovers_run(gpuiso, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, program, *args):
    """Run ``program`` with every test isolated and $GPUISO_PIDFILE set; yield the result
    and the pids the program wrote there; kill those still alive afterwards."""
    gpuiso.copy(program)
    pidfile = tmp_path / "pids"
    monkeypatch.setenv("GPUISO_PIDFILE", str(pidfile))
    result = gpuiso.run("--gpu-isolate", *args)
    pids = [int(p) for p in pidfile.read_text().split()] if pidfile.exists() else []
    try:
        yield result, pids
    finally:
        kill_quietly([p for p in pids if pid_alive(p)])


def leaks_of(records: dict, test: str) -> list[dict]:
    return records[f"{MOD}::{test}"]["leaks"]


def test_shm_leaks_are_reported_with_name_size_and_creator(gpuiso, shm_name):
    gpuiso.copy(MOD)
    result = gpuiso.run(
        "--gpu-isolate",
        REPORT,
        "-k",
        "leaks_segment or raw_file or torch_style or clean_segment or still_maps",
    )
    result.assert_outcomes(passed=5, warnings=4)
    records = gpuiso.records()
    [seg] = leaks_of(records, "test_leaks_segment")
    assert seg["kind"] == "shm"
    assert seg["path"] == f"/dev/shm/{shm_name}-seg"
    assert seg["size"] == 8192
    assert seg["pid"] == records[f"{MOD}::test_leaks_segment"]["pid"]  # the shim saw it
    assert seg["cleaned"] is False
    assert seg["detail"] == (
        f"segment /dev/shm/{shm_name}-seg (8 KiB, created by pid {seg['pid']}) left in /dev/shm"
    )
    [raw] = leaks_of(records, "test_leaks_raw_file")
    assert (raw["path"], raw["size"]) == (f"/dev/shm/{shm_name}-raw", 100)
    [torch_style] = leaks_of(records, "test_leaks_torch_style_name")
    assert torch_style["pid"] == records[f"{MOD}::test_leaks_torch_style_name"]["pid"]
    assert leaks_of(records, "test_clean_segment") == []
    # Mapped by the test's process to its end (which the fork server's does not wait for
    # once it is past its exit: ``leaving``), held by nobody after it.
    [mapped] = leaks_of(records, "test_leaks_a_segment_it_still_maps")
    assert (mapped["path"], mapped["size"]) == (f"/dev/shm/{shm_name}-mapped", 4096)
    # Reported, not deleted (no --gpu-isolate-cleanup).
    assert (SHM / f"{shm_name}-seg").exists() and (SHM / f"{shm_name}-raw").exists()
    assert not (SHM / f"{shm_name}-clean").exists()
    result.stdout.fnmatch_lines(
        [
            "*GpuIsoLeakWarning: shm: segment /dev/shm/*-seg (8 KiB, created by pid *",
            "*- gpu-isolate leak summary -*",
            "gpu-isolate: 4 leaks in 4 tests (4 shm, 0 process, 0 gpu_memory)",
            f"  {MOD}::test_leaks_segment: 1 shm",
        ]
    )


def test_shm_ignore_patterns_and_allow_leaks_marker(gpuiso_spawn, shm_name):
    gpuiso_spawn.copy(MOD)
    gpuiso_spawn.pytester.makeini(
        f"[pytest]\ngpu_isolate_shm_ignore = other-* {shm_name}-ignored-*\n"
    )
    result = gpuiso_spawn.run(
        "--gpu-isolate", REPORT, "--gpu-isolate-leaks=fail", "-k", "ignored or allowed"
    )
    result.assert_outcomes(passed=2)
    records = gpuiso_spawn.records()
    assert leaks_of(records, "test_ignored_segment") == []
    [allowed] = leaks_of(records, "test_allowed_leak")
    assert allowed["allowed"] is True and allowed["path"].endswith("-allowed")
    result.stdout.fnmatch_lines(["gpu-isolate: 1 more allowed by allow_leaks markers"])


def test_fail_policy_turns_a_leak_into_a_teardown_error(gpuiso_spawn, shm_name):
    gpuiso_spawn.copy(MOD)
    result = gpuiso_spawn.run(
        "--gpu-isolate",
        REPORT,
        "--gpu-isolate-leaks=warn,shm=fail",
        "-k",
        "leaks_segment or clean_segment",
    )
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*_ ERROR at teardown of test_leaks_segment _*",
            "gpu-isolate: the test left 1 leak behind "
            "(--gpu-isolate-leaks shm=fail,process=warn,gpu_memory=warn):",
            f"  shm: segment /dev/shm/{shm_name}-seg (8 KiB, created by pid *",
        ]
    )
    records = gpuiso_spawn.records()
    assert records[f"{MOD}::test_leaks_segment"]["outcome"] == "error"
    assert records[f"{MOD}::test_clean_segment"]["outcome"] == "passed"


def test_off_policy_reports_nothing(gpuiso_spawn, shm_name):
    gpuiso_spawn.copy(MOD)
    gpuiso_spawn.pytester.makeini("[pytest]\ngpu_isolate_leaks = off\n")
    result = gpuiso_spawn.run("--gpu-isolate", REPORT, "-k", "leaks_segment")
    result.assert_outcomes(passed=1)
    assert leaks_of(gpuiso_spawn.records(), "test_leaks_segment") == []
    assert "leak summary" not in result.stdout.str()
    result.stdout.fnmatch_lines(["gpu-isolate: leak checks shm=off, process=off, gpu_memory=off*"])


def test_cleanup_deletes_only_what_the_test_leaked(gpuiso, shm_name):
    gpuiso.copy(MOD)
    older = SHM / f"{shm_name}-raw"  # same name as the test will use, but there before
    older.write_bytes(b"old")
    inode = older.stat().st_ino
    result = gpuiso.run(
        "--gpu-isolate", REPORT, "--gpu-isolate-cleanup", "-k", "leaks_segment or raw_file"
    )
    result.assert_outcomes(passed=2, warnings=1)
    records = gpuiso.records()
    [seg] = leaks_of(records, "test_leaks_segment")
    assert seg["cleaned"] is True and seg["detail"].endswith("(deleted)")
    assert not (SHM / f"{shm_name}-seg").exists()
    # The test rewrote an entry that existed before it: not a leak, not deleted.
    assert leaks_of(records, "test_leaks_raw_file") == []
    assert older.exists() and older.stat().st_ino == inode


def test_xdist_attributes_each_segment_to_its_own_test(gpuiso, shm_name):
    """Two workers, two tests at once: only the test that made the segment reports it."""
    gpuiso.copy(MOD)
    result = gpuiso.run(
        "--gpu-isolate", REPORT, "-n", "2", "-k", "while_neighbour_runs or slow_clean"
    )
    result.assert_outcomes(passed=2, warnings=1)
    records = gpuiso.records()
    [mine] = leaks_of(records, "test_leaks_while_neighbour_runs")
    assert mine["path"] == f"/dev/shm/{shm_name}-mine"
    assert leaks_of(records, "test_slow_clean_neighbour") == []


def test_leftover_processes_are_reported_killed_and_clean_children_are_not(
    gpuiso, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    run = leftovers_run(
        gpuiso, tmp_path, monkeypatch, "test_escape.py", REPORT, "--junitxml=junit.xml"
    )
    with run as (result, pids):
        result.assert_outcomes(passed=3, warnings=2)
        assert len(pids) == 2
        assert wait_gone(pids, timeout=5) == []
        records = {k.split("::")[1]: v for k, v in gpuiso.records().items()}
        [daemon] = records["test_double_fork_daemon"]["leaks"]
        [popen] = records["test_setsid_popen"]["leaks"]
        assert records["test_clean_subprocess"]["leaks"] == []
        assert (daemon["kind"], daemon["pid"]) == ("process", pids[0])
        assert (popen["kind"], popen["pid"]) == ("process", pids[1])
        assert "time.sleep(1000)" in popen["cmdline"]
        assert popen["detail"].startswith(f"process {pids[1]} still running after the test")
        assert records["test_setsid_popen"]["escaped"] == [
            {"pid": pids[1], "cmdline": popen["cmdline"]}
        ]
        # Each leak is a junit property of its testcase.
        cases = {c.get("name"): c for c in ET.parse(gpuiso.path / "junit.xml").iter("testcase")}
        props = [
            (p.get("name"), p.get("value")) for p in cases["test_setsid_popen"].iter("property")
        ]
        assert props == [("gpu_isolate_leak", f"process: {popen['detail']}")]
        assert list(cases["test_clean_subprocess"].iter("property")) == []


def test_a_leftover_spawning_while_it_is_killed_leaves_nothing(
    gpuiso, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A leftover that keeps starting processes: those it starts after the check listed
    the test's leftovers (during the settle and TERM grace) are found by a second look,
    reported and killed too; nothing outlives the session."""
    run = leftovers_run(gpuiso, tmp_path, monkeypatch, "test_escape_spawner.py", REPORT)
    with run as (result, pids):
        assert wait_gone(pids, timeout=5) == []
        [record] = gpuiso.records().values()
        leaked = {leak["pid"] for leak in record["leaks"]}
        result.assert_outcomes(passed=1, warnings=len(leaked))  # a warning per leftover
        assert pids[0] in leaked  # the spawner
        assert len(leaked) > 1  # and the children it had started (one maybe before its pid
        # reached the file): nothing else. A child caught between its fork and its exec
        # still has the spawner's command line.
        spawner = {leak["cmdline"] for leak in record["leaks"] if leak["pid"] == pids[0]}
        others = {leak["cmdline"] for leak in record["leaks"] if leak["pid"] != pids[0]}
        assert "sleep 1000" in others and others <= {"sleep 1000", *spawner}, others


def test_a_term_ignoring_leftover_that_keeps_forking_leaves_nothing(
    gpuiso, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A chain of leftovers that ignore SIGTERM, each forking the next 0.2 s after it
    started: the links born during the grace are stopped as they are found and killed;
    none is left after the session."""
    run = leftovers_run(
        gpuiso, tmp_path, monkeypatch, "test_escape_chain.py", "--gpu-isolate-grace=0.5", REPORT
    )
    with run as (result, pids):
        assert wait_gone(pids, timeout=5) == []
        [record] = gpuiso.records().values()
        leaked = {leak["pid"] for leak in record["leaks"]}
        result.assert_outcomes(passed=1, warnings=len(leaked))
        assert set(pids) <= leaked  # every link that got to write its pid was reported


def _with_pre_go_conftest(gpuiso, monkeypatch, program: str, daemon: bool, name: str) -> str:
    """Copy ``program`` with start_pre_go_conftest.py as its conftest: every test's process
    makes a process (a setsid daemon if ``daemon``) and a /dev/shm entry before its go,
    named with the returned tag (gpuiso-<name>-<random>)."""
    tag = f"gpuiso-{name}-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("GPUISO_PRE_GO_TAG", tag)
    monkeypatch.setenv("GPUISO_PRE_GO_DAEMON", "1" if daemon else "0")
    gpuiso.copy(program, "start_pre_go_conftest.py")
    (gpuiso.path / "start_pre_go_conftest.py").rename(gpuiso.path / "conftest.py")
    return tag


@pytest.mark.parametrize("daemon", [False, True], ids=["child", "daemon"])
def test_what_a_discarded_prewarmed_process_made_goes_with_it(
    gpuiso, shm_name, daemon, monkeypatch
):
    """-x after the first test: the two processes prewarmed for the next tests are
    discarded. What their plugins made before their turn (a process, a daemon in its own
    session, a /dev/shm entry) goes with them: nothing is left after the session."""
    tag = _with_pre_go_conftest(gpuiso, monkeypatch, "test_discarded_prewarm.py", daemon, "discard")
    result = gpuiso.run(
        "--gpu-isolate", "--gpu-isolate-cleanup", "-x", "--gpu-isolate-prewarm=2", REPORT
    )
    result.assert_outcomes(failed=1, warnings=2)  # the first test's own two leaks
    [record] = gpuiso.records().values()
    assert sorted(leak["kind"] for leak in record["leaks"]) == ["process", "shm"]
    tagged = [p.pid for p in psutil.process_iter(["cmdline"]) if tag in (p.info["cmdline"] or [])]
    try:
        assert wait_gone(tagged, timeout=10) == []
        assert list(SHM.glob(f"{shm_name}*")) == []
    finally:
        kill_quietly(tagged)


def test_orphans_of_the_test_body_are_not_its_processs_children(gpuiso):
    """Each test's process is a child subreaper only until its go: the orphans its test
    makes go to pytest, so os.wait() in the test returns the test's own child."""
    gpuiso.copy("test_orphans.py")
    gpuiso.run("--gpu-isolate", REPORT).assert_outcomes(passed=1)


def test_a_short_helper_a_leftover_runs_on_its_way_out_is_not_a_leak(
    gpuiso, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Processes found after the leftovers were killed get the same settle time as the
    leftovers: a helper that exits by itself at once is not reported; the leftover is."""
    run = leftovers_run(gpuiso, tmp_path, monkeypatch, "test_escape_term_helper.py", REPORT)
    with run as (result, pids):
        result.assert_outcomes(passed=1, warnings=1)
        [record] = gpuiso.records().values()
        assert [leak["pid"] for leak in record["leaks"]] == pids


def test_process_policy_fail(gpuiso_spawn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    gpuiso_spawn.copy("test_escape.py")
    monkeypatch.setenv("GPUISO_PIDFILE", str(tmp_path / "pids"))
    result = gpuiso_spawn.run("--gpu-isolate", "--gpu-isolate-leaks=process=fail", "-k", "setsid")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        ["*ERROR at teardown of test_setsid_popen*", "  process: process * still running *"]
    )


def test_markdown_summary_and_github_step_summary(
    gpuiso_spawn, shm_name, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    gpuiso_spawn.copy(MOD, "test_crashes.py")
    step = tmp_path / "step.md"
    step.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(step))
    result = gpuiso_spawn.run(
        "--gpu-isolate",
        "--gpu-isolate-summary=out/summary.md",
        f"{MOD}::test_leaks_segment",
        f"{MOD}::test_clean_segment",
        "test_crashes.py::test_segfault",
    )
    result.assert_outcomes(passed=2, failed=1, warnings=1)
    text = (gpuiso_spawn.path / "out" / "summary.md").read_text()
    assert step.read_text() == "earlier step\n" + text
    lines = text.splitlines()
    assert lines[0] == "## pytest-gpuiso"
    assert "**3 isolated tests** (1 failed, 2 passed)" in lines
    assert "| 1 in 1 tests | 1 | 0 | 0 | 0 | 1 |" in lines
    assert any(
        line.startswith(f"| `{MOD}::test_leaks_segment` | shm | segment /dev/shm/{shm_name}-seg")
        for line in lines
    )
    assert "| `test_crashes.py::test_segfault` | failed | crashed with SIGSEGV |" in lines
    result.stdout.fnmatch_lines(
        ["gpu-isolate: Markdown summary written to *summary.md, $GITHUB_STEP_SUMMARY"]
    )


def test_xdist_controller_aggregates_leaks_of_every_worker(gpuiso_spawn, shm_name):
    gpuiso_spawn.copy(MOD)
    result = gpuiso_spawn.run(
        "--gpu-isolate",
        REPORT,
        "--gpu-isolate-summary=summary.md",
        "-n",
        "2",
        "-k",
        "leaks_segment or raw_file or torch_style or clean_segment",
    )
    result.assert_outcomes(passed=4, warnings=3)
    records = gpuiso_spawn.records()
    assert sorted(len(r["leaks"]) for r in records.values()) == [0, 1, 1, 1]
    assert "| 3 in 3 tests | 3 | 0 | 0 | 0 | 0 |" in (gpuiso_spawn.path / "summary.md").read_text()


def test_records_of_a_crashed_worker_are_not_lost(gpuiso_spawn, shm_name):
    """Records ride on each test's reports: tests finished before a worker dies keep theirs."""
    gpuiso_spawn.pytester.makepyfile(
        test_kill_worker="""
        import os, signal, pytest

        @pytest.mark.gpu_isolated
        def test_1_leaks():
            with open("/dev/shm/" + os.environ["GPUISO_SHM_NAME"] + "-w", "wb") as f:
                f.write(b"w")

        def test_2_kills_its_worker():  # in-process (not marked): takes the xdist worker down
            os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    result = gpuiso_spawn.run(REPORT, "-n", "1", "test_kill_worker.py")
    result.stdout.fnmatch_lines(["*worker 'gw0' crashed while running*test_2_kills_its_worker*"])
    records = gpuiso_spawn.records()
    [leak] = records["test_kill_worker.py::test_1_leaks"]["leaks"]
    assert leak["path"] == f"/dev/shm/{shm_name}-w"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpu-isolate-leaks=shm=loud"], "bad part 'shm=loud'"),
        (["--gpu-isolate-leaks=gpu=fail"], "bad part 'gpu=fail'"),
        (["--gpu-isolate-leaks=warn,"], "bad part ''"),
        (["--gpu-isolate-leaks=shm=fail,shm=warn"], "shm is given twice"),
        (["--gpu-isolate-gpu-tolerance=lots"], "--gpu-isolate-gpu-tolerance"),
        (["-o", "gpu_isolate_leaks=maybe"], "ini gpu_isolate_leaks"),
        (["-o", "gpu_isolate_cleanup=perhaps"], "ini gpu_isolate_cleanup"),
        (["-o", "gpu_isolate_torch_check=2"], "ini gpu_isolate_torch_check"),
    ],
)
def test_bad_leak_options_are_one_line_usage_errors(gpuiso_spawn, args, message):
    gpuiso_spawn.copy(MOD)
    result = gpuiso_spawn.run("--gpu-isolate", *args, "-k", "clean_segment")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    errors = [line for line in result.stderr.lines if line.startswith("ERROR:")]
    assert len(errors) == 1 and message in errors[0], result.stderr.str()
    assert "Traceback" not in result.stderr.str()


def test_bad_allow_leaks_marker_fails_only_its_test(gpuiso_spawn):
    gpuiso_spawn.pytester.makepyfile(
        test_bad="""
        import pytest

        @pytest.mark.gpu_isolated(allow_leaks=["shm", "gpu"])
        def test_bad():
            pass

        @pytest.mark.gpu_isolated(allow_leaks=["process"])
        def test_good():
            pass
        """
    )
    result = gpuiso_spawn.run()
    result.assert_outcomes(passed=1, errors=1)
    assert (
        "gpu-isolate: invalid value ['shm', 'gpu'] for gpu_isolated marker argument "
        "allow_leaks: expected a kind or a list of kinds (shm, process, gpu_memory), or all "
        "(unknown kind 'gpu')"
    ) in result.outlines


def test_header_says_the_gpu_probe_is_unavailable_once(gpuiso_spawn, shm_name):
    gpuiso_spawn.copy(MOD)
    result = gpuiso_spawn.run(
        "--gpu-isolate", "--gpu-isolate-devices=0,1", REPORT, "-k", "clean_segment or raw"
    )
    result.assert_outcomes(passed=2, warnings=1)
    out = result.stdout.str()
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("a GPU driver is present: NVML is available here")
    assert out.count("gpu_memory unavailable") == 1
    result.stdout.fnmatch_lines(
        ["gpu-isolate: leak checks shm=warn, * (gpu_memory unavailable: *)"]
    )
    assert all(
        leak["kind"] != "gpu_memory" for r in gpuiso_spawn.records().values() for leak in r["leaks"]
    )


def test_leak_records_in_json_have_kind_and_detail(gpuiso_spawn, shm_name):
    gpuiso_spawn.copy(MOD)
    gpuiso_spawn.run("--gpu-isolate", REPORT, "-k", "leaks_segment")
    document = json.loads((gpuiso_spawn.path / "report.json").read_text())
    [record] = document["tests"]
    [leak] = record["leaks"]
    assert set(leak) == {"kind", "detail", "path", "size", "pid", "cleaned", "level"}


@pytest.mark.parametrize("daemon", [False, True], ids=["child", "daemon"])
@pytest.mark.parametrize("prewarm", [0, 1])
def test_leaks_made_before_the_go_are_the_tests(gpuiso, shm_name, prewarm, daemon, monkeypatch):
    """A process and a segment that a test's process made before its turn (a plugin's
    pytest_configure / pytest_sessionstart; earlier still when it was prewarmed) are that
    test's leaks: reported for it, killed and deleted, nothing left after the session.
    Also when the process is a daemon, orphaned at once: the test's process is a child
    subreaper, so the daemon stays in its tree rather than being blamed on the test
    running beside a prewarmed process."""
    tag = _with_pre_go_conftest(gpuiso, monkeypatch, "test_start_pre_go.py", daemon, "pre-go")
    result = gpuiso.run(
        "--gpu-isolate", REPORT, "--gpu-isolate-cleanup", f"--gpu-isolate-prewarm={prewarm}"
    )
    result.assert_outcomes(passed=2, warnings=4)
    records = gpuiso.records()
    for test in ("test_first", "test_second"):
        record = records[f"test_start_pre_go.py::{test}"]
        kinds = sorted(leak["kind"] for leak in record["leaks"])
        assert kinds == ["process", "shm"], record["leaks"]
        [proc] = [leak for leak in record["leaks"] if leak["kind"] == "process"]
        assert proc["cmdline"].endswith(f"{tag} {record['pid']}")  # its own process's
        [shm] = [leak for leak in record["leaks"] if leak["kind"] == "shm"]
        assert shm["path"] == f"/dev/shm/{shm_name}-{record['pid']}" and shm["cleaned"]
    assert list(SHM.glob(f"{shm_name}*")) == []
    assert [
        p.pid for p in psutil.process_iter(["cmdline"]) if tag in (p.info["cmdline"] or [])
    ] == []
