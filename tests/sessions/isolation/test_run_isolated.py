"""run_isolated / the gpu_isolated_run fixture: values, remote exceptions, timeouts, crashes."""

from __future__ import annotations

import os
import sys

import pytest

from pytest_gpuiso import IsolatedTimeout, IsolationError, RemoteError, run_isolated
from tests.helpers import program

sys.path.insert(0, str(program("isolated_funcs.py").parent))
import isolated_funcs as funcs  # noqa: E402


def test_returns_the_value_from_another_process():
    assert run_isolated(funcs.add, 2, 3, scale=10) == 50
    assert run_isolated(funcs.whoami) != os.getpid()


def test_big_result_comes_back():
    assert run_isolated(funcs.big_result) == b"r" * 5_000_000


def test_remote_exception_is_reraised_with_remote_traceback():
    with pytest.raises(ValueError, match="^boom") as info:
        run_isolated(funcs.raise_value_error, "boom")
    assert str(info.value) == "boom"
    cause = str(info.value.__cause__)
    assert "Remote traceback" in cause
    assert "in raise_value_error" in cause


def test_ten_megabyte_exception_message_arrives_whole():
    with pytest.raises(RuntimeError) as info:
        run_isolated(funcs.big_message)
    assert str(info.value) == "B" * 10_000_000


def test_unpicklable_exception_comes_back_as_text():
    with pytest.raises(RemoteError) as info:
        run_isolated(funcs.raise_unpicklable)
    assert info.value.type_name == "isolated_funcs.Unpicklable"
    assert "lock inside" in str(info.value)
    assert "in raise_unpicklable" in info.value.remote_traceback


def test_unpicklable_return_value_is_an_error_naming_it():
    with pytest.raises(RemoteError, match="return value of isolated_funcs.return_unpicklable"):
        run_isolated(funcs.return_unpicklable)


def test_timeout_raises_with_the_stack():
    with pytest.raises(IsolatedTimeout) as info:
        run_isolated(funcs.hang, timeout=1, grace=0.5)
    message = str(info.value)
    assert "timed out after 1 s" in message
    assert "in hang" in message
    assert isinstance(info.value, TimeoutError)
    # the caller's frames, not the plugin's; the exception by its public name
    assert "pytest_gpuiso/" not in message, message
    assert "frames of pytest and pytest-gpuiso internals" in message
    assert f"{type(info.value).__module__}.{type(info.value).__qualname__}" == (
        "pytest_gpuiso.IsolatedTimeout"
    )


def test_crash_names_the_signal():
    with pytest.raises(IsolationError, match="crashed with SIGSEGV"):
        run_isolated(funcs.segfault)


def test_silent_exit_is_an_error():
    with pytest.raises(IsolationError, match="exited with code 0"):
        run_isolated(funcs.exit_quietly)


def test_unpicklable_function_cannot_start():
    with pytest.raises(IsolationError, match="could not start the isolated process"):
        run_isolated(lambda: 1)


@pytest.mark.parametrize(
    ("kwargs", "culprit"),
    [
        ({"timeout": "abc"}, "invalid value 'abc' for run_isolated argument timeout"),
        ({"timeout": 0}, "invalid value 0 for run_isolated argument timeout"),
        ({"gpus": -1}, "invalid value -1 for run_isolated argument gpus"),
        ({"grace": -1}, "invalid value -1 for run_isolated argument grace"),
    ],
)
def test_bad_arguments_name_the_culprit(kwargs, culprit):
    with pytest.raises(ValueError, match=culprit):
        run_isolated(funcs.add, 1, 2, **kwargs)


def test_fixture_inside_a_pytest_session(gpuiso_spawn):
    gpuiso_spawn.copy("isolated_funcs.py")
    gpuiso_spawn.pytester.makepyfile(
        test_phases="""
        import os
        import isolated_funcs

        def test_phases(gpu_isolated_run):
            assert gpu_isolated_run(isolated_funcs.add, 1, 2) == 3
            assert gpu_isolated_run(isolated_funcs.whoami) != os.getpid()
        """
    )
    gpuiso_spawn.run().assert_outcomes(passed=1)


def test_gpus_are_leased_and_visible(tmp_path, monkeypatch):
    """gpus=N leases N of the discovered GPUs; the call sees exactly them."""
    monkeypatch.setenv("PYTEST_GPUISO_LEASE_REGION", str(tmp_path / "leases"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4")
    assert run_isolated(funcs.visible, gpus=1) in ("3", "4")
    assert sorted(run_isolated(funcs.visible, gpus=2).split(",")) == ["3", "4"]
    assert run_isolated(funcs.visible) == "3,4"  # gpus=0: the environment as it is
    with pytest.raises(IsolationError, match=r"needs 3 GPUs, 2 \(3, 4\) available"):
        run_isolated(funcs.visible, gpus=3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(IsolationError, match=r"needs 1 GPU, none available"):
        run_isolated(funcs.visible, gpus=1)


def test_fixture_inside_an_isolated_test_uses_the_tests_gpus(gpuiso, tmp_path, monkeypatch):
    """A nested call uses the GPUs its test holds instead of queueing behind them."""
    monkeypatch.setenv("PYTEST_GPUISO_LEASE_REGION", str(tmp_path / "leases"))
    gpuiso.copy("isolated_funcs.py")
    gpuiso.pytester.makepyfile(
        test_nested="""
        import pytest
        import isolated_funcs
        from pytest_gpuiso import IsolationError

        @pytest.mark.gpu_isolated(gpus=2, timeout=60)
        def test_nested(gpu_isolated_run):
            assert gpu_isolated_run(isolated_funcs.visible, gpus=2) == "0,1"
            assert gpu_isolated_run(isolated_funcs.visible, gpus=1) == "0"
            with pytest.raises(IsolationError, match="its test holds 2"):
                gpu_isolated_run(isolated_funcs.visible, gpus=3)
        """
    )
    gpuiso.run("--gpu-isolate-devices=0,1").assert_outcomes(passed=1)


def test_a_failing_call_shows_the_test_not_the_plugin(gpuiso_spawn):
    """The traceback of a failing run_isolated call (and of the fixture's) leads from the
    test to the remote error: the plugin's frames are hidden (``__tracebackhide__``)."""
    gpuiso_spawn.copy("isolated_funcs.py")
    gpuiso_spawn.pytester.makepyfile(
        test_fail="""
        import isolated_funcs
        from pytest_gpuiso import run_isolated

        def test_direct():
            run_isolated(isolated_funcs.raise_value_error, "remote boom")

        def test_fixture(gpu_isolated_run):
            gpu_isolated_run(isolated_funcs.raise_value_error, "remote boom")
        """
    )
    result = gpuiso_spawn.run()
    result.assert_outcomes(failed=2)
    out = result.stdout.str()
    assert out.count("ValueError: remote boom") >= 2, out
    assert "pytest_gpuiso/parent/call.py" not in out, out
    assert "pytest_gpuiso/plugin.py" not in out, out
