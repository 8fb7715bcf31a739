"""What a test's process writes on its pipe to pytest (pickles,
frames of the wrong shape, spill numbers naming links, FIFOs or huge files, a frame
that never completes) is that test's error: pytest runs none of its code, reads and
deletes nothing but the test's own spill files, waits no longer than the test's
deadline, and the session (xdist's controller too) carries on."""

from __future__ import annotations

import pytest

from tests.helpers import GpuIso

PROGRAM = "result_channel"


@pytest.fixture
def hostile(gpuiso_spawn: GpuIso) -> GpuIso:
    gpuiso_spawn.copy(f"{PROGRAM}/hostile.py", f"{PROGRAM}/test_hostile.py")
    (gpuiso_spawn.path / "victim.txt").write_text("important\n")
    return gpuiso_spawn


def _failure(result: pytest.RunResult, test: str) -> str:
    """The failure section of one test, as the terminal shows it."""
    text = result.stdout.str()
    start = text.index(f" {test} _")
    end = text.find("\n_", start + 1)
    return text[start : end if end > 0 else None]


UNREADABLE = "unreadable message from the test process: "


def test_what_a_test_process_sends_is_that_tests_error_only(hostile: GpuIso, lease_region):
    result = hostile.run("-p", "no:randomly", "--tb=short", "test_hostile.py")
    text = result.stdout.str()
    assert "INTERNALERROR" not in text and "Traceback (most recent call last)" not in text
    # the wrong report came on top of the test's own: it passed, and errs in teardown
    result.assert_outcomes(failed=9, passed=5, errors=1)
    assert not (hostile.path / "rce.txt").exists(), "pytest ran the pickle's code"
    assert (hostile.path / "victim.txt").read_text() == "important\n"
    expected = {
        "test_pickle_in_a_frame": UNREADABLE + "not a message (",
        "test_report_of_the_wrong_shape": UNREADABLE + "a report pytest cannot take (",
        "test_spill_names_a_path": UNREADABLE + "a spill file number that is not one: '/",
        "test_spill_is_a_link": "cannot be read (Too many levels of symbolic links)",
        "test_spill_is_a_link_to_dev_zero": "cannot be read (Too many levels of symbolic links)",
        "test_spill_is_a_fifo": "is not a regular file",
        "test_spill_is_huge": f"has {1 << 40} bytes (at most 268435456)",
        "test_frame_too_long": UNREADABLE + f"it sent a message of {1 << 30} bytes",
        "test_bad_warning": UNREADABLE + "a 'warning' frame of the wrong shape: {}",
        "test_partial_frame": "Timeout: the isolated test timed out after 3 s",
    }
    for test, message in expected.items():
        failure = _failure(result, test)
        assert message in failure, (test, failure[-2000:])
        if test != "test_partial_frame":
            assert "sent pytest a message it cannot take" in failure, failure[-2000:]
    # the spill files were removed, links and FIFOs included; what they pointed at was not
    assert not list(hostile.path.rglob("spill-*"))


def test_a_frame_of_the_wrong_shape_under_xdist_fails_its_test_only(hostile: GpuIso, lease_region):
    result = hostile.run("-n", "2", "-k", "bad_warning or other", "test_hostile.py")
    assert "INTERNALERROR" not in result.stdout.str()
    result.assert_outcomes(failed=1, passed=4)


def test_a_huge_captured_output_reaches_pytest_as_its_end(gpuiso_spawn: GpuIso, lease_region):
    """n12: what a test prints beyond 16 Mi characters in one section is not sent to
    pytest (whose memory would hold it all): the section says so, and keeps the end."""
    gpuiso_spawn.pytester.makepyfile(
        test_chatty="""
        import sys, pytest

        @pytest.mark.gpu_isolated(timeout=120)
        def test_chatty():
            for _ in range(17):
                sys.stdout.write(("y" * 1023 + "\\n") * 1024)
            print("THE-END")
        """
    )
    result = gpuiso_spawn.run("--junitxml=junit.xml", "-o", "junit_logging=system-out")
    result.assert_outcomes(passed=1)
    junit = (gpuiso_spawn.path / "junit.xml").read_text()
    total = 17 * (1 << 20) + len("THE-END\n")
    cut = ((16 << 20) - len("THE-END\n")) % 1024  # the first line kept is cut: dropped too
    dropped = total - (16 << 20) + cut
    assert f"[gpu-isolate: the first {dropped} of its {total} characters are not kept]" in junit
    assert junit.count("y" * 1023) == 16 * 1024 - 1  # the cut line is dropped whole
    assert "THE-END" in junit
