"""A test that puts an unlocked lock file in the place of its session's (the real one
moved aside, still locked) cannot make the next session take the live session for dead:
the identity its processes carry names the real lock file's inode, which the lock file
holds from the directory's making (``workdir._proven``); a directory a process still has a
file open in is kept."""

from __future__ import annotations

PROGRAM = "trust_lock_swap.py"


def test_a_swapped_lock_ends_nothing_and_keeps_the_directory(gpuiso, lease_region, private_tmpdir):
    gpuiso.copy(PROGRAM)
    result = gpuiso.run("--gpu-isolate-devices=0", PROGRAM)
    result.assert_outcomes(passed=2)
