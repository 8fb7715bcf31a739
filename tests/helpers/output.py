"""Comparing what pytest printed, isolated and in-process."""

from __future__ import annotations

import re

import pytest

_DURATION = re.compile(r" in \d+(\.\d+)?s( \([^)]*\))? (=+)$")


def normalized(result: pytest.RunResult) -> list[str]:
    """The terminal output minus what legitimately differs: gpu-isolate lines,
    the junitxml path, and the session duration (and the width it takes)."""
    lines = []
    for line in result.outlines:
        if "gpu-isolate" in line or "generated xml file" in line:
            continue
        if _DURATION.search(line):
            line = _DURATION.sub("", line).strip("= ")
        lines.append(line)
    return lines


class Terminal:
    """A stand-in for pytest's terminal reporter: the lines and section titles written."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def write_sep(self, sep: str, title: str) -> None:
        self.lines.append(title)

    def write_line(self, line: str, **markup: bool) -> None:
        self.lines.append(line)
