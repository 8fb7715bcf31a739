"""A shared memory segment a test leaves registered with multiprocessing's resource tracker
is the test's leak, reported and then deleted as the tracker would delete it, not a warning
the tracker prints on pytest's terminal when pytest exits. The sessions run
fixtures/programs/leaks/test_tracked_shm.py."""

from __future__ import annotations

from tests.helpers import REPORT, SHM

PROGRAM = "test_tracked_shm.py"
TRACKER = "resource_tracker"  # in the tracker's warning: ".../resource_tracker.py:254: ..."


def output_to_the_end(gpuiso, *args: str) -> str:
    """pytest's stdout and stderr, read until every process holding them has closed them:
    the tracker, a child of pytest's, writes its warning as pytest exits, maybe later."""
    gpuiso.copy(PROGRAM)
    proc = gpuiso.popen("--gpu-isolate", REPORT, *args)
    try:
        out, _ = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == 0, out.decode(errors="replace")
    return out.decode(errors="replace")


def test_a_segment_left_to_the_tracker_is_the_tests_leak_not_a_warning_at_exit(gpuiso, shm_name):
    output = output_to_the_end(gpuiso)
    assert TRACKER not in output
    records = gpuiso.records()
    [leak] = records[f"{PROGRAM}::test_leaves_a_tracked_segment"]["leaks"]
    path = f"/dev/shm/{shm_name}-tracked"
    assert (leak["kind"], leak["path"], leak["size"]) == ("shm", path, 4 << 20)
    assert leak["tracked"] is True and leak["cleaned"] is True
    assert leak["detail"].endswith(" (deleted, as Python's resource tracker would)")
    assert records[f"{PROGRAM}::test_unlinks_its_segment"]["leaks"] == []
    assert f"shm: segment {path} (4 MiB, created by pid {leak['pid']})" in output
    assert not list(SHM.glob(f"{shm_name}*"))  # as the tracker would have left it


def test_with_the_shm_check_off_the_segment_stays_the_trackers(gpuiso_spawn, shm_name):
    # No check to report it: the tracker's warning is the only word of it, and the
    # tracker deletes it as pytest exits. (This also shows that the test above would see
    # the tracker's warning.)
    output = output_to_the_end(gpuiso_spawn, "--gpu-isolate-leaks=shm=off")
    assert "There appear to be 1 leaked shared_memory objects" in output
    assert gpuiso_spawn.records()[f"{PROGRAM}::test_leaves_a_tracked_segment"]["leaks"] == []
    assert not list(SHM.glob(f"{shm_name}*"))
