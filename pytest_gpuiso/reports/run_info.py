"""What run a JSON report is of: its ``session`` block (when it started and finished, how
it ended, its tests' outcomes, pytest's arguments) and the ``environment`` it ran in
(Python, pytest, the plugin, the platform, the installed versions of the packages that
change a GPU suite's behaviour, the CUDA driver and each GPU from NVML)."""

from __future__ import annotations

import importlib.metadata
import platform
import time
from collections import Counter
from typing import Any

import pytest

from .. import __version__
from .record import last_attempts

PACKAGES = ("pytest-xdist", "torch", "nvidia-ml-py")  # their versions, when installed


def iso(seconds: float) -> str:
    """``seconds`` since the epoch as ISO 8601 UTC, to the second: 2026-11-29T02:30:00Z."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def session_block(
    started: float,
    finished: float,
    exitstatus: int,
    records: list[dict[str, Any]],
    args: list[str],
    gpus: dict[str, Any] | None,
) -> dict[str, Any]:
    """The report's ``session``; ``gpus``: the CUDA driver and the GPUs NVML found
    (``NvmlReader.inventory``), None without NVML."""
    outcomes = Counter(r["outcome"] for r in last_attempts(records).values())
    return {
        "started": iso(started),
        "finished": iso(finished),
        "exitstatus": int(exitstatus),
        "outcomes": dict(sorted(outcomes.items())),
        "args": [str(arg) for arg in args],
        "environment": environment(gpus),
    }


def environment(gpus: dict[str, Any] | None = None) -> dict[str, Any]:
    found: dict[str, Any] = {
        "python": platform.python_version(),
        "pytest": pytest.__version__,
        "pytest-gpuiso": __version__,
        "platform": platform.platform(),
    }
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return {**found, **(gpus or {})}
