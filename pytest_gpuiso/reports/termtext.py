"""Text a test made (a leaked process's command line, a /dev/shm name), on one line of the
terminal that no CI runner reads as a command.

GitHub Actions' runner takes a line of a step's output as a workflow command where it
starts with ``::`` after leading blanks (``::error::``, ``::add-mask::``,
``::stop-commands::TOKEN``, which silences every later command until ``::TOKEN::``), and
where it holds ``##[`` anywhere (the older form). So a line break in a leak's detail would
let the test write such a line through pytest-gpuiso's summary, its warnings or the test's
error (docs/security.md).
"""

from __future__ import annotations

from typing import Any

V1_COMMAND = "##["  # GitHub's older command form, read anywhere in a line
V1_DEFUSED = "#\\x23["  # the same characters, '#' written as its escape


def _escape(char: str) -> str:
    return char if char.isprintable() else repr(char)[1:-1]


def inert(text: Any) -> str:
    """``text`` as one line that starts no command: each unprintable character (line
    breaks, carriage returns, other control characters, Unicode line separators, lone
    surrogates of undecodable names) as its Python escape (``\\n``, ``\\x1b``, ``\\u2028``),
    ``##[`` as ``#\\x23[``, and a ``::`` it begins with (after blanks) as ``\\x3a:``.
    Printable text, and ``::`` inside it (a node id), is left as it is."""
    text = str(text)
    if not text.isprintable():
        text = "".join(map(_escape, text))
    text = text.replace(V1_COMMAND, V1_DEFUSED)
    body = text.lstrip()
    if body.startswith("::"):
        text = text[: len(text) - len(body)] + "\\x3a" + body[1:]
    return text
