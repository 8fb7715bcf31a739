"""What a test's process hands over to its /dev/shm check (``child.tracker``): the
segments it created and left registered with multiprocessing's resource tracker, said in
the shim's log (``leaks.shm_log.hand_over``), reported by the check and then deleted, as
the tracker would have deleted them, and nothing else."""

from __future__ import annotations

import os
import sys
import time
import types
import uuid
from pathlib import Path

import pytest

from pytest_gpuiso.child import tracker
from pytest_gpuiso.leaks import RunInfo
from pytest_gpuiso.leaks.shm import ShmProbe
from pytest_gpuiso.leaks.shm_log import hand_over, read_log
from pytest_gpuiso.wire.environment import CHECKED_ENV, LOG_ENV


def created(log: Path, directory: Path, name: str, size: int = 16) -> int:
    """Make ``name`` in ``directory`` and log its creation as the shim does; its inode."""
    path = directory / name
    path.write_bytes(b"x" * size)
    inode = path.stat().st_ino
    with open(log, "ab") as f:
        f.write(f"{os.getpid()} {inode} {name}\n".encode())
    return inode


def probe_for(log: Path, directory: Path, **kwargs) -> ShmProbe:
    probe = ShmProbe(directory=str(directory), **kwargs)
    probe.log = str(log)
    return probe


def run_info(started: float) -> RunInfo:
    return RunInfo(os.getpid(), started, time.time(), 1.0, frozenset({os.getpid()}))


@pytest.fixture
def where(tmp_path: Path) -> tuple[Path, Path, float]:
    directory = tmp_path / "shm"
    directory.mkdir()
    log = tmp_path / "shm.log"
    log.write_bytes(b"")
    return log, directory, time.time()


def test_a_hand_over_counts_for_the_creation_of_that_inode_only(tmp_path: Path):
    log = tmp_path / "log"
    log.write_bytes(b"7 100 seg\n7 200 other\n")
    assert hand_over(str(log), "seg", 100)
    assert hand_over(str(log), "other", 201)  # not the logged inode
    assert hand_over(str(log), "never", 300)  # not logged as created
    logged = read_log(str(log))
    assert logged["seg"].tracked and not logged["other"].tracked
    assert "never" not in logged
    with open(log, "ab") as f:  # made again after its hand-over: a new entry, not handed
        f.write(b"8 101 seg\n")
    assert not read_log(str(log))["seg"].tracked


def test_names_are_escaped_as_the_shim_escapes_them(tmp_path: Path):
    name = "a b%c\nd\x7f"
    log = tmp_path / "log"
    log.write_bytes(b"7 100 a%20b%25c%0Ad%7F\n")
    assert hand_over(str(log), name, 100)
    assert log.read_bytes().splitlines()[1] == b"tracked 100 a%20b%25c%0Ad%7F"
    assert read_log(str(log))[name].tracked


def test_a_handed_over_segment_is_reported_then_deleted(where):
    log, directory, started = where
    inode = created(log, directory, "seg", size=4096)
    created(log, directory, "kept")
    hand_over(str(log), "seg", inode)
    leaks = {
        leak.fields["path"]: leak for leak in probe_for(log, directory).check({}, run_info(started))
    }
    seg, kept = leaks[str(directory / "seg")], leaks[str(directory / "kept")]
    assert seg.fields["tracked"] is True and seg.fields["cleaned"] is True
    assert seg.detail == (
        f"segment {directory}/seg (4 KiB, created by pid {os.getpid()}) left in /dev/shm "
        "(deleted, as Python's resource tracker would)"
    )
    assert "tracked" not in kept.fields and kept.fields["cleaned"] is False
    assert sorted(p.name for p in directory.iterdir()) == ["kept"]


def test_handed_over_and_ignored_or_in_use_it_is_no_leak_and_is_deleted_still(where):
    log, directory, started = where
    for name in ("ignored-1", "in-use"):
        hand_over(str(log), name, created(log, directory, name))
    with open(directory / "in-use", "rb"):  # held by a live process: not reported
        leaks = probe_for(log, directory, ignore=("ignored-*",)).check({}, run_info(started))
    assert leaks == []
    assert list(directory.iterdir()) == []


def test_a_forged_hand_over_deletes_nothing_older_than_the_process_or_of_our_own(where):
    log, directory, _ = where
    for name in ("older", "pytest-gpuiso-leases"):
        hand_over(str(log), name, created(log, directory, name))
    lines = log.read_bytes()
    # made before the process started: not the test's, whatever its log says
    later = time.time() + 60
    probe_for(log, directory).check({}, run_info(later))
    assert sorted(p.name for p in directory.iterdir()) == ["older", "pytest-gpuiso-leases"]
    log.write_bytes(lines)  # the check has read it (and removed it)
    # our own files are never deleted for it, nor reported
    assert probe_for(log, directory).check({"older": 0}, run_info(0.0))[0].fields["tracked"]
    assert [p.name for p in directory.iterdir()] == ["pytest-gpuiso-leases"]


class FakeTracker:
    """multiprocessing's resource tracker client as ``child.tracker`` sees it."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, str]] = []

    def _send(self, cmd: str, name: str, rtype: str) -> None:
        self.sent.append((cmd, name, rtype))

    def register(self, name: str, rtype: str) -> None:
        self._send("REGISTER", name, rtype)

    def unregister(self, name: str, rtype: str) -> None:
        self._send("UNREGISTER", name, rtype)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeTracker:
    client = FakeTracker()
    module = types.ModuleType("multiprocessing.resource_tracker")
    module._resource_tracker = client  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "multiprocessing.resource_tracker", module)
    monkeypatch.setattr(tracker._Noted, "send", None)
    monkeypatch.setattr(tracker._Noted, "names", {})
    return client


@pytest.fixture
def in_shm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """A unique prefix for entries in /dev/shm, the log the check reads, and a cleanup."""
    prefix = f"gpuiso-unit-{uuid.uuid4().hex[:10]}"
    log = tmp_path / "shm.log"
    log.write_bytes(b"")
    monkeypatch.setenv(LOG_ENV, str(log))
    monkeypatch.setenv(CHECKED_ENV, str(log))
    yield prefix, log
    for path in Path("/dev/shm").glob(f"{prefix}-*"):
        path.unlink(missing_ok=True)


def test_the_process_hands_over_what_it_created_and_left_registered(fake, in_shm):
    prefix, log = in_shm
    shm = Path("/dev/shm")
    tracker.watch()
    for name in ("left", "unlinked", "attached"):
        if name != "attached":
            created(log, shm, f"{prefix}-{name}")
        else:
            (shm / f"{prefix}-{name}").write_bytes(b"")  # made by someone else
        fake.register(f"/{prefix}-{name}", "shared_memory")
    fake.unregister(f"/{prefix}-unlinked", "shared_memory")
    fake.register("/a-lock", "semaphore")
    fake.sent.clear()
    tracker.hand_over()
    assert fake.sent == [("UNREGISTER", f"/{prefix}-left", "shared_memory")]
    assert {name for name, entry in read_log(str(log)).items() if entry.tracked} == {
        f"{prefix}-left"
    }


@pytest.mark.parametrize("checked", [None, "another.log"])
def test_without_a_check_that_reads_its_log_all_stays_the_trackers(
    fake, in_shm, checked, monkeypatch
):
    prefix, log = in_shm
    if checked is None:
        monkeypatch.delenv(CHECKED_ENV)
    else:
        monkeypatch.setenv(CHECKED_ENV, checked)  # a session this one runs in checks its own
    tracker.watch()
    created(log, Path("/dev/shm"), f"{prefix}-left")
    fake.register(f"/{prefix}-left", "shared_memory")
    fake.sent.clear()
    tracker.hand_over()
    assert fake.sent == []
    assert not any(entry.tracked for entry in read_log(str(log)).values())


def test_what_was_registered_before_the_go_stays_the_trackers(fake, in_shm):
    prefix, log = in_shm
    tracker.watch()  # the template's or a first go: what is noted then is not the test's
    created(log, Path("/dev/shm"), f"{prefix}-early")
    fake.register(f"/{prefix}-early", "shared_memory")
    tracker.watch()  # the test's go
    fake.sent.clear()
    tracker.hand_over()
    assert fake.sent == []
