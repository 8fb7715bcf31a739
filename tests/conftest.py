"""Fixtures shared by the project's tests; helpers live in tests/helpers/.

The suite runs under pytest-xdist (the root conftest.py). ``--sample I/N`` (CI's wheel and
lowest-versions stages, see .ci/run) keeps share I of N of the tests, by a stable hash of
their node ids, plus every test carrying one of the markers ``--sample-keep`` names;
``--one-start METHOD`` (CI's lowest-versions stage) runs a test that runs under both start
methods under that one only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pytest_gpuiso._lease import Region

from tests.helpers import GPUSIM, SHM, GpuIso, make_gpuiso, program
from tests.helpers.lease_table import Client

# The markers that say why a test must run in a CI stage that runs a sample of the suite.
STAGE_MARKERS = {
    "installation": "depends on what is installed and how: the wheel's files, native "
    "libraries, entry points (CI's wheel stage runs every such test)",
    "versions": "depends on the versions of pytest, pytest-xdist, psutil, nvidia-ml-py or "
    "another plugin: report formats, hooks, APIs (CI's lowest-versions stage runs them all)",
    "ml": "changes with torch and numpy installed beside the plugin: BLAS and OpenMP threads, "
    "torch preloaded, torch.distributed, the torch benches (CI's ML stage runs them all)",
}

# An xdist worker's environment names it; the pytest runs the tests start are sessions of
# their own, and plugins there (syrupy, pytest-benchmark) would take them for workers.
XDIST_ENV = ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpuiso-suite", "pytest-gpuiso's own suite")
    group.addoption(
        "--sample",
        metavar="I/N",
        help="run share I of N of the tests (0 <= I < N), chosen by a stable hash of node ids",
    )
    group.addoption(
        "--one-start",
        metavar="METHOD",
        choices=("spawn", "forkserver"),
        help="run the tests that run under both start methods (the gpuiso fixture) under "
        "this one only",
    )
    group.addoption(
        "--sample-keep",
        metavar="MARKER,...",
        default="",
        help="with --sample, also run every test with one of these markers",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "plugins(*entry_points): the pytest runs of this test also load these plugins",
    )
    for name, why in STAGE_MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {why}")


def _parse_sample(text: str) -> tuple[int, int]:
    try:
        share, shares = (int(part) for part in text.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--sample {text!r}: expected I/N, e.g. 0/3") from None
    if not 0 <= share < shares:
        raise pytest.UsageError(f"--sample {text!r}: I must be in 0..N-1")
    return share, shares


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _one_start(config, items)
    text = config.getoption("--sample")
    if not text:
        return
    share, shares = _parse_sample(text)
    keep = {name.strip() for name in config.getoption("--sample-keep").split(",") if name}
    unknown = keep - set(STAGE_MARKERS)
    if unknown:
        raise pytest.UsageError(f"--sample-keep: unknown marker(s) {', '.join(sorted(unknown))}")
    _keep_only(
        config,
        items,
        lambda item: (
            any(item.get_closest_marker(name) for name in keep)
            or zlib.crc32(item.nodeid.encode()) % shares == share
        ),
    )


def _keep_only(
    config: pytest.Config, items: list[pytest.Item], kept: Callable[[pytest.Item], bool]
) -> None:
    """Deselect (as pytest's -k does, said in its summary) every item ``kept`` refuses."""
    selected, deselected = [], []
    for item in items:
        (selected if kept(item) else deselected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


def _one_start(config: pytest.Config, items: list[pytest.Item]) -> None:
    """--one-start METHOD: of a test run under both start methods, its other one's run
    deselected (CI's lowest-versions stage: pytest's internals a test's process uses are
    the same under both, built by the same bootstrap; the README's command runs both)."""
    method = config.getoption("--one-start")
    if method:
        _keep_only(config, items, lambda item: _start_of(item, method) == method)


def _start_of(item: pytest.Item, default: str) -> str:
    """The start method a test runs under by the ``gpuiso`` fixture's parameter."""
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("gpuiso", default) if callspec is not None else default


@pytest.fixture(autouse=True)
def _not_an_xdist_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in XDIST_ENV:
        monkeypatch.delenv(name, raising=False)


def _make(request: pytest.FixtureRequest, start: str) -> GpuIso:
    marker = request.node.get_closest_marker("plugins")
    plugins = marker.args if marker else ()
    pytester = request.getfixturevalue("pytester")
    monkeypatch = request.getfixturevalue("monkeypatch")
    return make_gpuiso(pytester, monkeypatch, start, plugins=plugins)


@pytest.fixture(params=["spawn", "forkserver"])
def gpuiso(request: pytest.FixtureRequest) -> GpuIso:
    """Copy programs from fixtures/programs/ into a pytester directory and run pytest on them.

    Every test that uses it runs twice, once per start method (spawn, forkserver): for
    what the way a test's process starts changes (its parent and process tree, signals
    and exit status, the time-outs' escalation, what a forked template already imported,
    configured or collected, what plugins do in the test's process).
    """
    return _make(request, request.param)


@pytest.fixture
def gpuiso_spawn(request: pytest.FixtureRequest) -> GpuIso:
    """``gpuiso`` with spawn only: for what pytest's process alone decides (options, ini
    keys, the header, leases, leak policies, the reports' formats), which the start method
    does not change (spawn: a session of a test or two starts no fork server)."""
    return _make(request, "spawn")


@pytest.fixture
def gpuiso_forkserver(request: pytest.FixtureRequest) -> GpuIso:
    """``gpuiso`` with the fork server only (the plugin's default): for suites that
    import torch in every process (seconds a process under spawn: a distributed test's
    ranks), where what the start method changes is proven by lighter programs."""
    return _make(request, "forkserver")


@pytest.fixture
def shm_name(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A unique prefix for the /dev/shm entries a program makes (``GPUISO_SHM_NAME``);
    whatever is left under it is removed after the test."""
    name = f"gpuiso-t-{uuid.uuid4().hex[:10]}"
    monkeypatch.setenv("GPUISO_SHM_NAME", name)
    yield name
    for path in SHM.glob(f"*{name}*"):
        path.unlink(missing_ok=True)


@pytest.fixture
def lease_region(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private lease table for this test, shared by every process it starts."""
    path = tmp_path / "leases"
    monkeypatch.setenv("PYTEST_GPUISO_LEASE_REGION", str(path))
    return path


@pytest.fixture
def sim(
    gpusim_libs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lease_region: Path
) -> Path:
    """Two simulated GPUs for the pytest sessions this test starts, with a lease table of
    their own; the state file."""
    state = tmp_path / "gpus"
    path = os.environ.get("LD_LIBRARY_PATH", "")
    monkeypatch.setenv("LD_LIBRARY_PATH", f"{gpusim_libs}:{path}" if path else str(gpusim_libs))
    monkeypatch.setenv("GPUISO_SIM_STATE", str(state))
    monkeypatch.setenv("GPUISO_SIM_GPUS", "Sim H100,81559;Sim A10,23028")
    monkeypatch.setenv("GPUISO_SIM_CONTEXT_MIB", "300")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return state


@pytest.fixture
def private_tmpdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh $TMPDIR for the pytest runs; returns where their private directories go."""
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    return tmp / f"pytest-gpuiso-{os.getuid()}"


def _fake_library(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A shared library called ``name``, built from fixtures/programs/start/start_fake_libcuda.c."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip(f"gcc is needed to build a fake {name}")
    lib = tmp_path_factory.mktemp("fake-cuda") / name
    subprocess.run(
        [gcc, "-shared", "-fPIC", "-o", str(lib), str(program("start_fake_libcuda.c"))],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return lib


@pytest.fixture(scope="session")
def gpusim_libs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The simulated GPU's stand-in libcuda.so.1 and libnvidia-ml.so.1 (fixtures/gpusim/),
    built into one folder for LD_LIBRARY_PATH."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is needed to build the simulated GPU")
    folder = tmp_path_factory.mktemp("gpusim")
    for source, name in (("cuda.c", "libcuda.so.1"), ("nvml.c", "libnvidia-ml.so.1")):
        subprocess.run(
            [gcc, "-shared", "-fPIC", "-O1", "-o", str(folder / name), str(GPUSIM / source)],
            check=True,
            capture_output=True,
            timeout=60,
        )
    return folder


@pytest.fixture(scope="session")
def fake_libcuda(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fake CUDA driver (libcuda.so.1)."""
    return _fake_library(tmp_path_factory, "libcuda.so.1")


@pytest.fixture(scope="session")
def fake_libnvml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fake NVIDIA management library (libnvidia-ml.so.1)."""
    return _fake_library(tmp_path_factory, "libnvidia-ml.so.1")


# ----------------------------------------------------------------- the lease table's


@pytest.fixture
def region_path(tmp_path: Path) -> str:
    """The test's own lease table (never the user's); a module may put it elsewhere."""
    return str(tmp_path / "leases")


@pytest.fixture
def region(region_path: str) -> Region:
    """The test's own attachment (the driver's view) to a fresh table."""
    return Region(region_path)


@pytest.fixture
def clients(region_path: str) -> Iterator[Callable[..., Client]]:
    """Start lease clients on the test's table; all are SIGKILLed and reaped at the end."""
    started: list[Client] = []

    def start(context: str = "fork") -> Client:
        client = Client(context, region_path)
        started.append(client)
        client.wait_ready()
        return client

    try:
        yield start
    finally:
        for client in started:
            client.kill()
        for client in started:
            client.process.join(10)
