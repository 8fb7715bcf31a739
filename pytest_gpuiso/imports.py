"""Which preload modules a test's process will import: those named in an import statement
of its test module or of a ``conftest.py`` above it.

A spawned process started ahead of its test imports the preload modules while it waits
(``prewarm``), which saves a test that imports torch the seconds of ``import torch`` after
its go; a test that never imports torch would only pay them. The files are read, not
run: a line that starts with ``import X`` or ``from X import`` names ``X`` (in a string
too: then a module is preloaded that is not needed, as before), and so does a call
``pytest.importorskip("X")``, ``importlib.import_module("X")`` or ``__import__("X")``
with the name written out. A module reached only through another module of the suite is
not seen, and is imported when the test's module is, as without a preload. Cached by
file, size and modification time.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

_IMPORT = re.compile(rb"^[ \t]*(?:import|from)[ \t]+([A-Za-z_][A-Za-z0-9_]*)", re.MULTILINE)
# pytest.importorskip("torch"), importlib.import_module("torch"), __import__("torch")
_BY_NAME = re.compile(
    rb"(?:importorskip|import_module|__import__)\(\s*[\"']([A-Za-z_][A-Za-z0-9_]*)"
)
_IMPORT_LIST = re.compile(rb"^[ \t]*import[ \t]+([^\n#;]+)", re.MULTILINE)


def needed(preload: tuple[str, ...], module: Path) -> tuple[str, ...]:
    """The modules of ``preload`` whose top-level package ``module`` or a ``conftest.py``
    in its directory or above imports."""
    if not preload:
        return ()
    names: set[str] = set(_names_in(module))
    for directory in module.parents:
        names |= _names_in(directory / "conftest.py")
    return tuple(name for name in preload if name.split(".", 1)[0] in names)


def _names_in(path: Path) -> frozenset[str]:
    try:
        st = os.stat(path)
    except OSError:
        return frozenset()
    return _scan(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4096)
def _scan(path: str, size: int, mtime: int) -> frozenset[str]:
    """The top-level names the file's import statements name (``import a.b, c`` too)."""
    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError:
        return frozenset()
    names = {m.group(1).decode() for m in _IMPORT.finditer(text)}
    names |= {m.group(1).decode() for m in _BY_NAME.finditer(text)}
    for listed in _IMPORT_LIST.finditer(text):  # import a, b.c as d
        for part in listed.group(1).split(b","):
            word = part.strip().split(b".", 1)[0].split()[:1]
            if word and re.fullmatch(rb"[A-Za-z_][A-Za-z0-9_]*", word[0]):
                names.add(word[0].decode())
    return frozenset(names)
