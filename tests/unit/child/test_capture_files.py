"""The files pytest's fd capture writes to, in a test's process: the session's global
capture gets named, private files (they outlive a crash, and pytest's process shows
their tail); every capture made later (capfd's, each subtest's) stays anonymous."""

from __future__ import annotations

import os
import stat

import _pytest.capture as capture

from pytest_gpuiso.child.relay import named_capture_files


def test_only_the_files_made_inside_get_names(tmp_path):
    prefix = str(tmp_path / "cap-t-")
    with named_capture_files(prefix):
        out, err = capture.TemporaryFile(buffering=0), capture.TemporaryFile(buffering=0)
    later = capture.TemporaryFile(buffering=0)
    try:
        names = sorted(p.name for p in tmp_path.iterdir())
        assert names == ["cap-t-1", "cap-t-2"]
        assert os.path.samefile(f"/proc/self/fd/{out.fileno()}", tmp_path / "cap-t-1")
        assert os.path.samefile(f"/proc/self/fd/{err.fileno()}", tmp_path / "cap-t-2")
        assert stat.S_IMODE((tmp_path / "cap-t-1").stat().st_mode) == 0o600
        assert not os.readlink(f"/proc/self/fd/{later.fileno()}").startswith(str(tmp_path))
    finally:
        for f in (out, err, later):
            f.close()


def test_pytests_own_files_come_back_even_when_the_block_fails(tmp_path):
    try:
        with named_capture_files(str(tmp_path / "cap-")):
            raise RuntimeError("configuring failed")
    except RuntimeError:
        pass
    f = capture.TemporaryFile(buffering=0)
    f.close()
    assert list(tmp_path.iterdir()) == []
