"""Fixtures shared by the project's tests; the helpers themselves live in tests/helpers.py."""

from __future__ import annotations

import pytest

from tests.helpers import GpuIso


@pytest.fixture
def gpuiso(pytester: pytest.Pytester) -> GpuIso:
    """Copy programs from fixtures/programs/ into a pytester directory and run pytest on them."""
    return GpuIso(pytester)
