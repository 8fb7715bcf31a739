"""The /dev/shm shim preloaded from any path: ld.so splits LD_PRELOAD at spaces and colons,
so a shim installed under "My Projects" is preloaded through a link of ours; one that no
process can load is said, never trusted silently (``shm_log.preloadable``)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from pytest_gpuiso.leaks import shm_log


@pytest.fixture
def installed_at(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Put a copy of the built shim at a path of the test's choosing."""
    built = shm_log.shim_path()
    if built is None:
        pytest.skip("the shim is not built (GPUISO_NO_NATIVE)")
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    shm_log.preloadable.cache_clear()

    def install(folder: str) -> str:
        where = tmp_path / folder / Path(built).name
        where.parent.mkdir(parents=True)
        shutil.copy(built, where)
        monkeypatch.setattr(shm_log, "shim_path", lambda: str(where))
        return str(where)

    yield install
    shm_log.preloadable.cache_clear()


@pytest.mark.parametrize("folder", ["My Projects/venv", "a:b/venv"])
def test_a_shim_under_a_path_ld_so_splits_is_preloaded_through_a_link(installed_at, folder):
    shim = installed_at(folder)
    path, problem = shm_log.preloadable()
    assert problem == ""
    assert path is not None and " " not in path and ":" not in path
    assert Path(path).resolve() == Path(shim).resolve()
    env = shm_log.preload_env()
    assert env["LD_PRELOAD"].split()[-1] == path
    # a program started with it says nothing (ld.so could load it)
    done = subprocess.run(["true"], env=env, capture_output=True, text=True, timeout=30)
    assert done.stderr == ""


def test_a_shim_no_program_can_load_is_not_preloaded_and_says_why(installed_at, tmp_path):
    shim = installed_at("venv")
    Path(shim).write_bytes(b"not a library")
    path, problem = shm_log.preloadable()
    assert path is None
    assert "ld.so" in problem or "cannot" in problem, problem
    assert shm_log.preload_env() == {}


def test_a_shim_under_a_plain_path_is_preloaded_as_it_is(installed_at):
    shim = installed_at("venv")
    assert shm_log.preloadable() == (shim, "")
