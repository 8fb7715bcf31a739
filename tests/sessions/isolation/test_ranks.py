"""Distributed tests (``@pytest.mark.gpu_isolated(ranks=N)``) without a GPU: N processes
run the test together, each with its rank's environment; one verdict names the rank that
failed first, and a rank left waiting for it is stopped after ``rank_wait``, long before
the test's timeout; a bad ``ranks`` is one line naming it."""

from __future__ import annotations

from tests.helpers import REPORT

STUCK = "test_ranks.py::test_rank_1_fails_while_rank_0_waits_for_it"
EVERY = "test_ranks.py::test_every_rank_sees_its_rank_and_the_group"


def test_ranks_run_together_and_one_verdict_names_the_rank_that_failed(gpuiso) -> None:
    gpuiso.copy("test_ranks.py")
    result = gpuiso.run(
        "--gpu-isolate-timeout=300",
        "-rA",
        REPORT,
        "test_ranks.py",
        "-k",
        "not crashes and not own_gpu",
    )
    result.assert_outcomes(passed=3, failed=1, errors=2)
    result.stdout.fnmatch_lines([f"FAILED {STUCK}*"])
    result.stdout.fnmatch_lines(  # the cause first; the rank that waited for it, stopped
        [
            "*- gpu-isolate ranks -*",
            "rank 0: stopped after rank 1 failed",
            "rank 1: failed first: ValueError: rank 1 could not shard",
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
            "*invalid value 0 for gpu_isolated marker argument ranks: expected an integer >= 1*",
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
    assert waited["error"].startswith("Stopped: another rank of this distributed test ended")
    assert (failed["rank"], failed["outcome"], failed["expired"]) == (1, "failed", None)
    assert failed["error"] == "ValueError: rank 1 could not shard"
    assert waited["pid"] != failed["pid"]
    assert [r["outcome"] for r in gpuiso.records()[EVERY]["ranks"]] == ["passed"] * 3


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
