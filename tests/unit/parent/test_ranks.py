"""One verdict from a distributed test's ranks: the first rank to fail is its cause and
is named, the others' stories are told, every rank passing or skipping is the test's
outcome, ranks that disagree on a skip are an error naming them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pytest_gpuiso.gpu.health import RunEnd
from pytest_gpuiso.leaks import Leak
from pytest_gpuiso.parent.distributed import _every_ranks_escaped
from pytest_gpuiso.parent.group import Ended
from pytest_gpuiso.parent.outcome import End, Outcome
from pytest_gpuiso.parent.ranks import SECTION, RankRun, in_doubt, one_verdict, state_of

NODEID = "test_dist.py::test_all_reduce"
ITEM = SimpleNamespace(
    nodeid=NODEID, location=("test_dist.py", 3, "test_all_reduce"), keywords={}, user_properties=[]
)


def _report(when: str, outcome: str = "passed", longrepr=None, sections=()) -> pytest.TestReport:
    return pytest.TestReport(
        NODEID, ITEM.location, {}, outcome, longrepr, when, sections=list(sections)
    )


def _passed(out: str = "") -> list[pytest.TestReport]:
    sections = [("Captured stdout call", out)] if out else []
    return [_report("setup"), _report("call", sections=sections), _report("teardown")]


def _failed(message: str) -> list[pytest.TestReport]:
    try:
        raise ValueError(message)
    except ValueError as exc:
        longrepr = pytest.ExceptionInfo.from_exception(exc).getrepr()
    return [_report("setup"), _report("call", "failed", longrepr), _report("teardown")]


def _skipped(reason: str) -> list[pytest.TestReport]:
    return [_report("setup", "skipped", ("test_dist.py", 3, reason)), _report("teardown")]


def test_the_first_rank_to_fail_is_the_cause_and_every_ranks_story_is_told():
    runs = [
        RankRun(0, _passed(), ended_at=None, stopped=True),  # stuck in a collective
        RankRun(1, _failed("bad shard"), ended_at=10.0),
        RankRun(2, _failed("peer went away"), ended_at=11.0),
        RankRun(3, _passed(), ended_at=10.5),
    ]
    reports = one_verdict(ITEM, runs)
    call = reports[1]
    assert call.failed
    assert call.longrepr.reprcrash.message == "rank 1 failed: ValueError: bad shard"
    assert runs[1].reports[1].longrepr.reprcrash.message == "ValueError: bad shard"  # as sent
    story = dict(call.sections)[SECTION].splitlines()
    assert story == [
        "rank 0: stopped after rank 1 failed",
        "rank 1: failed first: ValueError: bad shard",
        "rank 2: failed too: ValueError: peer went away",
        "rank 3: passed",
    ]


def test_a_rank_stopped_for_its_group_is_the_cause_only_where_every_failed_rank_was():
    runs = [
        RankRun(0, _failed("timed out"), ended_at=None, stopped=True),
        RankRun(1, _failed("killed"), ended_at=None, stopped=True),
    ]
    call = one_verdict(ITEM, runs)[1]
    assert call.longrepr.reprcrash.message.startswith("rank 0 failed:")
    runs[1] = RankRun(1, _failed("crashed"), ended_at=3.0)
    call = one_verdict(ITEM, runs)[1]
    assert call.longrepr.reprcrash.message == "rank 1 failed: ValueError: crashed"


def test_a_rank_that_failed_before_its_group_stopped_it_is_the_cause():
    """Rank 1 fails in its call (its report read at 1.0), then hangs in a teardown
    barrier; rank 0, stuck in a collective, runs past its own timeout (not stopped for
    its group, its process never ended by itself) and stops the group: rank 1 is the
    cause, rank 0's failure the consequence. A crash (no failed report, the process's
    end) still counts by when the process ended."""
    runs = [
        RankRun(0, _failed("timed out"), ended_at=None),  # past its own timeout
        RankRun(1, _failed("bad shard"), ended_at=None, stopped=True, failed_at=1.0),
    ]
    call = one_verdict(ITEM, runs)[1]
    assert call.longrepr.reprcrash.message == "rank 1 failed: ValueError: bad shard"
    assert dict(call.sections)[SECTION].splitlines() == [
        "rank 0: failed too: ValueError: timed out",
        "rank 1: failed first: ValueError: bad shard",
    ]
    runs = [
        RankRun(0, _failed("Connection closed by peer"), ended_at=2.5, failed_at=2.1),
        RankRun(1, _failed("SIGSEGV"), ended_at=2.0),  # crashed: no report of its own
    ]
    assert one_verdict(ITEM, runs)[1].longrepr.reprcrash.message.startswith("rank 1 failed:")


def test_ranks_that_all_pass_are_rank_0s_reports_with_every_ranks_output():
    runs = [RankRun(0, _passed("from 0"), 1.0), RankRun(1, _passed("from 1"), 1.0)]
    reports = one_verdict(ITEM, runs)
    assert [r.outcome for r in reports] == ["passed", "passed", "passed"]
    assert reports[1].sections == [
        ("Captured stdout call", "from 0"),
        ("Captured stdout call (rank 1)", "from 1"),
    ]
    assert runs[0].reports[1].sections == [("Captured stdout call", "from 0")]  # untouched


def test_every_rank_skipped_is_a_skip_and_ranks_that_disagree_are_one_error():
    skipped = one_verdict(
        ITEM, [RankRun(0, _skipped("no nccl"), 1.0), RankRun(1, _skipped("no nccl"), 1.0)]
    )
    assert [r.outcome for r in skipped] == ["skipped", "passed"]
    mixed = one_verdict(ITEM, [RankRun(0, _skipped("no nccl"), 1.0), RankRun(1, _passed(), 1.0)])
    assert mixed[0].failed and mixed[0].when == "setup"
    assert "the ranks disagree: rank 0 skipped, rank 1 passed" in str(mixed[0].longrepr)


@pytest.mark.parametrize(
    ("reports", "state"),
    [(_passed(), "passed"), (_failed("x"), "failed"), (_skipped("r"), "skipped")],
)
def test_each_ranks_state_is_read_from_its_reports(reports, state):
    assert state_of(reports) == state


def _run_end(timed_out=False, signal=None, errors=()) -> RunEnd:
    return RunEnd(timed_out, signal, list(errors), [], {})


def test_the_groups_gpus_are_judged_by_the_rank_that_put_them_in_doubt():
    """Not rank 0's run alone: a rank that crashed or hit a sticky CUDA error, before one
    stopped for its group (which also ran out of time); rank 0's where none did."""
    clean, stopped = _run_end(), _run_end(timed_out=True, signal="SIGKILL")
    sticky = _run_end(errors=["RuntimeError: CUDA error: an illegal memory access was encountered"])
    crashed = _run_end(signal="SIGSEGV")
    assert in_doubt([clean, sticky, clean], [False] * 3) is sticky
    assert in_doubt([stopped, crashed], [True, False]) is crashed
    assert in_doubt([stopped, clean], [True, False]) is stopped  # stopped: still in doubt
    assert in_doubt([clean, clean], [False, False]) is clean


def test_the_record_has_every_ranks_escaped_processes_whichever_rank_it_is_made_from():
    """The record is the cause's rank's; a process rank 0's sweep found (orphans of any
    rank come back to pytest, which rank 0's check sweeps first) is the test's all the
    same: the record's ``escaped`` and the session's count."""

    def ended(rank: int, leaks: list[Leak]) -> Ended:
        return Ended(Outcome(End(100 + rank, 1, None, 1.0, leaks=leaks)), 1.0)

    found = Leak("process", "rank 1: sleep 300", {"pid": 7, "cmdline": "sleep 300", "rank": 1})
    shm = Leak("shm", "rank 1: segment /dev/shm/x", {"rank": 1})
    group = [ended(0, [found]), ended(1, [shm])]
    merged = _every_ranks_escaped(group[1].outcome, group)
    assert [e["cmdline"] for e in merged.end.escaped] == ["sleep 300"]
    assert shm in merged.end.leaks
    assert group[1].outcome.end.escaped == []  # the rank's own stays as it came
