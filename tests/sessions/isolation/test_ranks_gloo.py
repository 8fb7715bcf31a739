"""Distributed tests on torch.distributed's gloo backend, on the CPU: ranks that pass an
``all_reduce`` at 2 and 4 ranks; a rank that fails after it, named as the cause while the
others passed; a rank that fails while another is stuck: named first, the stuck one
stopped after ``rank_wait`` (2 s), long before the test's timeout (300 s), with its
stack; a rank that never joins the collective its peer waits in: the test's timeout
ends both, each with its stack (the waiting one's inside ``all_reduce``). They need
torch (CI's ML stage); they run under the fork server (the start methods' differences
are proven on lighter programs, tests/sessions/isolation/test_ranks.py)."""

from __future__ import annotations

import re

import pytest

from tests.helpers import REPORT

pytestmark = pytest.mark.ml
pytest.importorskip("torch.distributed")

AFTER = "test_gloo.py::test_rank_1_fails_after_the_collective"
STUCK = "test_gloo.py::test_rank_1_fails_while_rank_3_is_stuck"
NEVER = "test_gloo.py::test_rank_1_never_joins_the_collective"


def test_gloo_ranks_reduce_and_one_verdict_names_the_failing_rank(gpuiso_forkserver) -> None:
    gpuiso = gpuiso_forkserver
    gpuiso.copy("test_gloo.py")
    result = gpuiso.run("-rA", REPORT, "test_gloo.py")
    result.assert_outcomes(passed=2, failed=3)
    records = gpuiso.records()
    for world in (2, 4):
        ranks = records[f"test_gloo.py::test_all_reduce[{world}]"]["ranks"]
        assert [(r["rank"], r["outcome"]) for r in ranks] == [(i, "passed") for i in range(world)]
    result.stdout.fnmatch_lines(
        [
            "*- gpu-isolate ranks -*",
            "rank 0: passed",
            "rank 1: failed first: AssertionError: rank 1 saw 3.0*",
        ]
    )
    after = records[AFTER]["ranks"]
    assert [(r["outcome"], r["expired"]) for r in after] == [("passed", None), ("failed", None)]

    stuck = records[STUCK]
    assert stuck["outcome"] == "failed"
    assert stuck["duration"] < 120  # stopped after rank_wait, not at the 300 s timeout
    ranks = stuck["ranks"]
    assert ranks[1]["error"] == "RuntimeError: rank 1 ran out of data"
    assert (ranks[3]["outcome"], ranks[3]["expired"]) == ("failed", "group")
    said = r"Stopped with its group: rank \d ended and this one still ran 2 s later"
    assert re.match(said, ranks[3]["error"]), ranks[3]["error"]
    for r in (ranks[0], ranks[2]):  # in the all_reduce: gloo failed it once rank 1 had gone
        assert r["outcome"] == "failed" and r["expired"] in (None, "group"), r
    result.stdout.fnmatch_lines(
        ["*- gpu-isolate ranks -*", "rank 1: failed first: RuntimeError: rank 1 ran out of data"]
    )
    result.stdout.fnmatch_lines(["rank 3: stopped after rank 1 failed"])

    never = records[NEVER]
    assert never["outcome"] == "failed"
    assert never["exit"]["expired"] == "test"  # the test's timeout covers the group
    waited, stuck_rank = never["ranks"]
    assert {waited["expired"], stuck_rank["expired"]} <= {"test", "group"}
    assert "all_reduce" in waited["stack"] and "_load_batch" in stuck_rank["stack"]
    for r in (waited, stuck_rank):
        assert "Threads in the kernel (/proc/PID/task/*/wchan):" in r["stack"], r["stack"]
