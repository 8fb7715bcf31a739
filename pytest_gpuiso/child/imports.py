"""Which modules a test's process imports: ahead of its turn, and what it taught the template.

**Learnt by the template** (the fork server): a test's process says which modules its
test imported while it ran (``learnable``: the outermost new ones that can be imported
by name again), and the template imports them for the tests forked after it, as pytest
run in-process keeps a module an earlier test imported (``forkserver.template``).
``torch.testing.assert_close`` imports ``torch.distributed.tensor`` on its first call,
~520 modules and ~0.85 s, which every test's process paid anew before.

**Preloaded by a spawned process**: those of the preload modules named in an import
statement of its test module or of a ``conftest.py`` above it.

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

import contextlib
import functools
import os
import re
import sys
import types
from pathlib import Path
from typing import Any

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


CACHE_KEY = "gpuiso/learnt-imports"  # in pytest's cache (.pytest_cache): what earlier runs learnt
CACHE_MAX = 1024
MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
LEARN_MAX = 256  # modules one test's process reports at most (the outermost, sorted)
_NAME_MAX = 200
_ORIGIN_MAX = 4096

Learnt = tuple[str, str]  # a module's name and where it was found (its spec's origin)


def mark() -> tuple[int, str | None]:
    """Where ``sys.modules`` ends now: its size and its last name (``learnable``'s start).

    Modules imported later are appended to it (dicts keep their insertion order), so
    only they are read then. A set of every name would write to each name's reference
    count: in a forked process that copies ~650 pages, ~1.5 ms of every test."""
    return len(sys.modules), next(reversed(sys.modules.keys()), None)


def learnable(start: tuple[int, str | None]) -> dict[str, Any]:
    """What was imported since ``start`` (``mark()``): ``names``, the modules another
    process can import by name, with where they were found: (name, origin) of a module
    object whose spec has that name (not an alias or a stand-in a test put in
    ``sys.modules``) and a file or a built-in origin; of a package and its submodules only
    the outermost new one. ``modules``: how many modules were imported in all (what
    importing ``names`` costs, roughly). Best effort: a test that removed modules from
    ``sys.modules`` may hide some."""
    size, last = start
    new = []
    for name in reversed(sys.modules.keys()):  # the newest first, until the mark
        if name == last or len(new) >= len(sys.modules) - size:
            break
        new.append(name)
    found: dict[str, str] = {}
    for name in new:
        module = sys.modules.get(name)
        spec = getattr(module, "__spec__", None)
        origin = getattr(spec, "origin", None)
        if (
            isinstance(module, types.ModuleType)
            and getattr(spec, "name", None) == name
            and is_learnt((name, origin))
            and not name.startswith("__")
        ):
            found[name] = origin  # type: ignore[assignment] - is_learnt: a str
    outer = sorted(name for name in found if not _has_parent_in(name, found))
    return {"names": [(name, found[name]) for name in outer[:LEARN_MAX]], "modules": len(new)}


def is_learnt(pair: Any) -> bool:
    """Whether ``pair`` is a (module name, origin) that may be learnt."""
    return (
        isinstance(pair, (tuple, list))
        and len(pair) == 2
        and isinstance(pair[0], str)
        and isinstance(pair[1], str)
        and len(pair[0]) <= _NAME_MAX
        and 0 < len(pair[1]) <= _ORIGIN_MAX
        and MODULE.fullmatch(pair[0]) is not None
    )


def _has_parent_in(name: str, names: Any) -> bool:
    parts = name.split(".")
    return any(".".join(parts[:i]) in names for i in range(1, len(parts)))


def remembered(cache: Any) -> tuple[Learnt, ...]:
    """The modules tests of earlier sessions imported while they ran (``learnable``), as
    pytest's cache keeps them (``remember``); none without the cache. A value that is not
    a list of (name, origin) pairs (edited by hand, another version's) is ignored, and
    replaced at the session's end."""
    if cache is None:
        return ()
    with contextlib.suppress(Exception):  # pytest's cache reads JSON; anything else: ignored
        value = cache.get(CACHE_KEY, None)
        if isinstance(value, list):
            return tuple((p[0], p[1]) for p in value[:CACHE_MAX] if is_learnt(p))
    return ()


def remember(cache: Any, learnt: dict[str, str], unfit: set[str]) -> None:
    """Keep in pytest's cache what this session's tests imported (``learnt``: name ->
    origin), then what earlier sessions kept (read again now: xdist's workers write it
    too), less the modules that left the template unfit to fork (``unfit``); the most
    recent first, up to ``CACHE_MAX``."""
    if cache is None:
        return
    earlier = remembered(cache)
    kept: dict[str, str] = {}
    for name, origin in (*learnt.items(), *earlier):
        if name not in unfit and name not in kept and is_learnt((name, origin)):
            kept[name] = origin
    pairs = [[name, origin] for name, origin in kept.items()][:CACHE_MAX]
    if pairs != [list(p) for p in earlier]:
        with contextlib.suppress(Exception):  # a read-only checkout: pytest warns itself
            cache.set(CACHE_KEY, pairs)
