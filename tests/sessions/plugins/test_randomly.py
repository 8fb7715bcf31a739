"""pytest-randomly with isolated tests: one seed for the session, whatever process runs a test.

fixtures/programs/plugins/plugin_randomly has two isolated tests and one in-process test, each
writing the ``random.random()`` it sees and its process's seed. Without ``--randomly-seed``
pytest makes one; every test's process (the fork server's template included, which
configures once for all its forks) must use it: the values equal those of an in-process
run with that seed given explicitly, and the cache keeps the seed the header printed.
These runs load pytest-randomly, which the rest of the suite turns off (tests/helpers/).
"""

from __future__ import annotations

import json
import re

import pytest

from tests.helpers import GpuIso

# Another plugin's API; the runs (_run) start pytest themselves, with every installed plugin
pytestmark = pytest.mark.versions

pytest.importorskip("pytest_randomly")

PROGRAM = "plugin_randomly"
NAMES = {"test_isolated_one", "test_isolated_two", "test_in_process"}


def _run(gpuiso: GpuIso, *args: str) -> pytest.RunResult:
    return gpuiso.pytester.runpytest_subprocess(
        "-p", "no:hypothesispytest", *gpuiso.start_options, *args, PROGRAM, timeout=180
    )


def _values(gpuiso: GpuIso) -> dict[str, tuple[str, str]]:
    """name -> (random value, seed) from values.txt, which is then removed."""
    path = gpuiso.path / PROGRAM / "values.txt"
    lines = [line.split() for line in path.read_text().splitlines()]
    path.unlink()
    values = {name: (value, seed) for name, value, seed in lines}
    assert set(values) == NAMES and len(lines) == len(NAMES), lines
    return values


def _header_seed(result: pytest.RunResult) -> int:
    found = re.search(r"Using --randomly-seed=(\d+)", result.stdout.str())
    assert found, result.stdout.str()
    return int(found.group(1))


def _check_against_in_process(gpuiso: GpuIso, isolated: dict, seed: int) -> None:
    """An in-process run with the seed given explicitly sees the same values."""
    result = _run(gpuiso, "--no-gpu-isolate", f"--randomly-seed={seed}")
    result.assert_outcomes(passed=3)
    assert _values(gpuiso) == isolated


@pytest.mark.parametrize("workers", [0, 2], ids=["serial", "xdist"])
def test_isolated_tests_use_the_sessions_seed(gpuiso: GpuIso, workers: int) -> None:
    gpuiso.copy(PROGRAM)
    result = _run(gpuiso, "-v", *(("-n", str(workers)) if workers else ()))
    result.assert_outcomes(passed=3)
    seed = _header_seed(result)
    if gpuiso.start == "forkserver" and not workers:  # the template configured for them
        result.stdout.fnmatch_lines(["gpu-isolate: started 2 forkserver; *; 2 pre-collected"])
    isolated = _values(gpuiso)
    assert {s for _, s in isolated.values()} == {str(seed)}
    cached = gpuiso.path / ".pytest_cache" / "v" / "randomly_seed"
    assert json.loads(cached.read_text()) == seed  # no test's process wrote its own
    _check_against_in_process(gpuiso, isolated, seed)


def test_last_seed_is_the_cached_one(gpuiso: GpuIso) -> None:
    """``--randomly-seed=last``: pytest reads the cache, the tests' processes use that."""
    gpuiso.copy(PROGRAM)
    first = _run(gpuiso, "--randomly-seed=4242")
    first.assert_outcomes(passed=3)
    _values(gpuiso)
    result = _run(gpuiso, "--randomly-seed=last")
    result.assert_outcomes(passed=3)
    assert _header_seed(result) == 4242
    isolated = _values(gpuiso)
    assert {s for _, s in isolated.values()} == {"4242"}
    _check_against_in_process(gpuiso, isolated, 4242)


def test_no_resolved_seed_is_one_warning(pytester: pytest.Pytester) -> None:
    """Should pytest-randomly keep no int seed on the option (another version), the
    session gets one warning and the tests' processes their own seeds, as before."""
    from pytest_gpuiso import GpuIsoStartWarning
    from pytest_gpuiso.adapters.randomly import RandomlyAdapter

    config = pytester.parseconfigure("-p", "randomly", "-p", "no:hypothesispytest")
    recorded = []

    class Recorder:
        def pytest_warning_recorded(self, warning_message, when, nodeid, location):
            if warning_message.category is GpuIsoStartWarning:
                recorded.append(str(warning_message.message))

    config.pluginmanager.register(Recorder())
    config.option.randomly_seed = "default"
    assert RandomlyAdapter().pytest_gpuiso_child_options(config) is None
    assert len(recorded) == 1
    assert re.match(r"pytest-randomly \S+: no resolved seed", recorded[0]), recorded
