"""The pytest_gpuiso_* hooks: options down to the tests' processes, payloads back up.

fixtures/programs/isolation/plugin_hooks/conftest.py implements them; each run checks what reached
pytest per test, under both start methods (the fork server's template included),
with prewarming and under xdist.
"""

from __future__ import annotations

import json

import pytest

# pytest's report formats, hooks and internals: CI's lowest-versions stage runs them all
pytestmark = pytest.mark.versions

PROGRAM = "plugin_hooks"
VALUES = {f"plugin_hooks/test_hooks.py::test_value[{n}]": f"value-{n}" for n in (1, 2, 3)}


def _payloads(gpuiso) -> dict[str, dict]:
    path = gpuiso.path / PROGRAM / "payloads.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    by_test = {line["nodeid"]: line for line in lines}
    assert len(by_test) == len(lines), lines  # one payload a test
    return by_test


def _check(gpuiso, result: pytest.RunResult, workers: int = 0) -> None:
    result.assert_outcomes(passed=5, failed=1)
    payloads = _payloads(gpuiso)
    assert set(payloads) == set(VALUES) | {"plugin_hooks/test_hooks.py::test_unpicklable"}
    pids = set()
    for nodeid, value in VALUES.items():
        got = payloads[nodeid]
        assert got["payload"]["value"] == value
        assert got["whens"] == ["setup", "call", "teardown"]
        # the parent's token, seen by the test's process at its configure time
        assert got["payload"]["configured_token"] == f"parent-{got['parent']}"
        assert got["payload"]["pid"] != got["parent"]
        pids.add(got["payload"]["pid"])
    assert len(pids) == 3  # a process a test
    if not workers:
        assert len({got["parent"] for got in payloads.values()}) == 1
    # the parent hook's change to the reports is what pytest logged
    logged = (gpuiso.path / PROGRAM / "logged.txt").read_text().splitlines()
    expected = [f"{k} {v}" for k, v in VALUES.items()]
    expected.append("plugin_hooks/test_hooks.py::test_unpicklable never-sent")
    # (under xdist the worker and the controller both log each report)
    assert sorted(logged) == sorted(expected * (2 if workers else 1))
    out = result.stdout.str()
    # a crashed process sends nothing; a failing child hook is a warning, its test passes
    assert "test_crashes" in out and "FAILED" in out
    assert "pytest_gpuiso_child_payload failed: RuntimeError: plugin_hooks broke on purpose" in out
    # a value that is not plain data arrives as its repr, with a warning naming it; the
    # other keys stand
    assert (
        "pytest_gpuiso_child_payload['plugin_hooks-bad'] is a builtins.function, which "
        "pytest's process takes only as plain data" in out
    )
    assert "its repr() is sent instead" in out


def test_options_down_and_payloads_up(gpuiso) -> None:
    gpuiso.copy(PROGRAM)
    result = gpuiso.run("-W", "always", PROGRAM)
    _check(gpuiso, result)


def test_with_prewarming_and_no_precollection(gpuiso) -> None:
    gpuiso.copy(PROGRAM)
    result = gpuiso.run(
        "--gpu-isolate-prewarm=2", "--gpu-isolate-no-precollect", "-W", "always", PROGRAM
    )
    _check(gpuiso, result)


def test_under_xdist(gpuiso) -> None:
    gpuiso.copy(PROGRAM)
    result = gpuiso.run("-n", "2", "-W", "always", PROGRAM)
    _check(gpuiso, result, workers=2)


def test_the_hooks_are_declared_for_other_plugins(pytester: pytest.Pytester) -> None:
    """A plugin's misspelt hook name is an error, as for any declared hook family."""
    pytester.makeconftest("def pytest_gpuiso_child_payloadd(item, payload): pass\n")
    pytester.makepyfile("def test_x(): pass\n")
    result = pytester.runpytest_subprocess("-p", "no:randomly")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*unknown hook*pytest_gpuiso_child_payloadd*"])
