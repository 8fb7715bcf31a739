"""Report files and symbolic links: a link of yours (or root's) is followed and the file
it names replaced, keeping that file's mode; another user's link (planted in a shared
``/tmp``) is never followed, at configure time or when the report is written."""

from __future__ import annotations

import os
import signal
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


# -- links into /proc and nodes of another user (FIFOs, devices) -------------------------


def _foreign(path, monkeypatch) -> None:
    """Make the node at ``path`` another user's: chown'd as root, else the plugin is made
    to believe it runs as another uid."""
    if os.geteuid() == 0:
        os.lchown(path, OTHER_UID, OTHER_UID)
    else:
        uid = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: uid + 1)


@pytest.fixture
def no_hang():
    """A write that blocks (a FIFO's open waiting for a reader) fails the test instead."""

    def hung(signum, frame):
        raise TimeoutError("blocked for 5 s")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(5)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("via", ["root", "cwd"])
def test_another_users_link_into_proc_is_not_followed(tmp_path, monkeypatch, foreign_link, via):
    """A link into the writer's own /proc (``/proc/self/root/<your file>``) is a link like
    any other: another user's is refused, never taken for a descriptor to write into."""
    monkeypatch.chdir("/")  # /proc/self/cwd is then / too
    keep = tmp_path / "keep.txt"
    keep.write_text("ssh-ed25519 AAAA victim\n")
    keep.chmod(0o600)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o1777)
    link = foreign_link(shared / "gpuiso.json", f"/proc/self/{via}{keep}")

    with pytest.raises(OSError, match="symbolic link of uid .*not yours: not followed"):
        files.write_text(link, "the report\n")
    with pytest.raises(SpecError, match="symbolic link of uid .*not yours: not followed"):
        files.check_output(str(link), "--gpu-isolate-report", str(tmp_path))
    monkeypatch.setenv(files.STEP_SUMMARY_ENV, str(link))
    assert "not yours: not followed" in files.append_step_summary("the summary\n")
    assert keep.read_text() == "ssh-ed25519 AAAA victim\n"
    assert stat.S_IMODE(keep.stat().st_mode) == 0o600


def test_another_users_fifo_is_refused_and_never_handed_the_report(tmp_path, monkeypatch, no_hang):
    """A FIFO planted at the path would hand the report to whoever reads it: refused at
    configure time and at the end, even while its owner is reading, without blocking."""
    fifo = tmp_path / "gpuiso.json"
    os.mkfifo(fifo, 0o622)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # its owner, waiting for the report
    try:
        _foreign(fifo, monkeypatch)
        with pytest.raises(OSError, match=f"{fifo} is a FIFO of uid .*, not yours: not written"):
            files.write_text(fifo, "the report\n")
        with pytest.raises(SpecError, match="is a FIFO of uid .*, not yours: not written"):
            files.check_output(str(fifo), "--gpu-isolate-report", str(tmp_path))
        monkeypatch.setenv(files.STEP_SUMMARY_ENV, str(fifo))
        assert "is a FIFO of uid" in files.append_step_summary("the summary\n")
        assert os.read(reader, 100) == b""  # nothing was written into it
    finally:
        os.close(reader)


def test_your_fifo_without_a_reader_is_an_error_not_a_wait(tmp_path, no_hang):
    fifo = tmp_path / "gpuiso.json"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(OSError, match=f"{fifo} is a FIFO that no process reads"):
        files.write_text(fifo, "the report\n")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)  # left as it was


def test_your_fifo_with_a_reader_is_written_into(tmp_path, no_hang):
    fifo = tmp_path / "gpuiso.json"
    os.mkfifo(fifo, 0o600)
    files.check_output(str(fifo), "--gpu-isolate-report", str(tmp_path))
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        files.write_text(fifo, "the report\n")
        assert os.read(reader, 100) == b"the report\n"
    finally:
        os.close(reader)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_a_descriptor_is_written_into_not_resolved(tmp_path):
    """``/dev/stdout``'s kind of path: a process's descriptor, here a pipe, which no path
    names; written into, whoever made the pipe."""
    read, write = os.pipe()
    try:
        path = f"/proc/self/fd/{write}"
        assert files.resolved(path) == f"/proc/{os.getpid()}/fd/{write}"
        files.check_output(path, "--gpu-isolate-report", str(tmp_path))
        files.write_text(path, "the report\n")
        assert os.read(read, 100) == b"the report\n"
    finally:
        os.close(read)
        os.close(write)
