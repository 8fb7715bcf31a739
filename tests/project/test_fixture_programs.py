"""The programs in fixtures/programs/, in folders by the feature they exercise: each name
is unique (tests name a program, ``tests.helpers.program`` finds its folder), and every
program a test copies by a literal name exists."""

from __future__ import annotations

import ast
from collections import Counter

from tests.helpers import PROGRAMS, ROOT, program


def _names_copied() -> dict[str, str]:
    """Each literal name passed to a ``copy(...)`` or ``program(...)`` call in tests/,
    with the first file that names it."""
    named: dict[str, str] = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name not in ("copy", "program", "_copy"):
                continue
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    named.setdefault(arg.value, str(path.relative_to(ROOT)))
    return named


def test_each_program_name_is_unique_across_the_feature_folders() -> None:
    entries = [p.name for folder in PROGRAMS.iterdir() if folder.is_dir() for p in folder.iterdir()]
    assert len(entries) > 100, entries
    assert [name for name, n in Counter(entries).items() if n > 1 and name != "__pycache__"] == []
    assert [p.name for p in PROGRAMS.iterdir() if not p.is_dir()] == []  # no loose programs


def test_every_program_a_test_names_exists() -> None:
    named = _names_copied()
    assert {"test_where.py", "sim_process.py", "plugin_cov_old/conftest.py"} <= set(named)
    missing = {}
    for name, where in named.items():
        try:
            program(name)
        except LookupError as exc:
            missing[name] = f"{where}: {exc}"
    assert missing == {}
