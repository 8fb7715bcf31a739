"""Fixtures shared by the project's tests; the helpers themselves live in tests/helpers.py."""

from __future__ import annotations

import pytest

from tests.helpers import GpuIso, make_gpuiso


@pytest.fixture(params=["spawn", "forkserver"])
def gpuiso(
    request: pytest.FixtureRequest, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> GpuIso:
    """Copy programs from fixtures/programs/ into a pytester directory and run pytest on them.

    Every test that uses it runs twice, once per start method (spawn, forkserver):
    each guarantee must hold whichever way the isolated processes start.
    """
    return make_gpuiso(pytester, monkeypatch, request.param)


@pytest.fixture
def gpuiso_settings(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> GpuIso:
    """``gpuiso`` with spawn only: for checks of options, ini keys and the header, which
    are read before any isolated process starts and so do not depend on how it starts."""
    return make_gpuiso(pytester, monkeypatch, "spawn")
