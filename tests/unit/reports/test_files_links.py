"""Report files and symbolic links: a link of yours (or root's) is followed and the file
it names replaced, keeping that file's mode; another user's link (planted in a shared
``/tmp``) is never followed, at configure time or when the report is written."""

from __future__ import annotations

import os
import stat

import pytest

from pytest_gpuiso.reports import files
from pytest_gpuiso.values import SpecError

OTHER_UID = 2202


@pytest.fixture
def foreign_link(monkeypatch):
    """Make a symbolic link that belongs to another user: chown'd as root, else made
    ours while the plugin believes it runs as another uid."""

    def make(link, target):
        os.symlink(target, link)
        if os.geteuid() == 0:
            os.lchown(link, OTHER_UID, OTHER_UID)
        else:
            uid = os.geteuid()
            monkeypatch.setattr(os, "geteuid", lambda: uid + 1)
        return link

    return make


def test_another_users_link_is_not_followed(tmp_path, foreign_link):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o1777)
    keep = tmp_path / "keep.txt"
    keep.write_text("ssh-ed25519 AAAA victim\n")
    keep.chmod(0o600)
    link = foreign_link(shared / "gpuiso.json", keep)

    with pytest.raises(OSError) as raised:
        files.write_json(link, [])
    assert raised.value.strerror.startswith(f"{link} is a symbolic link of uid ")
    assert raised.value.strerror.endswith("not yours: not followed")
    assert keep.read_text() == "ssh-ed25519 AAAA victim\n"
    assert stat.S_IMODE(keep.stat().st_mode) == 0o600
    assert os.path.islink(link)
    assert [p.name for p in shared.iterdir()] == ["gpuiso.json"]  # no temporary file left

    with pytest.raises(SpecError, match="symbolic link of uid .*not yours: not followed"):
        files.check_output(str(link), "--gpu-isolate-report", str(tmp_path))


def test_a_link_in_the_folder_part_is_judged_too(tmp_path, foreign_link):
    real = tmp_path / "real"
    real.mkdir()
    foreign_link(tmp_path / "reports", real)
    with pytest.raises(OSError, match="not followed"):
        files.write_text(tmp_path / "reports" / "summary.md", "# hi\n")
    assert list(real.iterdir()) == []


def test_your_own_link_is_followed_and_the_files_mode_kept(tmp_path):
    target = tmp_path / "private.json"
    target.write_text("old")
    target.chmod(0o600)
    link = tmp_path / "report.json"
    link.symlink_to(target)

    files.write_json(link, [])
    assert os.path.islink(link)  # the link kept, the file it names replaced
    assert target.read_text().startswith('{\n  "version"')
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    files.check_output(str(link), "--gpu-isolate-report", str(tmp_path))  # no error


def test_a_new_report_is_0644(tmp_path):
    files.write_text(tmp_path / "new" / "summary.md", "# hi\n")
    assert stat.S_IMODE((tmp_path / "new" / "summary.md").stat().st_mode) == 0o644


@pytest.mark.parametrize(
    "path", ["a/b/../c", "./x", "/tmp/../tmp/y", "/proc/self/cwd/z", "nested/../../w"]
)
def test_resolved_agrees_with_realpath_where_every_link_is_yours(tmp_path, monkeypatch, path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a" / "b").mkdir(parents=True)
    assert files.resolved(path) == os.path.realpath(path)


def test_a_link_loop_is_an_error_not_a_hang(tmp_path):
    (tmp_path / "one").symlink_to(tmp_path / "two")
    (tmp_path / "two").symlink_to(tmp_path / "one")
    with pytest.raises(OSError, match="too many levels of symbolic links"):
        files.resolved(tmp_path / "one" / "x")
