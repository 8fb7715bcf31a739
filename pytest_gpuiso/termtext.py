"""Text a test made (a leaked process's command line, a /dev/shm name), on one line of the
terminal that no CI runner reads as a command.

GitHub Actions' runner takes a line of a step's output as a workflow command where it
starts with ``::`` after leading blanks (``::error::``, ``::add-mask::``,
``::stop-commands::TOKEN``, which silences every later command until ``::TOKEN::``), and
where it holds ``##[`` anywhere (the older form). So a line break in a leak's detail would
let the test write such a line through pytest-gpuiso's summary, its warnings or the test's
error (docs/security.md). Everything a test's process, another session or a report file
controls reaches the terminal through ``inert``, and Markdown cells and workflow commands
(which escape line breaks their own way) through ``escaped``: no raw escape sequence, no
lone surrogate that no output can encode.
"""

from __future__ import annotations

from typing import Any

V1_COMMAND = "##["  # GitHub's older command form, read anywhere in a line
V1_DEFUSED = "#\\x23["  # the same characters, '#' written as its escape


def _escape(char: str) -> str:
    return repr(char)[1:-1]


def escaped(text: Any, keep: str = "") -> str:
    """``text`` with each unprintable character but those in ``keep`` (control characters,
    Unicode line separators, lone surrogates of undecodable names) as its Python escape
    (``\\x1b``, ``\\u2028``, ``\\udcff``): text every output can encode, in which no
    terminal escape sequence acts."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in keep else _escape(c) for c in text)


def inert(text: Any) -> str:
    """``text`` as one line that starts no command: each unprintable character (line
    breaks, carriage returns, other control characters, Unicode line separators, lone
    surrogates of undecodable names) as its Python escape (``\\n``, ``\\x1b``, ``\\u2028``),
    ``##[`` as ``#\\x23[``, and a ``::`` it begins with (after blanks) as ``\\x3a:``.
    Printable text, and ``::`` inside it (a node id), is left as it is."""
    text = escaped(text).replace(V1_COMMAND, V1_DEFUSED)
    body = text.lstrip()
    if body.startswith("::"):
        text = text[: len(text) - len(body)] + "\\x3a" + body[1:]
    return text
