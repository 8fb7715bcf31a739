"""Another local user's symbolic link where a session or a command writes a report (a
shared ``/tmp``): never followed. The session refuses the path at configure time, the
commands in one line; the file the link names is left as it was."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from tests.helpers import USAGE_ERROR

OTHER_UID = 2202


@pytest.fixture
def planted(tmp_path):
    """A file of yours (0600) and, in a sticky shared folder, another user's links to it."""
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
    yield shared
    assert keep.read_text() == "ssh-ed25519 AAAA victim\n"
    assert stat.S_IMODE(keep.stat().st_mode) == 0o600


def test_a_session_refuses_another_users_link_as_its_report(gpuiso_spawn, planted):
    gpuiso_spawn.pytester.makepyfile(test_plain="def test_plain():\n    pass\n")
    link = planted / "gpuiso.json"
    result = gpuiso_spawn.run("--gpu-isolate", f"--gpu-isolate-report={link}")
    assert result.ret == USAGE_ERROR
    assert [line for line in result.errlines if line] == [
        f"ERROR: gpu-isolate: invalid value {str(link)!r} for --gpu-isolate-report: "
        f"{link} is a symbolic link of uid {OTHER_UID}, not yours: not followed"
    ]


@pytest.mark.parametrize("option", ["--json", "--markdown"])
def test_merge_refuses_another_users_link_in_one_line(tmp_path, planted, option):
    shard = tmp_path / "shard.json"
    shard.write_text('{"version": 1, "tests": []}')
    out = planted / ("merged.json" if option == "--json" else "merged.md")
    done = subprocess.run(
        [sys.executable, "-m", "pytest_gpuiso", "merge", str(shard), option, str(out)],
        capture_output=True,
        text=True,
        cwd="/",
    )
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"{out} is a symbolic link of uid {OTHER_UID}, not yours: not followed" in lines[0]
