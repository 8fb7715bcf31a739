"""What run a JSON report is of: its ``session`` block (when it started and finished, how
it ended, its tests' outcomes, pytest's arguments) and the ``environment`` it ran in
(Python, pytest, the plugin, the platform, the installed versions of the packages that
change a GPU suite's behaviour, the CUDA driver and each GPU from NVML)."""

from __future__ import annotations

import importlib.metadata
import platform
import time
from collections import Counter
from typing import Any, TypedDict

import pytest

from ..values import VERSION
from .record import Record, last_attempts

PACKAGES = ("pytest-xdist", "torch", "nvidia-ml-py")  # their versions, when installed


class Session(TypedDict, total=False):
    """A report's ``session`` block (docs/json-report.md); as read back from a report
    (``session_of``), only the fields of their type, the environment's as text."""

    started: str  # ISO 8601 UTC
    finished: str
    exitstatus: int | None  # None: the session has not ended (a partial report)
    outcomes: dict[str, int]  # each test's last attempt's outcome, counted
    args: list[str]  # pytest's arguments
    environment: dict[str, Any]  # versions, platform; the CUDA driver and GPUs from NVML
    partial: bool  # its session never ended (killed): what finished before
    running: list[str]  # the tests that ran when it was written


def iso(seconds: float) -> str:
    """``seconds`` since the epoch as ISO 8601 UTC, to the second: 2026-11-29T02:30:00Z."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def session_block(
    started: float,
    finished: float,
    exitstatus: int | None,
    records: list[Record],
    args: list[str],
    gpus: dict[str, Any] | None,
    running: list[str] | None = None,
) -> Session:
    """The report's ``session``; ``gpus``: the CUDA driver and the GPUs NVML found
    (``NvmlReader.inventory``), None without NVML. ``running``: the session has not ended
    (a partial report, written after each test: ``exitstatus`` None), and these tests
    were running when it was written."""
    outcomes = Counter(r["outcome"] for r in last_attempts(records).values())
    block: Session = {
        "started": iso(started),
        "finished": iso(finished),
        "exitstatus": None if exitstatus is None else int(exitstatus),
        "outcomes": dict(sorted(outcomes.items())),
        "args": [str(arg) for arg in args],
        "environment": environment(gpus),
    }
    if running is not None:
        block.update(partial=True, running=list(running))
    return block


def environment(gpus: dict[str, Any] | None = None) -> dict[str, Any]:
    found: dict[str, Any] = {
        "python": platform.python_version(),
        "pytest": pytest.__version__,
        "pytest-gpuiso": VERSION,
        "platform": platform.platform(),
    }
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return {**found, **(gpus or {})}


def session_of(document: Any) -> Session | None:
    """A report's ``session`` as far as it has the shape this module writes (a report is
    input: each field is kept only when it is of its type), else None; a merged report's
    first shard's."""
    if not isinstance(document, dict):
        return None
    found = document.get("session")
    if not isinstance(found, dict) and isinstance(document.get("shards"), list):
        found = next((s.get("session") for s in document["shards"] if isinstance(s, dict)), None)
    if not isinstance(found, dict):
        return None
    kept = Session()
    for key in ("started", "finished"):
        if isinstance(found.get(key), str):
            kept[key] = found[key]
    if found.get("partial") is True:  # its session never ended (killed): what finished
        running = found.get("running")
        kept["partial"] = True
        kept["running"] = (
            [t for t in running if isinstance(t, str)] if isinstance(running, list) else []
        )
    env = found.get("environment")
    if isinstance(env, dict):
        kept["environment"] = {k: v for k, v in env.items() if isinstance(v, str)}
        gpus = env.get("gpus")
        if isinstance(gpus, list):
            names = [g.get("name") for g in gpus if isinstance(g, dict)]
            kept["environment"]["gpus"] = ", ".join(n for n in names if isinstance(n, str))
    return kept


MATTERS = (("gpus", "GPUs"), ("cuda_driver", "CUDA driver"), ("torch", "torch"))


def line(session: Session | None) -> str:
    """One line saying what run a report is of."""
    if session is None:
        return "unknown (a report without its session)"
    env = session.get("environment", {})
    said = [f"{name} {env[key]}" for key, name in MATTERS if env.get(key)]
    said += [f"python {env['python']}"] if env.get("python") else []
    when = session.get("started", "?")
    return f"started {when}" + (f": {', '.join(said)}" if said else "") + partial(session)


def partial(session: Session | None) -> str:
    """ "" for a report of a session that ended; else what it says of its end."""
    if session is None or not session.get("partial"):
        return ""
    running = session.get("running") or []
    during = (
        f" during {', '.join(running[:3])}" + (" ..." if running[3:] else "") if running else ""
    )
    return f" (PARTIAL: its session never ended{during}; the tests that finished before)"


def differences(base: Session | None, head: Session | None) -> list[str]:
    """What differs between the runs of two reports that can make a finding the runner's."""
    if base is None or head is None:
        return []
    old, new = base.get("environment", {}), head.get("environment", {})
    return [
        f"{name}: {old.get(key) or 'none'} in base, {new.get(key) or 'none'} in head"
        for key, name in MATTERS
        if old.get(key) != new.get(key)
    ]
