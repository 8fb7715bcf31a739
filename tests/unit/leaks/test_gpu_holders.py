"""Whose a GPU memory holder is: only the test's process tree is judged. A holder that is
not the test's (another user's job, a notebook) is noted, never a leak; a pid the test's
tree had that now names another process (reused) is not the test's."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil

from pytest_gpuiso.gpu import gpu_probe
from pytest_gpuiso.leaks import RunInfo
from pytest_gpuiso.leaks.gpu_memory import MIB, GpuMemoryProbe, Sample, left_on_gpus, of_test

ENDED = 1_700_000_003.5
GONE = 3_123_456  # no process has this pid (well above the pids this machine hands out)
FOREIGN = 2_000_002  # NVML's pid of a process that is not the test's


def _gone(pid: int) -> int:
    assert not psutil.pid_exists(pid)
    return pid


class Nvml:
    def __init__(self, samples: list[Sample]) -> None:
        self.samples = samples

    def sample(self, device: str) -> Sample:
        return self.samples.pop(0) if len(self.samples) > 1 else self.samples[0]


def check(holding: Sample, tree_pids: frozenset[int] = frozenset()) -> GpuMemoryProbe:
    """A GPU idle at the baseline, then ``holding`` through the whole backoff."""
    probe = GpuMemoryProbe(Nvml([Sample(535 * MIB), holding]), ["0"], sleep=[].append)
    run = RunInfo(41872, ENDED - 3, ENDED, 5.0, tree_pids)
    probe.found = probe.check(probe.snapshot(), run)  # type: ignore[attr-defined]
    return probe


def test_a_holder_not_of_the_tests_tree_is_noted_not_a_leak():
    probe = check(Sample((535 + 1024 + 4) * MIB, {FOREIGN: 1024 * MIB}))
    assert probe.found == []  # type: ignore[attr-defined]
    assert probe.notes == [
        f"GPU 0: pid {FOREIGN} (not this test's) holds 1024 MiB: noted, not blamed"
    ]


def test_a_foreign_holders_memory_is_not_the_tests_residual_memory_either():
    probe = check(Sample((535 + 1024 + 300) * MIB, {FOREIGN: 1024 * MIB}))
    [growth] = probe.found  # type: ignore[attr-defined]
    assert growth.fields == {"device": "0", "bytes": 300 * MIB}
    assert len(probe.notes) == 1


def test_a_holder_the_sweep_found_is_the_tests_and_a_foreign_one_beside_it_is_noted():
    holding = Sample((535 + 2048) * MIB, {_gone(GONE): 1024 * MIB, FOREIGN: 1024 * MIB})
    probe = check(holding, frozenset({41872, GONE}))
    [leak] = probe.found  # type: ignore[attr-defined]
    assert leak.fields == {"device": "0", "pid": GONE, "bytes": 1024 * MIB, "holder": True}
    assert [n.split(" (")[0] for n in probe.notes] == [f"GPU 0: pid {FOREIGN}"]
    # Health judges the GPU by the test's holder only.
    assert left_on_gpus(probe.found) == {"0": [f"process {GONE} still holds it"]}  # type: ignore[attr-defined]


def test_a_holder_of_unknown_size_is_noted_without_one_and_the_growth_beside_it_too():
    probe = check(Sample(535 * MIB, {FOREIGN: 0}))
    assert probe.notes == [f"GPU 0: pid {FOREIGN} (not this test's) holds it: noted, not blamed"]
    # NVML does not say what it holds: the growth may all be its, not the test's.
    probe = check(Sample((535 + 1024) * MIB, {FOREIGN: 0}))
    assert probe.found == []  # type: ignore[attr-defined]
    assert probe.notes[1] == (
        "GPU 0: 1024 MiB more in use, beside a process that is not this test's: noted, not blamed"
    )


def test_of_test_compares_the_start_time_of_a_pid_the_sampler_saw():
    me = psutil.Process()
    started = me.create_time()
    assert of_test(me.pid, {(me.pid, started)}, frozenset(), ENDED)
    # The same pid, another process (a reused pid): not the test's.
    assert not of_test(me.pid, {(me.pid, started - 10)}, frozenset(), ENDED)
    # A pid two processes of the test had in turn: either is the test's.
    assert of_test(me.pid, {(me.pid, started - 10), (me.pid, started)}, frozenset(), ENDED)
    # Seen in the tree and gone since: its pid is nobody else's yet.
    assert of_test(_gone(GONE), {(GONE, 1.0)}, frozenset(), ENDED)


def test_of_test_takes_a_swept_pid_unless_a_later_process_has_it():
    me = psutil.Process()
    assert of_test(me.pid, set(), frozenset({me.pid}), me.create_time() + 1)
    assert not of_test(me.pid, set(), frozenset({me.pid}), me.create_time() - 1)


def test_of_test_never_takes_a_pid_it_never_saw():
    assert not of_test(os.getpid(), set(), frozenset(), ENDED)
    assert not of_test(_gone(GONE), set(), frozenset({41872}), ENDED)


def test_the_sampler_keeps_the_start_time_of_each_process_of_the_tree():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        probe = GpuMemoryProbe(Nvml([Sample(535 * MIB)]), ["0"], sleep=[].append)
        probe.snapshot()
        probe.during(os.getpid(), every=0.01)
        keys = {(p.pid, p.create_time()) for p in (psutil.Process(), psutil.Process(child.pid))}
        for _ in range(int(60 / 0.01)):
            if keys <= probe.tree:
                break
            probe._stop.wait(0.01)
        probe.check(None, RunInfo(os.getpid(), 0.0, ENDED, 5.0))
        assert keys <= probe.tree
    finally:
        child.kill()
        child.wait()


def test_a_driver_probe_that_finds_the_gpu_full_says_full_not_broken(monkeypatch, capsys):
    class Cuda:  # the GPU is full (of someone else's memory): the allocation fails
        def __getattr__(self, name: str):
            return lambda *args: gpu_probe.OUT_OF_MEMORY if name == "cuMemAlloc_v2" else 0

    monkeypatch.setattr(gpu_probe.ctypes, "CDLL", lambda name: Cuda())
    assert gpu_probe.main() == gpu_probe.FULL
    assert capsys.readouterr().out.startswith("cuMemAlloc_v2: ")
