"""One GPU, one row in the lease table, whatever a session calls it: an index, its UUID,
a prefix of it. Rows are keyed by the GPU's UUID (a MIG instance's own), asked of CUDA
(in a fresh process) where its numbering may not be NVML's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import GpuIso

H100 = "GPU-00000001-0000-4000-8000-000000000000"
HOLD = """
import os, time, pytest

@pytest.mark.gpu_isolated(gpus=1, gpu_memory="60GiB", timeout=60)
def test_hold():
    start = time.time()
    time.sleep(2)
    with open(os.environ["GPUISO_SPANS"], "a") as spans:
        spans.write(f"{os.environ['SESSION']} {start} {time.time()}\\n")
"""


def _take_turns(gpuiso_spawn: GpuIso, spans: Path, env_a: dict[str, str]) -> None:
    """Session a (``env_a``) and session b each run test_hold at once: both pass, and
    their holds of the GPU never overlap."""
    first = gpuiso_spawn.popen("test_hold.py", env=env_a)
    try:
        second = gpuiso_spawn.popen("test_hold.py", env={"SESSION": "b"})
        out, _ = second.communicate(timeout=120)
        assert second.returncode == 0, out.decode()
    finally:
        out, _ = first.communicate(timeout=120)
    assert first.returncode == 0, out.decode()
    (a_start, a_end), (b_start, b_end) = (
        tuple(map(float, line.split()[1:])) for line in sorted(spans.read_text().splitlines())
    )
    assert a_end <= b_start or b_end <= a_start, spans.read_text()


def test_two_sessions_naming_one_gpu_two_ways_never_share_it(
    gpuiso_spawn: GpuIso, sim: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An 80 GiB H100 and an A100 in MIG mode: NVML discovery names every GPU by UUID,
    while a session with CUDA_VISIBLE_DEVICES=0 names the H100 "0". Before: two rows, both
    sessions held 60 GiB of the one H100 at once."""
    monkeypatch.setenv("GPUISO_SIM_GPUS", "Sim H100,81559;Sim A100,40960,mig=20480+20480")
    spans = tmp_path / "spans"
    monkeypatch.setenv("GPUISO_SPANS", str(spans))
    gpuiso_spawn.pytester.makepyfile(test_hold=HOLD)
    _take_turns(gpuiso_spawn, spans, {"SESSION": "a", "CUDA_VISIBLE_DEVICES": "0"})


HOLD_WHOLE = HOLD.replace('gpu_memory="60GiB", ', "")


def test_a_session_without_nvml_leases_the_row_cuda_names(
    gpuiso_spawn: GpuIso,
    sim: Path,
    gpusim_libs: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Session a can load the CUDA driver only (a container without NVML, sharing
    /dev/shm), session b NVML too; both call GPU 0 "0". CUDA says which GPU a's "0" is
    (its UUID, and its memory): one row, the sessions take turns. Before: a keyed it "0",
    b by its UUID, and both held it at once."""
    monkeypatch.setenv("GPUISO_SIM_GPUS", "Sim H100,81559")
    spans = tmp_path / "spans"
    monkeypatch.setenv("GPUISO_SPANS", str(spans))
    cuda_only = tmp_path / "cuda-only"
    cuda_only.mkdir()
    (cuda_only / "libcuda.so.1").symlink_to(gpusim_libs / "libcuda.so.1")
    gpuiso_spawn.pytester.makepyfile(test_hold=HOLD_WHOLE)
    env = {"SESSION": "a", "CUDA_VISIBLE_DEVICES": "0", "LD_LIBRARY_PATH": str(cuda_only)}
    _take_turns(gpuiso_spawn, spans, env)


def test_without_nvml_cuda_says_each_gpus_row_and_memory(
    sim: Path, gpusim_libs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA driver only: an index is CUDA's own (the fastest first), a UUID's prefix
    is that GPU, a name that is no GPU keys itself, a name CUDA stops at does not hide the
    next; each GPU's memory is CUDA's."""
    monkeypatch.setenv("GPUISO_SIM_GPUS", "Sim A10,23028;Sim H100,81559")
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    cuda_only = tmp_path / "cuda-only"
    cuda_only.mkdir()
    (cuda_only / "libcuda.so.1").symlink_to(gpusim_libs / "libcuda.so.1")
    only = {"LD_LIBRARY_PATH": str(cuda_only)}
    h100, a10 = H100.replace("00000001", "00000002", 1), H100
    assert _keys({**only, "CUDA_VISIBLE_DEVICES": "0"}) == f"{h100} 81559"
    assert _keys({**only, "CUDA_VISIBLE_DEVICES": "GPU-00000001"}) == f"{a10} 23028"
    assert _keys({**only, "CUDA_VISIBLE_DEVICES": "7,1"}) == f"7 {a10} 0 23028"


def test_a_gpu_cuda_cannot_place_in_time_is_refused_not_guessed(
    sim: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mixed models, CUDA's order: which GPU "0" is only CUDA can say, and its cuInit does
    not answer within the bound. The session is refused in one line saying how to name the
    GPUs instead. Before: after 30 s it took NVML's GPU 0 (the A10) silently, while
    CUDA's "0" is the H100 another session may hold by its own row."""
    monkeypatch.setenv("GPUISO_SIM_GPUS", "Sim A10,23028;Sim H100,81559")
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    env = {"CUDA_VISIBLE_DEVICES": "0", "GPUISO_SIM_CUINIT_MS": "3000"}
    bound = "from pytest_gpuiso.gpu import identity; identity.ASK_TIMEOUT = 1"
    refused = _discover(env, before=bound)
    assert refused.returncode == 1 and refused.stdout == ""
    said = refused.stderr.strip().splitlines()[-1]
    assert said == (
        "pytest_gpuiso.values.SpecError: cannot tell which GPU CUDA_VISIBLE_DEVICES names 0: "
        "CUDA did not answer within 1 s; not leased by a guess, which could give one GPU to "
        "two sessions: name the GPUs by UUID (nvidia-smi -L), or with NVML set "
        "CUDA_DEVICE_ORDER=PCI_BUS_ID"
    )
    # a slow answer within the bound is waited for, and is the H100
    h100 = H100.replace("00000001", "00000002", 1)
    assert _keys({**env, "GPUISO_SIM_CUINIT_MS": "1500"}) == f"{h100} 81559"


def _discover(env: dict[str, str], before: str = "") -> subprocess.CompletedProcess:
    """``devices.discover`` in a fresh process with ``env``, printing its keys and sizes."""
    code = (
        f"{before}\n"
        "from pytest_gpuiso.gpu.devices import discover; d = discover(None, 'auto'); "
        "print(*d.keys, *(size >> 20 for size in d.capacities))"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        cwd="/",
        timeout=60,
    )


def _keys(env: dict[str, str]) -> str:
    done = _discover(env)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_an_index_is_cudas_own_when_its_order_is_not_nvmls(
    sim: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An A10 before an H100 on the bus: CUDA's default order (the fastest first) calls the
    H100 0, NVML's calls the A10 0; the row is the GPU CUDA will show the tests."""
    monkeypatch.setenv("GPUISO_SIM_GPUS", "Sim A10,23028;Sim H100,81559")
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    h100, a10 = H100.replace("00000001", "00000002", 1), H100
    # its row and its memory (NVML read as that GPU)
    assert _keys({"CUDA_VISIBLE_DEVICES": "0"}) == f"{h100} 81559"
    assert _keys({"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}) == f"{a10} 23028"
    assert _keys({"CUDA_VISIBLE_DEVICES": "GPU-00000002"}) == f"{h100} 81559"  # a prefix


def test_one_gpu_listed_under_two_names_is_refused_in_one_line(
    gpuiso_spawn: GpuIso, sim: Path
) -> None:
    gpuiso_spawn.pytester.makepyfile(test_hold=HOLD)
    result = gpuiso_spawn.run("--gpu-isolate-devices=0,GPU-00000001", "test_hold.py")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    said = "invalid device list --gpu-isolate-devices: 0 and GPU-00000001 are the same GPU"
    result.stderr.fnmatch_lines([f"*{said} ({H100})"])


def test_the_json_report_says_which_driver_and_gpus_it_ran_on(gpuiso_spawn: GpuIso, sim: Path):
    """The report's session environment (issue 50): the CUDA driver and each GPU's name,
    memory and UUID, from NVML."""
    gpuiso_spawn.pytester.makepyfile(test_plain="def test_plain(): pass")
    gpuiso_spawn.run("--gpu-isolate", "--gpu-isolate-report=report.json", "test_plain.py")
    env = gpuiso_spawn.report()["session"]["environment"]
    assert env["cuda_driver"]
    assert env["gpus"] == [
        {"name": "Sim H100", "memory": 81559 << 20, "uuid": H100},
        {"name": "Sim A10", "memory": 23028 << 20, "uuid": H100.replace("01", "02", 1)},
    ]
