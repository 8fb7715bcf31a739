"""Another local user's symbolic link or FIFO where a session or a command writes a report
(a shared ``/tmp``): a link is never followed (one into the writer's own ``/proc/self/root``
neither), a FIFO never written into (its owner, reading it, would have the report). The
session refuses the path at configure time, the commands in one line; the file the link
names is left as it was."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from pytest_gpuiso.reports.files import OUTPUT_FORMS
from tests.helpers import USAGE_ERROR

OTHER_UID = 2202
LINK = f"is a symbolic link of uid {OTHER_UID}, not yours: not followed"
FIFO = f"is a FIFO of uid {OTHER_UID}, not yours: not written"
REFUSED = {"gpuiso.json": LINK, "merged.json": LINK, "merged.md": LINK, "proc.json": LINK}
REFUSED["fifo.json"] = FIFO  # what planted() puts at each name: why it is refused


@pytest.fixture
def planted(tmp_path):
    """A file of yours (0600) and, in a sticky shared folder, another user's links to it
    (``proc.json`` through ``/proc/self/root``) and FIFO (``fifo.json``)."""
    if os.geteuid() != 0:
        pytest.skip("needs root (to make a link owned by another user)")
    keep = tmp_path / "keep.txt"
    keep.write_text("ssh-ed25519 AAAA victim\n")
    keep.chmod(0o600)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    for name in ("gpuiso.json", "merged.json", "merged.md"):
        os.symlink(keep, shared / name)
        os.lchown(shared / name, OTHER_UID, OTHER_UID)
    # the same file through the writer's own /proc/self/root, and a FIFO to read it from
    os.symlink(f"/proc/self/root{keep}", shared / "proc.json")
    os.lchown(shared / "proc.json", OTHER_UID, OTHER_UID)
    os.mkfifo(shared / "fifo.json", 0o622)
    os.chown(shared / "fifo.json", OTHER_UID, OTHER_UID)
    yield shared
    assert keep.read_text() == "ssh-ed25519 AAAA victim\n"
    assert stat.S_IMODE(keep.stat().st_mode) == 0o600


@pytest.mark.parametrize("name", ["gpuiso.json", "proc.json", "fifo.json"])
def test_a_session_refuses_another_users_link_or_fifo_as_its_report(gpuiso_spawn, planted, name):
    """Refused at configure time, in one line; the FIFO is not even opened (its owner,
    reading it, would get the report)."""
    gpuiso_spawn.pytester.makepyfile(test_plain="def test_plain():\n    pass\n")
    path = planted / name
    reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK) if name == "fifo.json" else None
    try:
        result = gpuiso_spawn.run("--gpu-isolate", f"--gpu-isolate-report={path}")
        stolen = os.read(reader, 1 << 16) if reader is not None else b""
    finally:
        if reader is not None:
            os.close(reader)
    assert result.ret == USAGE_ERROR
    [line] = [line for line in result.errlines if line]
    assert line.startswith("ERROR: gpu-isolate: invalid value "), line
    expected = f"for --gpu-isolate-report: expected {OUTPUT_FORMS} ({path} {REFUSED[name]})"
    assert line.endswith(expected), line
    assert stolen == b""


@pytest.mark.parametrize(
    ("option", "name"),
    [
        ("--json", "merged.json"),
        ("--markdown", "merged.md"),
        ("--json", "proc.json"),
        ("--markdown", "fifo.json"),
    ],
)
def test_merge_refuses_another_users_link_or_fifo_in_one_line(tmp_path, planted, option, name):
    shard = tmp_path / "shard.json"
    shard.write_text('{"version": 1, "tests": []}')
    out = planted / name
    reader = os.open(out, os.O_RDONLY | os.O_NONBLOCK) if name == "fifo.json" else None
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pytest_gpuiso", "merge", str(shard), option, str(out)],
            capture_output=True,
            text=True,
            cwd="/",
            timeout=60,
        )
        stolen = os.read(reader, 1 << 16) if reader is not None else b""
    finally:
        if reader is not None:
            os.close(reader)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"{out} {REFUSED[name]}" in lines[0]
    assert stolen == b""
