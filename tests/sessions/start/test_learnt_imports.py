"""With the fork server, what one test imported while it ran is imported by a
successor of the template, and the tests forked after it have it, as in-process pytest
keeps a module an earlier test imported. A module that would leave the template unfit
to fork (a thread) is never learnt, and the template serves on."""

from __future__ import annotations

import json
import sys
import time
import types
from pathlib import Path

import psutil
import pytest

from pytest_gpuiso.child import imports
from pytest_gpuiso.wire import frames
from tests.helpers import REPORT, GpuIso, make_gpuiso

DIR = "learnt_imports"


@pytest.fixture
def forkserver(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> GpuIso:
    gpuiso = make_gpuiso(pytester, monkeypatch, "forkserver")
    gpuiso.copy(DIR)
    packages = ("lazy_pkg", "heavy_pkg", "thready_pkg", "envy_pkg", "slow_pkg", "shadow_mod.py")
    for package in packages:
        (gpuiso.path / DIR / package).rename(gpuiso.path / package)
    return gpuiso


def _had(gpuiso: GpuIso) -> dict[int, tuple[int, bool]]:
    """Per test (its parameter): its process and whether it had the package already."""
    lines = (gpuiso.path / "tests.log").read_text().split()
    rows = [lines[i : i + 3] for i in range(0, len(lines), 3)]
    return {int(n): (int(pid), pid_had == "1") for n, pid, pid_had in rows}


def _importers(gpuiso: GpuIso) -> list[int]:
    return [int(pid) for pid in (gpuiso.path / "imports.log").read_text().split()]


def _remembered(gpuiso: GpuIso) -> object:
    path = gpuiso.path / ".pytest_cache" / "v" / "gpuiso" / "learnt-imports"
    return json.loads(path.read_text()) if path.exists() else None


def test_later_tests_have_what_an_earlier_test_imported(forkserver: GpuIso, lease_region):
    args = ("--gpu-isolate", "-p", "no:randomly", "--gpu-isolate-leaks=fail", REPORT)
    result = forkserver.run(*args, f"{DIR}/test_lazy.py")
    result.assert_outcomes(passed=6)
    # every one forked from a template: the successor took over, and the old one was gone
    # before it could end the successor it forked
    assert all(r["start"]["collected"] for r in forkserver.records().values())
    had = _had(forkserver)
    assert not had[0][1]  # the first test imported it itself
    # Forked once the successor took over: test 1 waits until the successor has imported
    # the package, but takes no part in the successor's audit and its word to the server,
    # which a loaded machine can stretch past test 3's fork (at test 2's go). From the
    # first test forked after it on, every test has it; test 4 is forked a whole test later.
    flags = [had[n][1] for n in range(6)]
    assert flags == sorted(flags) and flags[4] and flags[5], had
    importers = _importers(forkserver)
    tests = {pid for pid, _ in had.values()}
    successors = [pid for pid in importers if pid not in tests]
    assert len(successors) == 1, (importers, had)  # one successor imported it, once
    assert not psutil.pid_exists(successors[0])  # pytest's child: reaped at the end


def test_the_next_tests_of_the_teaching_module_wait_for_the_successor(
    forkserver: GpuIso, lease_region
):
    """Case 0 imports heavy_pkg (2 s) itself; cases 1-3 are forked from the successor
    that imports it once, not each importing it anew: case 1, started ahead while case 0
    ran, is started again, and the server holds its fork until the successor has it."""
    args = ("--gpu-isolate", "-p", "no:randomly", REPORT)
    result = forkserver.run(*args, f"{DIR}/test_heavy.py")
    result.assert_outcomes(passed=4)
    had = _had(forkserver)
    assert [had[n][1] for n in range(4)] == [False, True, True, True], had
    tests = {pid for pid, _ in had.values()}
    importers = _importers(forkserver)
    assert importers[0] == had[0][0] and len(importers) == 2, (importers, had)
    assert importers[1] not in tests  # the successor
    assert all(r["start"]["collected"] for r in forkserver.records().values())


def test_without_learning_each_test_imports_it_itself(
    forkserver: GpuIso, lease_region, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("GPUISO_NOT_LEARNING", "1")
    args = ("--gpu-isolate", "-p", "no:randomly", "--gpu-isolate-no-learn-imports")
    result = forkserver.run(*args, f"{DIR}/test_lazy.py")
    result.assert_outcomes(passed=6)
    assert not any(had for _, had in _had(forkserver).values())
    assert sorted(_importers(forkserver)) == sorted(pid for pid, _ in _had(forkserver).values())


def test_a_module_that_reads_what_each_test_is_given_is_not_learnt(
    forkserver: GpuIso, lease_region
):
    """It reads MASTER_PORT and CUDA_VISIBLE_DEVICES at import: its successor exits, the
    template serves on, and every test sees its own port in it, as under spawn."""
    args = ("--gpu-isolate", "-p", "no:randomly", "--gpu-isolate-report=report.json")
    result = forkserver.run_with_cache(*args, f"{DIR}/test_envy.py")
    result.assert_outcomes(passed=4)
    assert _remembered(forkserver) is None  # nothing fit to keep for the next session
    assert not any(had for _, had in _had(forkserver).values())
    tests = {pid for pid, _ in _had(forkserver).values()}
    assert [pid for pid in _importers(forkserver) if pid not in tests]  # it tried


def test_a_module_that_starts_a_thread_is_not_learnt(forkserver: GpuIso, lease_region):
    """Its successor finds a thread after the import and exits; the template serves on."""
    args = (
        "--gpu-isolate",
        "-p",
        "no:randomly",
        "--gpu-isolate-leaks=fail",
        "--gpu-isolate-report=report.json",
    )
    result = forkserver.run_with_cache(*args, f"{DIR}/test_thready.py")
    result.assert_outcomes(passed=4)
    assert _remembered(forkserver) is None  # nothing fit to keep for the next session
    assert not any(had for _, had in _had(forkserver).values())
    records = forkserver.records().values()
    assert all(r["start"]["collected"] for r in records)  # each forked from the template
    tests = {pid for pid, _ in _had(forkserver).values()}
    successors = [pid for pid in _importers(forkserver) if pid not in tests]
    assert successors  # it tried
    deadline = time.monotonic() + 30  # it exits, and is reaped, on its own time
    while any(psutil.pid_exists(pid) for pid in successors) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(psutil.pid_exists(pid) for pid in successors)


def test_a_successor_still_importing_ends_with_the_session(forkserver: GpuIso, lease_region):
    """It dies with the template that forked it until it is ready to take over."""
    result = forkserver.run("--gpu-isolate", "-p", "no:randomly", f"{DIR}/test_slow.py")
    result.assert_outcomes(passed=2)
    tests = {pid for pid, _ in _had(forkserver).values()}
    [successor] = [pid for pid in _importers(forkserver) if pid not in tests]
    # its import sleeps 60 s: gone well before, it was ended, and reaped (not a zombie)
    deadline = time.monotonic() + 30
    while psutil.pid_exists(successor) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not psutil.pid_exists(successor)


def test_a_module_found_elsewhere_by_the_template_is_not_learnt(
    forkserver: GpuIso, lease_region, monkeypatch: pytest.MonkeyPatch
):
    """A test imports shadow_mod from a folder it put first on sys.path; the template would
    find the rootdir's shadow_mod instead: it does not import that one for later tests."""
    monkeypatch.setenv("SHADOW_LOG", str(forkserver.path / "tests.log"))
    result = forkserver.run("--gpu-isolate", "-p", "no:randomly", f"{DIR}/test_shadow.py")
    result.assert_outcomes(passed=4)
    assert not any(had for _, had in _had(forkserver).values())


def test_names_that_are_not_modules_go_nowhere(forkserver: GpuIso, lease_region):
    args = ("--gpu-isolate", "-p", "no:randomly", REPORT, f"{DIR}/test_hostile_names.py")
    result = forkserver.run(*args)
    result.assert_outcomes(passed=4)
    assert all(r["start"]["collected"] for r in forkserver.records().values())
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    assert not (forkserver.path / "pwned").exists()


def test_learnable_names_the_outermost_modules_imported_since_the_mark(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    package = tmp_path / "learn_unit_pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from . import sub\n")
    (package / "sub" / "__init__.py").write_text("")
    (tmp_path / "learn_unit_mod.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("learn_unit_pkg", "learn_unit_pkg.sub", "learn_unit_mod", "learn_unit_fake"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    start = imports.mark()
    import learn_unit_mod  # noqa: F401
    import learn_unit_pkg  # noqa: F401

    monkeypatch.setitem(sys.modules, "learn_unit_fake", types.ModuleType("learn_unit_fake"))
    monkeypatch.setitem(sys.modules, "learn_unit_alias", sys.modules["learn_unit_mod"])
    learnt = imports.learnable(start)
    origins = [str(tmp_path / "learn_unit_mod.py"), str(package / "__init__.py")]
    names = list(zip(["learn_unit_mod", "learn_unit_pkg"], origins, strict=True))
    assert learnt == {"names": names, "modules": 5}
    assert imports.learnable(imports.mark()) == {"names": [], "modules": 0}
    frames.check((frames.IMPORTED, learnt))


def test_what_tests_imported_is_remembered_for_the_next_session(
    forkserver: GpuIso, lease_region, monkeypatch: pytest.MonkeyPatch
):
    """Kept in pytest's cache, imported by a successor as soon as the template has
    collected; --cache-clear forgets it (an unfit module is never kept: above)."""
    args = ("--gpu-isolate", "-p", "no:randomly", f"{DIR}/test_remembered.py")
    forkserver.run_with_cache(*args, "-k", "test_imports").assert_outcomes(passed=1)
    [[name, origin]] = _remembered(forkserver)
    assert name == "lazy_pkg" and origin.endswith("lazy_pkg/__init__.py")
    # test_has[0] waits for this session's successor: an importer after these lines
    monkeypatch.setenv("GPUISO_IMPORTS_BEFORE", str(len(_importers(forkserver))))
    forkserver.run_with_cache(*args, "-k", "test_has").assert_outcomes(passed=4)
    had = _had(forkserver)
    assert not had[0][1] and had[3][1], had  # forked after the successor took over
    (forkserver.path / "tests.log").unlink()
    forkserver.run_with_cache(*args, "-k", "test_has", "--cache-clear").assert_outcomes(passed=4)
    assert not any(had for _, had in _had(forkserver).values())
    assert _remembered(forkserver) is None


class _Cache(dict):
    """pytest's Cache, as far as imports.remembered and remember use it."""

    def set(self, key: str, value: object) -> None:  # noqa: A003 - pytest's name
        self[key] = value


BAD = [{"a": 1}, "torch", [1, None], ["torch"], [["os.system('x')", "/x"]], [["a", ""]], None]


@pytest.mark.parametrize("value", BAD)
def test_a_cache_value_that_is_not_module_names_is_ignored_then_replaced(value):
    cache = _Cache({imports.CACHE_KEY: value} if value is not None else {})
    assert imports.remembered(cache) == ()
    tensor = ("torch.distributed.tensor", "/t/__init__.py")
    imports.remember(cache, dict([tensor, ("bad name", "/b.py")]), set())
    assert cache[imports.CACHE_KEY] == [list(tensor)]
    imports.remember(cache, {"sympy": "/s.py", "thready_pkg": "/p.py"}, {"thready_pkg"})
    assert imports.remembered(cache) == (("sympy", "/s.py"), tensor)  # the newest first
    assert imports.remembered(None) == ()
