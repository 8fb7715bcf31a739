"""Pinned workers (--gpu-isolate-pin-workers), on declared GPUs: each xdist worker holds
its GPU for life and its in-process tests see only it; isolated tests run under it; a
request that could never be granted fails in one line; two sessions never overbook."""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

from tests.helpers import REPORT, GpuIso

PROGRAM = "pinned_workers.py"
PIN = ("--gpu-isolate-pin-workers", "--gpu-isolate-devices=0,1")


def _rows(log: Path) -> list[tuple[float, float, str, str, str]]:
    rows = []
    for line in log.read_text().splitlines():
        start, end, cvd, worker, tag = line.split()
        rows.append((float(start), float(end), cvd, worker, tag))
    return rows


def test_each_worker_holds_one_gpu_for_its_life(
    gpuiso: GpuIso, lease_region, tmp_path, monkeypatch
):
    log = tmp_path / "log"
    monkeypatch.setenv("GPUISO_PIN_LOG", str(log))
    gpuiso.copy(PROGRAM)
    result = gpuiso.run(*PIN, "-n", "2", "-rE", REPORT, PROGRAM)
    result.assert_outcomes(passed=6, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*gpu-isolate: pinned workers (--gpu-isolate-pin-workers): each of the 2 xdist "
            "workers holds 1 GPU for its whole life*",
            # the other worker's GPU is pinned until that worker ends (xdist ends a
            # worker when no test is left for it)
            "*test needs 2 GPUs; its pinned worker holds 1 (*) and * free of pinned "
            "workers: it could never get them*",
        ]
    )
    by_worker: dict[str, set[str]] = defaultdict(set)
    for _, _, cvd, worker, _ in _rows(log):
        by_worker[worker].add(cvd)
    assert all(len(seen) == 1 for seen in by_worker.values()), by_worker
    if len(by_worker) == 2:  # both workers ran some: on different GPUs
        assert set.union(*by_worker.values()) == {"0", "1"}, by_worker
    (record,) = [r for n, r in gpuiso.records().items() if n.endswith("under_its_workers_lease")]
    assert len(record["gpus"]) == 1 and record["lease_wait"] == 0


def test_two_sessions_of_pinned_workers_never_overbook(
    gpuiso_spawn: GpuIso, lease_region, tmp_path, monkeypatch
):
    """Two sessions at once, two pinned workers each, on the same two declared GPUs: one
    session's workers wait for the other's to end; no GPU is ever seen by two at once."""
    log = tmp_path / "log"
    gpuiso_spawn.copy(PROGRAM)
    args = (*PIN, "-n", "2", "-q", "-k", "in_process", PROGRAM)
    runs = [
        gpuiso_spawn.popen(*args, env={"GPUISO_PIN_LOG": str(log), "GPUISO_PIN_TAG": tag})
        for tag in ("a", "b")
    ]
    for run in runs:
        out, _ = run.communicate(timeout=180)
        assert run.returncode == 0, out.decode()
    rows = _rows(log)
    assert {tag for *_, tag in rows} == {"a", "b"}
    for device in ("0", "1"):
        spans = sorted((start, end, tag) for start, end, cvd, _, tag in rows if cvd == device)
        for (_, end, tag), (start, _, other) in zip(spans, spans[1:], strict=False):
            assert tag == other or start >= end, f"GPU {device} overbooked: {spans}"


def test_a_session_waiting_for_its_workers_gpus_holds_none(
    gpuiso_spawn: GpuIso, lease_region, tmp_path, monkeypatch
):
    """GPU 1 is held elsewhere: a session of two pinned workers on GPUs 0,1 must wait
    holding nothing (else two such sessions, each with one GPU, would wait for each other
    forever), so a one-process session started after it gets GPU 0 and ends first."""
    from pytest_gpuiso.gpu.leases import open_region

    table = open_region(str(lease_region))
    held, _ = table.acquire(["1"], 1, 1, "held by the test", None)
    log = tmp_path / "log"
    gpuiso_spawn.copy(PROGRAM)
    args = (*PIN, "-q", "-k", "in_process", PROGRAM)
    waiting = gpuiso_spawn.popen(
        *args, "-n", "2", env={"GPUISO_PIN_LOG": str(log), "GPUISO_PIN_TAG": "a"}
    )
    try:
        time.sleep(1.0)  # it is waiting now (or has not started: either way it holds nothing)
        alone = gpuiso_spawn.popen(*args, env={"GPUISO_PIN_LOG": str(log), "GPUISO_PIN_TAG": "b"})
        out, _ = alone.communicate(timeout=120)
        assert alone.returncode == 0, out.decode()
        assert waiting.poll() is None, "the two-worker session ran while GPU 1 was held"
        assert {(cvd, tag) for _, _, cvd, _, tag in _rows(log)} == {("0", "b")}
    finally:
        table.release(held)
    out, _ = waiting.communicate(timeout=120)
    assert waiting.returncode == 0, out.decode()
    assert {cvd for _, _, cvd, _, tag in _rows(log) if tag == "a"} == {"0", "1"}
