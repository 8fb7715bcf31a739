"""Fixtures of a broad scope that the session's isolated processes each set up anew.

A session-, package-, module- or class-scoped fixture runs once per isolated test, not
once per session: each test's process is fresh (docs/semantics.md, "Fixtures"). Each
record lists what its process set up (``fixtures``); ``rebuilt`` says, in one line for
the terminal summary, which of them were set up in more than one process.
"""

from __future__ import annotations

from collections import Counter

from .record import Record

SCOPES = ("session", "package", "module", "class")  # broadest first: the order named
NAMED = 5  # fixtures named in the line; the rest are counted
WHERE = 'docs/semantics.md, "Fixtures"'


def set_up(record: Record) -> set[tuple[str, str]]:
    """The (scope, name) of each broad fixture the record's process set up (a record read
    back from a file may be an older version's or a hostile one's: what is not one is
    left out)."""
    found = set()
    fixtures = record.get("fixtures")
    for fixture in fixtures if isinstance(fixtures, list) else []:
        if not isinstance(fixture, dict):
            continue
        name, scope = fixture.get("name"), fixture.get("scope")
        if isinstance(name, str) and name and scope in SCOPES:
            found.add((scope, name))
    return found


def rebuilt(records: list[Record]) -> str | None:
    """One line naming the broad fixtures set up in more than one isolated process, with
    how many (each record is one process: a rerun's attempt is another), broadest scope
    and most processes first; None when there is none. E.g. ``session-scoped fixture
    model set up in 4 isolated processes, module-scoped db in 3: each isolated test sets
    up its own (docs/semantics.md, "Fixtures")``."""
    counts = Counter(key for record in records for key in set_up(record))
    repeated = sorted(
        ((scope, name, n) for (scope, name), n in counts.items() if n > 1),
        key=lambda item: (SCOPES.index(item[0]), -item[2], item[1]),
    )
    if not repeated:
        return None
    parts = []
    for at, (scope, name, n) in enumerate(repeated[:NAMED]):
        if at == 0:
            parts.append(f"{scope}-scoped fixture {name} set up in {n} isolated processes")
        else:
            parts.append(f"{scope}-scoped {name} in {n}")
    more = len(repeated) - NAMED
    if more > 0:
        parts[-1] += f" and {more} more fixture{'s' if more > 1 else ''}"
    text = ", ".join(parts)
    return f"{text}: each isolated test sets up its own ({WHERE})"
