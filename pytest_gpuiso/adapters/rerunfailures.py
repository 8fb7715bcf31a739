"""pytest-rerunfailures and isolated tests (being written: docs/plugins-design.md)."""

from __future__ import annotations

from typing import Any


def register(pluginmanager: Any) -> None:
    """Nothing yet."""
