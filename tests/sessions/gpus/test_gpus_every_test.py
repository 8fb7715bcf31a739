"""Every isolated test under the lease table, on declared GPUs
(--gpu-isolate-devices=0,1 stands in for two): an unmarked test under --gpu-isolate
leases one GPU, --gpu-isolate-gpus changes that, a test that loads CUDA's driver while
it leased no GPU is named, and each test gets a MASTER_PORT of its own."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from pytest_gpuiso.gpu import ports
from tests.helpers import REPORT, GpuIso, program

PROGRAM = "gpus_every_test.py"
DEVICES = "--gpu-isolate-devices=0,1"
_SHORT = {
    "test_unmarked_sees_one_gpu": "unmarked",
    "test_marked_two_sees_both": "two",
    "test_marked_none_loads_the_driver": "none",
    "test_unmarked_loads_the_driver": "driver",
    "test_binds_its_master_port": "port",
}
NO_GPU = "*this test loaded libcuda.so.1 but leased no GPU, so it saw none*gpus=1*"


def _seen(path: Path) -> dict[str, dict]:
    return {row["test"]: row for row in map(json.loads, path.read_text().splitlines())}


@pytest.fixture
def seen_log(gpuiso: GpuIso, lease_region, fake_libcuda: Path, tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("GPUISO_FAKE_LIBCUDA", str(fake_libcuda))
    monkeypatch.setenv("GPUISO_SEEN", str(tmp_path / "seen"))
    monkeypatch.delenv("MASTER_PORT", raising=False)
    gpuiso.copy(PROGRAM)
    return tmp_path / "seen"


def test_gpu_isolate_gives_every_test_a_gpu_and_a_port(gpuiso: GpuIso, seen_log: Path):
    """Under xdist: the unmarked tests lease one GPU each, gpus=2 both, gpus=0 none (its
    driver load is recorded, not warned: its marker said so); every test its port."""
    result = gpuiso.run("--gpu-isolate", DEVICES, "-n", "2", "-p", "no:randomly", REPORT, "-v")
    result.assert_outcomes(passed=5)
    result.stdout.fnmatch_lines(
        [
            "*gpu-isolate: each isolated test leases 1 GPU (default where there are GPUs)*",
            "*gpu-isolate: each test gets MASTER_ADDR=127.0.0.1 and a MASTER_PORT of its own*",
        ]
    )
    assert "leased no GPU" not in result.stdout.str()
    seen = _seen(seen_log)
    assert seen["unmarked"]["CUDA_VISIBLE_DEVICES"] in ("0", "1")
    assert seen["driver"]["CUDA_VISIBLE_DEVICES"] in ("0", "1")
    assert seen["none"]["CUDA_VISIBLE_DEVICES"] == ""
    assert {row["MASTER_ADDR"] for row in seen.values()} == {"127.0.0.1"}
    records = {nodeid.split("::")[1]: r for nodeid, r in gpuiso.records().items()}
    assert len(records["test_unmarked_sees_one_gpu"]["gpus"]) == 1
    assert sorted(records["test_marked_two_sees_both"]["gpus"]) == ["0", "1"]
    assert records["test_marked_none_loads_the_driver"]["cuda_without_gpu"] == ["libcuda.so.1"]
    assert "cuda_without_gpu" not in records["test_unmarked_loads_the_driver"]
    for name, record in records.items():
        assert ports.PORTS.start <= record["master_port"] < ports.PORTS.stop, name
        assert str(record["master_port"]) == seen[_SHORT[name]]["MASTER_PORT"], name


def test_no_gpus_by_default_names_the_tests_that_load_cuda(
    gpuiso_spawn: GpuIso, lease_region, fake_libcuda: Path, tmp_path, monkeypatch
):
    """--gpu-isolate-gpus=0: tests see no GPU; the unmarked one that loads the driver is
    named in one warning, the one marked gpus=0 is not; the user's MASTER_PORT stands."""
    monkeypatch.setenv("GPUISO_FAKE_LIBCUDA", str(fake_libcuda))
    monkeypatch.setenv("GPUISO_SEEN", str(tmp_path / "seen"))
    monkeypatch.setenv("MASTER_PORT", "12345")
    gpuiso_spawn.copy(PROGRAM)
    args = ("--gpu-isolate", DEVICES, "--gpu-isolate-gpus=0", REPORT, "-k", "driver", "-v")
    result = gpuiso_spawn.run(*args)
    result.assert_outcomes(passed=2, warnings=1)
    result.stdout.fnmatch_lines(
        [
            "*gpu-isolate: each isolated test leases no GPU: it sees none (--gpu-isolate-gpus)*",
            "*gpu-isolate: MASTER_PORT=12345 from the environment: left alone*",
            "*warnings summary*",
            "gpus_every_test.py::test_unmarked_loads_the_driver",
            NO_GPU,
        ]
    )
    assert "test_marked_none_loads_the_driver\n" not in result.stdout.str()
    seen = _seen(tmp_path / "seen")
    assert seen["driver"]["CUDA_VISIBLE_DEVICES"] == ""
    assert {row["MASTER_PORT"] for row in seen.values()} == {"12345"}
    for record in gpuiso_spawn.records().values():
        assert record["cuda_without_gpu"] == ["libcuda.so.1"]
        assert "master_port" not in record and "gpus" not in record


def test_a_driver_mapped_before_the_test_s_own_process_is_not_named(
    gpuiso: GpuIso, lease_region, fake_libcuda: Path, tmp_path, monkeypatch
):
    """A conftest maps the driver without initialising it (as importing torch's CUDA 13
    build does), and the tests that leased no GPU call its cuInit, which finds none and
    leaves no trace. Under spawn the conftest ran in the test's own process, which loaded
    the driver: named. Forked from the fork server's template, the driver was mapped
    before the test's process began: not named (a CUDA call would have shown only as an
    initialised driver)."""
    monkeypatch.setenv("GPUISO_FAKE_LIBCUDA", str(fake_libcuda))
    monkeypatch.setenv("GPUISO_FAKE_LIBCUDA_MAPPED", "1")
    gpuiso.copy(PROGRAM)
    (gpuiso.path / "conftest.py").write_text(program("start_cuda_conftest.py").read_text())
    args = ("--gpu-isolate", DEVICES, "--gpu-isolate-gpus=0", REPORT, "-k", "driver")
    result = gpuiso.run(*args)
    records = gpuiso.records().values()
    if gpuiso.start == "spawn":
        result.assert_outcomes(passed=2, warnings=1)
        result.stdout.fnmatch_lines([NO_GPU])
        assert [r.get("cuda_without_gpu") for r in records] == [["libcuda.so.1"]] * 2
    else:
        result.assert_outcomes(passed=2)
        assert "leased no GPU" not in result.stdout.str()
        assert [r.get("cuda_without_gpu") for r in records] == [None, None]


def test_two_sessions_at_once_listen_on_distinct_ports(
    gpuiso_spawn: GpuIso, lease_region, tmp_path, monkeypatch
):
    """The same test in two sessions at once: each listens on its MASTER_PORT until the
    other does too (a shared port would fail one bind, or never meet)."""
    rendezvous = tmp_path / "rendezvous"
    rendezvous.mkdir()
    monkeypatch.setenv("GPUISO_RENDEZVOUS", str(rendezvous))
    monkeypatch.delenv("MASTER_PORT", raising=False)
    gpuiso_spawn.copy(PROGRAM)
    args = ("--gpu-isolate", "--gpu-isolate-devices=none", "-k", "port", "-q")
    runs = [gpuiso_spawn.popen(*args) for _ in range(2)]
    for run in runs:
        out, _ = run.communicate(timeout=120)
        assert run.returncode == 0, out
    assert len(os.listdir(rendezvous)) == 2


def test_a_port_is_leased_once_until_released():
    """Below Linux's ephemeral range (32768-60999): a port there may be any socket's at the
    time (CI once found one of 40100-40102 bound by another test's connection)."""
    span = range(LEASED_PORTS, LEASED_PORTS + 3)
    first, second = ports.lease(span), ports.lease(span)
    assert first.port != second.port
    held = {first.port, second.port}
    first.release()
    again = [ports.lease(span) for _ in range(2)]
    assert {lease.port for lease in again} | held == set(span)
    last = LEASED_PORTS + 2
    taken = (
        rf"no free MASTER_PORT in {LEASED_PORTS}-{last}: 3 of its names held by your own processes;"
    )
    with pytest.raises(ports.PortError, match=taken):
        ports.lease(span)
    for lease in [second, *again]:
        lease.release()


def test_a_port_held_in_another_process_or_bound_is_skipped():
    """A name held by another process (another session's test) and a port some program
    listens on are both passed over; the kernel frees the name when its holder dies. The
    ports are below Linux's ephemeral range (32768-60999), where no socket of another test
    is given one by chance."""
    base = HELD_PORT
    span = range(base, base + 3)
    holder = subprocess.Popen([sys.executable, "-c", HOLD], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        with socket.socket() as other:
            other.bind(("", base + 1))
            other.listen()
            got = ports.lease(span)
            assert got.port == base + 2
            with pytest.raises(ports.PortError, match="set MASTER_PORT to choose one yourself"):
                ports.lease(range(base, base + 2))
            got.release()
    finally:
        holder.kill()
        holder.wait()
    freed = ports.lease(range(base, base + 1))  # its holder died: the name is free again
    assert freed.port == base
    freed.release()


HELD_PORT = 28200  # not in the plugin's range (29500-31499) nor the ephemeral one
LEASED_PORTS = 28250  # the same
HOLD = (
    "import socket, os, sys, time\n"
    "s = socket.socket(socket.AF_UNIX)\n"
    f"s.bind(f'\\0pytest-gpuiso-master-port-{{os.getuid()}}-{HELD_PORT}')\n"
    "print('holding', flush=True)\n"
    "time.sleep(120)\n"
)


@pytest.mark.parametrize("mode", ["--gpu-isolate", "--gpu-isolate-pin-workers"])
def test_n_auto_starts_one_worker_per_gpu_slot(
    gpuiso_spawn: GpuIso, lease_region, monkeypatch, mode
):
    """-n auto under --gpu-isolate (or with pinned workers) on three declared GPUs: three
    workers, said in the header, even on a machine with fewer CPUs; each test sees one GPU.
    Which worker gets the test is xdist's choice (the first ready), and a pinned worker's
    GPU is its own: the test may see any of the three."""
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    monkeypatch.setenv("GPUISO_DECLARED", "0,1,2")
    gpuiso_spawn.copy(PROGRAM)
    args = (mode, "--gpu-isolate-devices=0,1,2", "-n", "auto", "-k", "sees_one", PROGRAM)
    result = gpuiso_spawn.run(*args)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "*-n auto: 3 workers, one per GPU slot (3 GPUs x 1 test each; GPUs "
            "from --gpu-isolate-devices)*",
            "*created: 3/3 workers*",
        ]
    )


@pytest.mark.parametrize("how", ["marked-only", "xdist-env"])
def test_n_auto_is_xdists_own_without_every_test_isolated(
    gpuiso_spawn: GpuIso, lease_region, monkeypatch, how
):
    """Only marked tests isolated: xdist counts CPUs; PYTEST_XDIST_AUTO_NUM_WORKERS wins."""
    gpuiso_spawn.copy(PROGRAM)
    args = ["--gpu-isolate-devices=0,1,2", "-n", "auto", "-k", "two_sees"]
    if how == "xdist-env":
        monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "1")
        args.append("--gpu-isolate")
        expected = 1
    else:
        monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
        expected = psutil.cpu_count(logical=False) or psutil.cpu_count()
    result = gpuiso_spawn.run(*args)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"*created: {expected}/{expected} worker*"])
    assert "gpu-isolate: -n auto" not in result.stdout.str()
