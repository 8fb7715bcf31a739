"""Text inside a Markdown table cell, rendered literally (the reports' and compare's)."""

from __future__ import annotations

import re
from typing import Any

from ..termtext import escaped
from ..values import KINDS

_LINE_BREAK = re.compile(r"\r\n|\r|\n")  # what ends a table row in Markdown
_SPECIAL = re.compile(r"([\\`*_\[\]<>|~&])")  # what Markdown could read as markup


# GitHub refuses a pull request comment over 65,536 characters and drops a step summary
# over 1 MiB whole: a report's Markdown stays under ``LIMIT`` (``bounded``), each cell
# under ``CELL_CHARS`` (a leaked JVM's command line can be 40 kB).
LIMIT = 60_000
CELL_CHARS = 300


def cut(text: str, most: int = CELL_CHARS) -> str:
    """``text`` of at most ``most`` characters: its start, and how much was left out."""
    if len(text) <= most:
        return text
    note = f"... ({len(text) - most} more characters)"
    return text[: most - len(note)] + note


def bounded(lines: list[str], where: str, limit: int = LIMIT) -> str:
    """The Markdown of ``lines``, cut at a line so that it stays under ``limit``
    characters, with a last line saying how many lines were left out and ``where`` the
    rest is (a report is shortened, never dropped whole)."""
    text = "\n".join(lines) + "\n"
    if len(text) <= limit:
        return text
    kept, size = [], 200  # room for the note
    for line in lines:
        if size + len(line) + 1 > limit:
            break
        kept.append(line)
        size += len(line) + 1
    left = len(lines) - len(kept)
    note = f"{left} more line{'s' if left != 1 else ''} not shown (GitHub's size limits): {where}."
    return "\n".join([*kept, "", f"**{note}**"]) + "\n"


def _one_line(text: Any) -> str:
    """``text`` with its line breaks as spaces and its other unprintable characters as
    their escapes (``termtext.escaped``), cut to ``CELL_CHARS``."""
    return cut(escaped(_LINE_BREAK.sub(" ", str(text))))


def cell(text: Any) -> str:
    """Text rendered literally inside a Markdown table cell: one line, markup escaped,
    cut to ``CELL_CHARS``.

    Backslashes are doubled too, so a ``\\|`` of the text neither ends the cell nor
    loses its backslash to the table's own pipe escape.
    """
    return _SPECIAL.sub(r"\\\1", _one_line(text))


def kind_cell(kind: str) -> str:
    """A leak kind: ours hold no markup (an underscore inside a word is literal), so they
    are left as they are; anything else is escaped."""
    return kind if kind in KINDS else cell(kind)


def code_cell(text: str) -> str:
    """Text as a code span inside a table cell, rendered literally, backticks included."""
    text = _one_line(text)
    if not text:
        return ""
    if "\\|" in text:  # the table would take this backslash as its pipe escape
        return f"<code>{cell(text)}</code>"
    fence = "`" * (max((len(run) for run in re.findall("`+", text)), default=0) + 1)
    # A span that starts or ends with a backtick needs a space; a space on both sides
    # is stripped once by Markdown, so it gets one more.
    pad = " " if text[:1] == "`" or text[-1:] == "`" or text[:1] == text[-1:] == " " else ""
    escaped = text.replace("|", "\\|")  # GFM unescapes pipes in a cell, code spans included
    return f"{fence}{pad}{escaped}{pad}{fence}"
