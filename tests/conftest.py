"""Fixtures shared by the project's tests; the helpers themselves live in tests/helpers.py."""

from __future__ import annotations

import pytest

from tests.helpers import GpuIso


@pytest.fixture(params=["spawn", "forkserver"])
def gpuiso(
    request: pytest.FixtureRequest, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> GpuIso:
    """Copy programs from fixtures/programs/ into a pytester directory and run pytest on them.

    Every test that uses it runs twice, once per start method (spawn, forkserver):
    each guarantee must hold whichever way the isolated processes start.

    The runs see the same terminal everywhere: pytest stops truncating summary lines
    when it detects CI (CI, BUILD_NUMBER), and wraps at the terminal's width.
    """
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("BUILD_NUMBER", raising=False)
    monkeypatch.setenv("COLUMNS", "80")
    return GpuIso(pytester, start=request.param)
