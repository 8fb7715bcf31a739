"""Text inside a Markdown table cell, rendered literally (the reports' and compare's)."""

from __future__ import annotations

import re
from typing import Any

from ..values import KINDS

_LINE_BREAK = re.compile(r"\r\n|\r|\n")  # what ends a table row in Markdown
_SPECIAL = re.compile(r"([\\`*_\[\]<>|~&])")  # what Markdown could read as markup


def cell(text: Any) -> str:
    """Text rendered literally inside a Markdown table cell: one line, markup escaped.

    Backslashes are doubled too, so a ``\\|`` of the text neither ends the cell nor
    loses its backslash to the table's own pipe escape.
    """
    return _SPECIAL.sub(r"\\\1", _LINE_BREAK.sub(" ", str(text)))


def kind_cell(kind: str) -> str:
    """A leak kind: ours hold no markup (an underscore inside a word is literal), so they
    are left as they are; anything else is escaped."""
    return kind if kind in KINDS else cell(kind)


def code_cell(text: str) -> str:
    """Text as a code span inside a table cell, rendered literally, backticks included."""
    text = _LINE_BREAK.sub(" ", text)
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
