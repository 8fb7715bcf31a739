"""``native.missing()``: whether isolation can work here (Linux, the C extensions installed),
else the header's reason. The wheel built without them: tests/project/test_packaging.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pytest_gpuiso import native


def _find_spec_without(*absent: str):
    """A ``find_spec`` that finds every module but ``absent`` (and only looks)."""
    looked: list[str] = []

    def find_spec(name: str):
        looked.append(name)
        return None if name in absent else object()

    find_spec.looked = looked
    return find_spec


@pytest.fixture
def linux(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.delenv(native.NO_NATIVE_ENV, raising=False)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the extensions are Linux's")
def test_here_isolation_can_work():
    """The suite runs where the extensions are built; ``_shmtrace`` is found too, though
    it is an LD_PRELOAD library and not a module Python imports."""
    assert native.missing() is None


@pytest.mark.parametrize("platform", ["darwin", "win32", "freebsd14", "cygwin"])
def test_not_linux(monkeypatch: pytest.MonkeyPatch, platform: str):
    monkeypatch.setattr(sys, "platform", platform)
    find_spec = _find_spec_without()
    monkeypatch.setattr(native, "find_spec", find_spec)
    expected = f"isolation needs Linux (this is {platform}); every test runs in-process"
    assert native.missing() == expected
    assert find_spec.looked == []  # whatever is installed: not on Linux, not looked for


def test_linux_with_every_extension(monkeypatch: pytest.MonkeyPatch, linux: None):
    find_spec = _find_spec_without()
    monkeypatch.setattr(native, "find_spec", find_spec)
    assert native.missing() is None
    assert find_spec.looked == list(native.EXTENSIONS)


def test_linux_built_without_the_extensions(monkeypatch: pytest.MonkeyPatch, linux: None):
    """GPUISO_NO_NATIVE at build time is how a Linux build has none; the text says so
    whether or not it is set now."""
    monkeypatch.setattr(native, "find_spec", _find_spec_without(*native.EXTENSIONS))
    expected = "built without its C extensions (GPUISO_NO_NATIVE); every test runs in-process"
    assert native.missing() == expected
    monkeypatch.setenv(native.NO_NATIVE_ENV, "1")
    assert native.missing() == expected


def test_linux_with_some_extensions_missing(monkeypatch: pytest.MonkeyPatch, linux: None):
    monkeypatch.setattr(native, "find_spec", _find_spec_without("pytest_gpuiso._shmtrace"))
    assert native.missing() == (
        "its C extensions are incomplete (no _shmtrace): reinstall pytest-gpuiso; "
        "every test runs in-process"
    )
    monkeypatch.setattr(
        native, "find_spec", _find_spec_without("pytest_gpuiso._fork", "pytest_gpuiso._lease")
    )
    assert native.missing() == (
        "its C extensions are incomplete (no _fork, _lease): reinstall pytest-gpuiso; "
        "every test runs in-process"
    )


@pytest.mark.parametrize("value", ["1", "0", ""])
def test_the_variable_is_for_the_build_only(
    monkeypatch: pytest.MonkeyPatch, linux: None, value: str
):
    """Set while pytest runs, GPUISO_NO_NATIVE turns nothing off: what is installed decides."""
    monkeypatch.setenv(native.NO_NATIVE_ENV, value)
    monkeypatch.setattr(native, "find_spec", _find_spec_without())
    assert native.missing() is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the extensions are Linux's")
def test_it_looks_without_importing(tmp_path: Path):
    """Asking costs no import of an extension (``_shmtrace`` must never be imported).

    Run in ``tmp_path``: "-c" puts the cwd first on sys.path, where a checkout's
    ``pytest_gpuiso/`` (an sdist's has no extensions) would shadow the installed package."""
    code = (
        "import sys\n"
        "from pytest_gpuiso import native\n"
        "before = set(sys.modules)\n"
        "assert native.missing() is None\n"
        "print(sorted(set(native.EXTENSIONS) & (set(sys.modules) - before)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert result.stdout.strip() == "[]"


def test_run_isolated_says_why_it_cannot_run_here(monkeypatch: pytest.MonkeyPatch):
    """Where isolation cannot work, run_isolated is one clear error, not an ImportError of
    a missing extension."""
    from pytest_gpuiso import IsolationError, run_isolated

    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(IsolationError) as raised:
        run_isolated(len, "abc")
    assert str(raised.value) == "run_isolated(len): isolation needs Linux (this is darwin)"
