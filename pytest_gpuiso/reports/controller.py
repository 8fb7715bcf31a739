"""The reports' side of a session, in the process that writes them (xdist's controller,
or the one process without xdist): ``Controller`` (where the reports go, checked at
configure, not at the session's end; the records they are made of; which worker holds
which pinned GPUs) and the leak baseline, read at configure (``load_baseline``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from ..settings import Settings
from ..values import SpecError

if TYPE_CHECKING:
    from ..gpu.leases import Lease
    from .baseline import Baseline


@dataclass
class Controller:
    """The reports' side of the session, in the process that writes them (xdist's
    controller, or the one process without xdist)."""

    report_path: Path | None = None
    summary_path: Path | None = None
    code_quality_path: Path | None = None  # GitLab's Code Quality report of the findings
    records: list[dict[str, Any]] = field(default_factory=list)  # every worker's
    pinned_to: dict[str, Lease] = field(default_factory=dict)  # worker -> its pinned GPUs


CONTROLLER = pytest.StashKey[Controller]()


def make_controller(config: pytest.Config, settings: Settings) -> Controller:
    """The reports' side of the session, its paths checked now (not at its end)."""
    return Controller(
        report_path=_output_path(config, settings.report_path, settings.report_source),
        summary_path=_output_path(config, settings.summary_path, settings.summary_source),
        code_quality_path=_output_path(
            config, settings.code_quality_path, settings.code_quality_source
        ),
    )


def _output_path(config: pytest.Config, value: str | None, source: str) -> Path | None:
    """A report's path, checked now (not at the session's end) where it is written.

    Relative to the ini file's folder (the rootdir without one) when it comes from the
    ini file, to the invocation directory when from the command line, as --junitxml.
    """
    if value is None:
        return None
    from . import files

    try:
        files.check_output(value, source, str(_base(config, source)))
    except SpecError as exc:
        raise pytest.UsageError(f"gpu-isolate: {exc}") from None
    return _path_of(config, value, source)


def _base(config: pytest.Config, source: str) -> Path:
    """What a relative path is relative to: the invocation directory for the command
    line, the ini file's folder for the ini file (the rootdir without one)."""
    if source.startswith("ini "):
        return config.inipath.parent if config.inipath else config.rootpath
    return config.invocation_params.dir


def _path_of(config: pytest.Config, value: str, source: str) -> Path:
    """The path made absolute, links kept: /dev/stdout must not become
    /proc/<pid>/fd/pipe:[...]."""
    return Path(os.path.abspath(os.path.join(_base(config, source), value)))


def load_baseline(config: pytest.Config, settings: Settings) -> Baseline | None:
    """The leak baseline, read now: a file that cannot serve is the session's usage error."""
    if settings.leak_baseline is None:
        return None
    from . import baseline
    from .shards import ReportError

    path = _path_of(config, settings.leak_baseline, settings.leak_baseline_source)
    try:
        return baseline.load(str(path))
    except ReportError as exc:
        raise pytest.UsageError(f"gpu-isolate: {settings.leak_baseline_source}: {exc}") from None
