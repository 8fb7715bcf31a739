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
