"""Private per-process directories for spill files, child output and stack dumps.

Layout: ``$TMPDIR/pytest-gpuiso-<uid>/<pid>-<start time>/``, the parent 0700 and
owned by us. A directory whose process is gone (a crashed earlier session) is
removed by the next session that starts.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import stat
import tempfile
from pathlib import Path

import psutil

_mine: dict[int, Path] = {}


def root() -> Path:
    base = Path(tempfile.gettempdir()) / f"pytest-gpuiso-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        base.mkdir(mode=0o700)
    st = os.lstat(base)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise RuntimeError(
            f"gpu-isolate: {base} is not a private directory owned by uid {os.getuid()}; remove it"
        )
    return base


def _tag(pid: int) -> str:
    return f"{pid}-{int(psutil.Process(pid).create_time() * 1000)}"


def process_dir() -> Path:
    """This process's own directory, created on first use and removed at exit."""
    pid = os.getpid()
    path = _mine.get(pid)
    if path is None:
        path = root() / _tag(pid)
        path.mkdir(mode=0o700, exist_ok=True)
        _mine[pid] = path
        atexit.register(remove_process_dir)
    return path


def remove_process_dir() -> None:
    path = _mine.pop(os.getpid(), None)
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def clean_stale() -> list[Path]:
    """Remove directories left by processes that no longer exist; return them."""
    removed = []
    try:
        entries = list(root().iterdir())
    except OSError:
        return removed
    for entry in entries:
        pid_text, _, _ = entry.name.partition("-")
        if not pid_text.isdigit() or not entry.is_dir():
            continue
        pid = int(pid_text)
        try:
            alive = _tag(pid) == entry.name
        except psutil.Error:
            alive = False
        if not alive:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def private_file(directory: Path, name: str) -> Path:
    """Create an empty file only we can read (0600); it must not exist yet."""
    path = directory / name
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    return path


def remove(*paths: Path | None) -> None:
    """Delete files that may already be gone."""
    for path in paths:
        if path is not None:
            with contextlib.suppress(OSError):
                path.unlink()


def read_end(path: Path, keep: int) -> tuple[str, int]:
    """The last ``keep`` bytes of a file as text, from a line's start when cut, and its size.

    ``("", 0)`` when it cannot be read.
    """
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - keep))
            data = f.read()
    except OSError:
        return "", 0
    text = data.decode("utf-8", "replace")
    if size > keep:
        text = text.split("\n", 1)[-1]  # the first line is probably cut
    return text, size
