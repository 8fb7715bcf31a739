"""Distributed tests (``@pytest.mark.gpu_isolated(ranks=N)``) without a GPU: N processes
run the test together, each with its rank's environment; one verdict names the rank that
failed first, and a rank left waiting for it is stopped after ``rank_wait``, long before
the test's timeout; a bad ``ranks`` is one line naming it."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

from tests.helpers import REPORT

STUCK = "test_ranks.py::test_rank_1_fails_while_rank_0_waits_for_it"
EVERY = "test_ranks.py::test_every_rank_sees_its_rank_and_the_group"


def test_ranks_run_together_and_one_verdict_names_the_rank_that_failed(gpuiso, monkeypatch) -> None:
    gpuiso.copy("test_ranks.py")
    summary = gpuiso.pytester.path / "step-summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    result = gpuiso.run(
        "--gpu-isolate-timeout=300",
        "-rA",
        REPORT,
        "--junitxml=junit.xml",
        "test_ranks.py",
        "-k",
        "not crashes and not own_gpu and not leaks and not session and not four_gpus"
        " and not teardown",
    )
    result.assert_outcomes(passed=4, failed=1, errors=3)  # world sizes 1, 2 and 4 pass
    result.stdout.fnmatch_lines([f"FAILED {STUCK}*"])
    result.stdout.fnmatch_lines(  # the cause first; the rank that waited for it, stopped
        [
            "*- gpu-isolate ranks -*",
            "rank 0: stopped after rank 1 failed",
            "rank 1: failed first: ValueError: rank 1 could not shard",
        ]
    )
    result.stdout.fnmatch_lines(  # the stopped rank's story folded below: where it waited
        [
            "*- gpu-isolate ranks: rank 0 -*",
            "Stopped with its group: rank 1 ended and this one still ran 1 s later, during call*",
            "Stack of the test process (pid *) when its group stopped it:",
            "*line * in test_rank_1_fails_while_rank_0_waits_for_it",
        ]
    )
    result.stdout.fnmatch_lines(  # every rank's output, each under its rank's title
        [
            "*- Captured stdout call -*",
            "rank 0 of 3 done",
            "*- Captured stdout call (rank 1) -*",
            "rank 1 of 3 done",
            "*- Captured stdout call (rank 2) -*",
            "rank 2 of 3 done",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "*invalid value 0 for gpu_isolated marker argument ranks: expected an integer from 1*",
            "*invalid value 100000 for gpu_isolated marker argument ranks: expected an integer "
            "from 1 to 1024, or the name of a parameter holding one",
            "*invalid value 'nodes' for gpu_isolated marker argument ranks: expected a count, "
            "or the name of a parameter (none)*",
        ],
        consecutive=False,
    )
    record = gpuiso.records()[STUCK]
    assert record["outcome"] == "failed"
    assert record["exit"]["expired"] is None  # the cause's: rank 1 failed, not stopped
    waited, failed = record["ranks"]
    assert (waited["rank"], waited["outcome"], waited["expired"]) == (0, "failed", "group")
    assert waited["error"].startswith("Stopped with its group: rank 1 ended and this one still")
    assert (failed["rank"], failed["outcome"], failed["expired"]) == (1, "failed", None)
    assert failed["error"] == "ValueError: rank 1 could not shard"
    assert waited["pid"] != failed["pid"]
    assert [r["outcome"] for r in gpuiso.records()[EVERY]["ranks"]] == ["passed"] * 3
    # junit: the failure names its rank; every rank's properties are there, once each
    cases = {
        f"{case.get('classname')}::{case.get('name')}": case
        for case in ET.parse(gpuiso.pytester.path / "junit.xml").iter("testcase")
    }
    [failure] = cases["test_ranks::test_rank_1_fails_while_rank_0_waits_for_it"].iter("failure")
    assert failure.get("message").startswith("rank 1 failed: ValueError: rank 1 could not"), (
        failure.get("message")
    )
    properties = [
        (p.get("name"), p.get("value"))
        for p in cases["test_ranks::test_every_rank_sees_its_rank_and_the_group"].iter("property")
    ]
    assert properties == [("seen", "0/3"), ("seen (rank 1)", "1/3"), ("seen (rank 2)", "2/3")]
    # the Markdown summary (GitHub's step summary) names the rank that failed first
    assert (
        f"| `{STUCK}` | failed | rank 1 failed: ValueError: rank 1 could not shard |"
        in summary.read_text()
    ), summary.read_text()


def test_a_rank_that_crashes_is_the_cause_and_its_waiting_peer_is_stopped(gpuiso) -> None:
    gpuiso.copy("test_ranks.py")
    result = gpuiso.run("--gpu-isolate-timeout=300", "test_ranks.py", "-k", "crashes")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*Crashed: the isolated test process crashed with SIGSEGV*",
            "*- gpu-isolate ranks -*",
            "rank 0: stopped after rank 1 failed",
            "rank 1: failed first: *SIGSEGV*",
        ]
    )


def test_the_rank_that_failed_first_is_the_cause_when_every_rank_runs_out_its_time(
    gpuiso_spawn,
) -> None:
    """Rank 1 fails in its call, then waits in its teardown; rank 0 waits in its call:
    the first to begin runs past the timeout (5 s) and stops the group. Whichever it was,
    rank 1, whose failed report came first, is the cause."""
    gpuiso_spawn.copy("test_ranks.py")
    result = gpuiso_spawn.run(REPORT, "test_ranks.py", "-k", "waits_in_teardown")
    result.stdout.fnmatch_lines(
        [
            "*- gpu-isolate ranks -*",
            "rank 0: *",  # failed too (its own timeout), or stopped after rank 1
            "rank 1: failed first: ValueError: rank 1 could not shard",
        ]
    )
    test = "test_ranks.py::test_rank_1_fails_then_waits_in_teardown_while_rank_0_waits"
    expired = sorted(r["expired"] for r in gpuiso_spawn.records()[test]["ranks"])
    assert expired in (["test", "test"], ["group", "test"]), expired  # as they began
    if "group" in expired:  # the one stopped with the group says why: the other's timeout
        result.stdout.fnmatch_lines(["*Stopped with its group: rank ? ran past its timeout, *"])


def test_each_rank_leases_its_own_gpus(gpuiso_spawn) -> None:
    """Two declared GPUs, two ranks of one GPU each: each sees one, not the same."""
    gpuiso_spawn.copy("test_ranks.py")
    result = gpuiso_spawn.run(
        "--gpu-isolate-devices=0,1", "test_ranks.py::test_each_rank_sees_its_own_gpu"
    )
    result.assert_outcomes(passed=1)
    skipped = gpuiso_spawn.run(
        "--gpu-isolate-devices=0", "test_ranks.py::test_each_rank_sees_its_own_gpu"
    )
    skipped.assert_outcomes(skipped=1)  # two ranks of one GPU each need two


def test_ranks_of_a_pinned_worker_run_on_its_gpus(gpuiso_spawn, lease_region) -> None:
    """Pinned workers (two GPUs each, all four GPUs pinned): a test of two ranks of one GPU
    each runs under its worker's pin, each rank on one of its GPUs; one of four ranks
    could never get its GPUs while the workers hold theirs: one line saying so."""
    gpuiso_spawn.copy("test_ranks.py")
    pinned = ("--gpu-isolate-pin-workers", "--gpu-isolate-devices=0,1,2,3", "--gpu-isolate-gpus=2")
    result = gpuiso_spawn.run(
        *pinned, "-n", "2", "-rE", "test_ranks.py", "-k", "own_gpu or four_gpus", timeout=120
    )
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*test needs 4 GPUs; its pinned worker holds 2 (*) and *"])


def test_a_ranks_leaks_are_the_tests_and_name_the_rank(gpuiso, shm_name) -> None:
    """Each rank's process is checked on its own: what rank 1 left (a segment, a process
    in a session of its own) is the test's, each leak naming rank 1; rank 0 left none."""
    gpuiso.copy("test_ranks.py")
    result = gpuiso.run("--gpu-isolate-timeout=300", REPORT, "test_ranks.py", "-k", "leaks")
    result.assert_outcomes(passed=1)
    record = gpuiso.records()["test_ranks.py::test_rank_1_leaks_a_segment_and_a_process"]
    kinds = sorted((leak["kind"], leak["rank"]) for leak in record["leaks"])
    assert kinds == [("process", 1), ("shm", 1)], record["leaks"]
    assert all(leak["detail"].startswith("rank 1: ") for leak in record["leaks"])
    assert any(f"/dev/shm/{shm_name}-rank1" in leak["detail"] for leak in record["leaks"])
    clean, leaky = record["ranks"]
    assert clean["leaks"] == [] and len(leaky["leaks"]) == 2, record["ranks"]
    assert [e["cmdline"] for e in record["escaped"]] == ["sleep 300"], record["escaped"]
    result.stdout.fnmatch_lines([f"*rank 1: segment /dev/shm/{shm_name}-rank1*"])
    result.stdout.fnmatch_lines(["gpu-isolate: 1 isolated, *1 escaped process killed*"])


def test_groups_beside_ordinary_tests_under_xdist_never_share_a_port(
    gpuiso_spawn, tmp_path, monkeypatch
) -> None:
    """Under ``-n 2``: four groups of two ranks and four ordinary isolated tests all pass;
    the ranks of a group share its port, and two groups that held theirs at the same time
    had different ones (at least one such pair ran: the test proves something)."""
    notes = tmp_path / "notes"
    notes.mkdir()
    monkeypatch.setenv("RANKS_NOTES", str(notes))
    gpuiso_spawn.copy("test_ranks_beside.py")
    result = gpuiso_spawn.run("-n", "2", "test_ranks_beside.py")
    result.assert_outcomes(passed=8)
    held = [json.loads(p.read_text()) for p in notes.glob("*.json")]
    groups: dict[int, set[str]] = {}
    for note in held:
        groups.setdefault(note["test"], set()).add(note["port"])
    assert sorted(groups) == [0, 1, 2, 3] and all(len(p) == 1 for p in groups.values()), groups
    overlapping = [
        (a, b)
        for a in held
        for b in held
        if a["test"] < b["test"] and a["start"] < b["end"] and b["start"] < a["end"]
    ]
    assert overlapping, held  # two groups ran at the same time
    assert all(a["port"] != b["port"] for a, b in overlapping), overlapping


def test_a_rank_whose_test_ended_is_not_stopped_while_its_process_ends(gpuiso_spawn) -> None:
    """rank_wait bounds ranks still in their test: rank 0, whose test passed, then takes
    3 s to end its session (rank_wait=1) and keeps its own exit bound; the test passes."""
    gpuiso_spawn.copy("test_ranks.py")
    result = gpuiso_spawn.run(REPORT, "test_ranks.py", "-k", "ends_its_session_slowly")
    result.assert_outcomes(passed=1)
    ranks = gpuiso_spawn.records()["test_ranks.py::test_rank_0_ends_its_session_slowly"]["ranks"]
    assert [(r["outcome"], r["expired"]) for r in ranks] == [("passed", None)] * 2, ranks


def test_rank_wait_from_the_ini_then_the_command_line(gpuiso_spawn) -> None:
    """``gpu_isolate_rank_wait`` < ``--gpu-isolate-rank-wait`` < the marker's (above); the
    rank left waiting says how long it was given (its error, in the JSON record)."""
    gpuiso_spawn.copy("test_ranks.py")
    gpuiso_spawn.pytester.makeini("[pytest]\ngpu_isolate_rank_wait = 0.7\n")
    test = "test_ranks.py::test_rank_1_fails_while_rank_0_waits_the_sessions_rank_wait"
    for args, said in [((), "0.7 s later"), (("--gpu-isolate-rank-wait=0.4",), "0.4 s later")]:
        result = gpuiso_spawn.run(*args, REPORT, "test_ranks.py", "-k", "sessions_rank_wait")
        result.assert_outcomes(failed=1)
        waited = gpuiso_spawn.records()[test]["ranks"][0]
        assert waited["expired"] == "group" and said in waited["error"], waited
