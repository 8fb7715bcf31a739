"""A dead session's /dev/shm entries, judged from the shim's logs in its work directory
(``leaks.shm.DeadSessionShm``), and the logs read safely (``shm_log.read_log``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from pytest_gpuiso.leaks.shm import DeadSessionShm
from pytest_gpuiso.leaks.shm_log import LOG_LIMIT, read_log
from tests.helpers import SHM


def _dead_dir(tmp_path: Path, log: bytes) -> Path:
    path = tmp_path / "4242-dead"
    path.mkdir()
    (path / "lock").write_text("")
    (path / "shm-1.log").write_bytes(log)
    return path


def test_only_entries_still_as_logged_and_changed_since_the_session_began_are_deleted(
    tmp_path, shm_name
):
    """A logged name whose inode differs (recreated by someone else since), one unchanged
    since before the dead session made its directory (a line naming what existed
    before), an ignored one and one open in a live process are neither deleted nor
    named."""
    old = SHM / f"{shm_name}-old"
    old.write_bytes(b"x")
    time.sleep(1.2)  # past the slack given to filesystem timestamps
    made = {n: SHM / f"{shm_name}-{n}" for n in ("ours", "other", "ignored", "mapped")}
    for path in made.values():
        path.write_bytes(b"x" * 10)
    inode = {n: p.stat().st_ino for n, p in made.items()}
    lines = [
        f"7 {old.stat().st_ino} {old.name}",
        f"7 {inode['ours']} {made['ours'].name}",
        f"7 {inode['ours']} {made['other'].name}",  # another inode than its own
        f"7 {inode['ignored']} {made['ignored'].name}",
        f"7 {inode['mapped']} {made['mapped'].name}",
    ]
    workdir = _dead_dir(tmp_path, ("\n".join(lines) + "\n").encode())
    with open(made["mapped"], "rb") as held:  # open by a live process: someone uses it
        dead = DeadSessionShm(ignore=(f"{shm_name}-ig*",), cleanup=True)
        dead.take(workdir, "4242")
        text = dead.dispose()
        assert held.read() == b"x" * 10
    assert text == (
        "deleted 1 /dev/shm entry (10 bytes) created by the tests of a pytest session that "
        f"died (pid 4242): {made['ours']}"
    )
    assert not made["ours"].exists()
    assert all(made[n].exists() for n in ("other", "ignored", "mapped")) and old.exists()


def test_a_log_that_is_not_a_regular_file_is_not_read(tmp_path):
    """A test may put a FIFO or a symlink in its log's place: nothing blocks, nothing is
    followed; a log past the bound is read up to it."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert read_log(str(fifo)) == {}
    target = tmp_path / "target"
    target.write_bytes(b"7 12 name\n")
    link = tmp_path / "link"
    link.symlink_to(target)
    assert read_log(str(link)) == {}
    assert list(read_log(str(target))) == ["name"]
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.write(b"7 12 first\n")
        f.seek(LOG_LIMIT - 4)
        f.write(b"7 13 cut\n")
    assert list(read_log(str(big))) == ["first"]


def test_a_name_with_a_newline_is_named_on_one_line(tmp_path, shm_name):
    """Without cleanup the entry is named, escaped (the shim logs a newline as %0A), and
    left."""
    path = SHM / f"{shm_name}-a\nb"
    path.write_bytes(b"x")
    line = f"7 {path.stat().st_ino} {shm_name}-a%0Ab\n"
    dead = DeadSessionShm()
    dead.take(_dead_dir(tmp_path, line.encode()), "4242")
    assert dead.dispose() == (
        "left 1 /dev/shm entry (1 bytes) created by the tests of a pytest session that died "
        f"(pid 4242) in place: {ascii(str(path))} (--gpu-isolate-cleanup deletes them)"
    )
    assert path.exists()
