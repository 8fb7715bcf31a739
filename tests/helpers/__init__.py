"""Helpers for driving real pytest sessions over the programs in fixtures/ (tests.helpers)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from pytest_gpuiso.wire.environment import REGION_ENV, TEMPLATE_WAIT_ENV

SHM = Path("/dev/shm")  # where the leaks the tests make and look for are
USAGE_ERROR = pytest.ExitCode.USAGE_ERROR  # pytest's exit status for a bad option
ROOT = Path(__file__).resolve().parents[2]  # tests/helpers/__init__.py -> the checkout
PROGRAMS = ROOT / "fixtures" / "programs"  # in folders by feature; each name is unique
GPUSIM = ROOT / "fixtures" / "gpusim"  # the simulated GPU: stand-in libcuda and NVML
# The JSON report of a run, read back by GpuIso.report() and records()
REPORT = "--gpu-isolate-report=report.json"
_TMPDIR = os.environ.get("TMPDIR")  # this process's own, before any test changed it


# The runs here load only the plugins they use: ours, pytest-xdist (-n) and pytest-timeout
# (its ini keys and markers), plus those a test names with the ``plugins`` marker (the
# adapters' tests: tests/sessions/plugins/). The other installed plugins would cost each
# process they are loaded in (the run's pytest and each test's process) ~0.2 s at start-up,
# a third of this suite's time. The demo's test and pytest-randomly's tests start their
# runs themselves, with every installed plugin loaded, as users run.
_ONLY_NAMED_PLUGINS = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
_NEEDED = ("gpuiso", "xdist", "timeout")


@functools.cache
def _programs() -> dict[str, list[Path]]:
    found: dict[str, list[Path]] = {}
    for folder in sorted(p for p in PROGRAMS.iterdir() if p.is_dir()):
        for path in sorted(folder.iterdir()):
            if path.name != "__pycache__":
                found.setdefault(path.name, []).append(path)
    return found


def command(*args: str) -> subprocess.CompletedProcess:
    """``python -m pytest_gpuiso ARGS`` (status, reset, ...), from outside the checkout."""
    return subprocess.run(
        [sys.executable, "-m", "pytest_gpuiso", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",  # not a source tree, which would shadow the installed package
    )


def program(name: str) -> Path:
    """The program (a file or a folder) ``name`` in fixtures/programs/<feature>/, or a
    file inside a program's folder (``plugin_cov_old/conftest.py``): tests name
    programs, the folders group them by the feature they exercise."""
    first, _, rest = name.partition("/")
    paths = _programs().get(first, [])
    if len(paths) != 1:
        raise LookupError(f"{len(paths)} programs called {first!r} in {PROGRAMS}: {paths}")
    path = paths[0] / rest if rest else paths[0]
    if not path.exists():
        raise LookupError(f"no {rest!r} in the program {first!r} ({paths[0]})")
    return path


class GpuIso:
    """Copy fixture programs into a pytester directory and run pytest on them."""

    def __init__(
        self,
        pytester: pytest.Pytester,
        start: str | None = "spawn",
        plugins: tuple[str, ...] = (),
    ) -> None:
        """``start``: the start method its runs name (None: none, the default)."""
        self.pytester = pytester
        self.path = pytester.path
        self.start = start
        # what its runs load: "-p" and a pytest11 entry point, for _NEEDED and ``plugins``
        self.plugin_args = tuple(arg for name in (*_NEEDED, *plugins) for arg in ("-p", name))
        # The programs here do not import torch: preloading it would only cost time.
        chosen = () if start is None else (f"--gpu-isolate-start={start}",)
        self.start_options = (*chosen, "--gpu-isolate-preload=none")

    def copy(self, *names: str) -> None:
        """Copy files or directories from fixtures/programs/ into the test directory."""
        for name in names:
            src = program(name)
            dst = self.path / Path(name).name
            if src.is_dir():
                shutil.copytree(src, dst, dirs_exist_ok=True)
            else:
                shutil.copy(src, dst)

    def run(self, *args: str, timeout: float = 180) -> pytest.RunResult:
        """Run pytest in a subprocess (real signals, process groups, pdeathsig)."""
        return self.run_with_cache("-p", "no:cacheprovider", *args, timeout=timeout)

    def run_with_cache(self, *args: str, timeout: float = 180) -> pytest.RunResult:
        with pytest.MonkeyPatch.context() as patch:
            for name, value in _ONLY_NAMED_PLUGINS.items():
                patch.setenv(name, value)
            return self.pytester.runpytest_subprocess(
                *self.plugin_args, *self.start_options, *args, timeout=timeout
            )

    def run_as_installed(self, *args: str, timeout: float = 180) -> pytest.RunResult:
        """``run`` with every installed plugin loaded, as users run: pytest then marks the
        plugins' packages for assertion rewriting (``run`` loads only those it names)."""
        return self.pytester.runpytest_subprocess(*self.start_options, *args, timeout=timeout)

    def report(self, name: str = "report.json") -> dict:
        return json.loads((self.path / name).read_text())

    def records(self, name: str = "report.json") -> dict[str, dict]:
        return {t["nodeid"]: t for t in self.report(name)["tests"]}

    def popen(self, *args: str, env: dict | None = None) -> subprocess.Popen:
        """Start pytest as a background process (for signal tests).

        Its SIGINT is never ignored: a shell's background job inherits SIGINT ignored
        (and Python then installs no KeyboardInterrupt handler), which would make the
        Ctrl-C tests hang when this suite itself runs in the background.
        """
        with _sigint_not_ignored():
            return subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-p",
                    "no:cacheprovider",
                    *self.plugin_args,
                    *self.start_options,
                    *args,
                ],
                cwd=self.path,
                env={**os.environ, **_ONLY_NAMED_PLUGINS, **(env or {})},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )


@contextlib.contextmanager
def _sigint_not_ignored():
    """While it lasts, SIGINT is handled, so processes started now get its default action."""
    previous = signal.getsignal(signal.SIGINT)
    if previous == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if previous == signal.SIG_IGN:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def make_gpuiso(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    start: str | None = "spawn",
    plugins: tuple[str, ...] = (),
) -> GpuIso:
    """A ``GpuIso`` whose runs see the same terminal everywhere: pytest stops truncating
    summary lines when it detects CI (CI, BUILD_NUMBER), and wraps at the terminal's width.
    Its runs load ours, xdist, timeout and ``plugins`` (pytest11 entry points).

    With the fork server, a fork waits for the template to finish collecting, so that a
    run takes one path whatever the timing (forked from the template, unless it gives up).
    """
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("BUILD_NUMBER", raising=False)
    monkeypatch.setenv("COLUMNS", "80")
    if REGION_ENV not in os.environ:  # never the user's own lease table
        monkeypatch.setenv(REGION_ENV, str(pytester.path.parent / f"{pytester.path.name}-leases"))
    if os.environ.get("TMPDIR") == _TMPDIR:  # nor a work directory other tests' runs share:
        # a run that starts as another test's session was killed would end its leftovers
        # and warn about them (a warning more than the test expects)
        tmpdir = pytester.path.parent / f"{pytester.path.name}-tmp"
        tmpdir.mkdir(exist_ok=True)
        monkeypatch.setenv("TMPDIR", str(tmpdir))
    if start == "forkserver":  # every test's process from the collected template, if it can
        monkeypatch.setenv(TEMPLATE_WAIT_ENV, "120")
    return GpuIso(pytester, start=start, plugins=plugins)


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Poll `predicate` every 5 ms; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {timeout} s waiting for {what}")
        time.sleep(0.005)


def wait_for_file(path: Path, timeout: float = 60) -> str:
    """Wait until ``path`` exists and is not empty; return its text."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(0.05)
    raise AssertionError(f"{path} did not appear within {timeout} s")


def pid_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait up to ``timeout`` for all ``pids`` to exit; return the ones still alive."""
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if pid_alive(p)]
        if alive:
            time.sleep(0.02)
    return alive


def kill_quietly(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
