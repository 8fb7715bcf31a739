"""The house rules that can be checked mechanically (GUIDE.md, "The house we aim for"):
no import cycle inside pytest_gpuiso, counting imports inside functions and under
TYPE_CHECKING; settings.py on the bottom floor, options.py just above it; plugin.py thin
(hooks only, <= 400 lines); no module over 500 lines; the test's process (child.py) knows
nothing of the fork server; and every import of ours written outside the package (tests,
fixtures, benches, docs, code in strings) still resolves."""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.util
import re
from pathlib import Path

import pytest_gpuiso
from tests.helpers import ROOT

PACKAGE = Path(pytest_gpuiso.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    """Our modules by name: the Python files, and the C extensions (leaves)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        for path in PACKAGE.glob(f"*{suffix}"):
            found[f"pytest_gpuiso.{path.name[: -len(suffix)]}"] = path
    return found


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ours that ``name`` imports anywhere in its file."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # "from . import x" imports the submodule x when there is one, else a name
            # of the package itself (its __init__).
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names
            ]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {
        name: _imports(name, path, known) if path.suffix == ".py" else set()
        for name, path in modules.items()
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _ours(graph: dict[str, set[str]], module: str) -> set[str]:
    """What ``module`` imports of ours, the package's own ``__init__`` aside."""
    return graph[module] - {"pytest_gpuiso"}


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_graph_sees_relative_and_function_level_imports() -> None:
    graph = _graph()
    assert "pytest_gpuiso.supervisor" in graph["pytest_gpuiso.call"]  # from .supervisor import
    assert "pytest_gpuiso._lease" in graph["pytest_gpuiso.leases"]  # inside open_region()
    assert "pytest_gpuiso.leaks" in graph["pytest_gpuiso.leaks.process"]  # from . import Leak
    assert "pytest_gpuiso.frames" in graph["pytest_gpuiso.child"]  # from . import frames
    assert "pytest_gpuiso" not in graph["pytest_gpuiso.child"]  # ... which is not __init__


def test_no_import_cycle_inside_the_package() -> None:
    assert _cycles(_graph()) == []


def test_settings_is_the_bottom_floor() -> None:
    assert _ours(_graph(), "pytest_gpuiso.settings") == set()


def test_the_tests_process_knows_nothing_of_the_fork_server() -> None:
    graph = _graph()
    assert not {m for m in _ours(graph, "pytest_gpuiso.child") if ".forkserver" in m}


def test_options_come_from_settings_only() -> None:
    """The option table shows settings' defaults; it knows nothing else of ours."""
    assert _ours(_graph(), "pytest_gpuiso.options") == {"pytest_gpuiso.settings"}


def test_the_hooks_module_holds_hooks_only() -> None:
    """plugin.py hands each test to runner.py; it neither starts processes nor judges leaks."""
    graph = _graph()
    assert "pytest_gpuiso.runner" in graph["pytest_gpuiso.plugin"]
    assert (
        not {
            "pytest_gpuiso.supervisor",
            "pytest_gpuiso.results",
            "pytest_gpuiso.leaks",
            "pytest_gpuiso.prewarm",
        }
        & graph["pytest_gpuiso.plugin"]
    )


LINE_LIMIT = 500
LIMITS = {"pytest_gpuiso.plugin": 400}  # pytest's hooks, thin


def test_no_module_is_too_big_to_hold_one_role() -> None:
    over = {}
    for name, path in _modules().items():
        if path.suffix != ".py":
            continue
        lines = len(path.read_text().splitlines())
        if lines > LIMITS.get(name, LINE_LIMIT):
            over[name] = lines
    assert over == {}


_OUR_IMPORT = re.compile(
    r"\bfrom (pytest_gpuiso(?:\.\w+)*) import \(?\s*(\w+(?:\s*,\s*\w+)*)"
    r"|\bimport (pytest_gpuiso(?:\.\w+)*)"
)


def _imports_outside_the_package(root: Path) -> list[tuple[str, str, str | None]]:
    """(file, module, name) for every import of ours written in the tests, fixtures, benches
    and docs, code in strings included (conftests that pytester writes, scripts run with -c),
    which neither the linter nor a run without a GPU would catch when a module moves."""
    found = []
    files = [root / "README.md", *root.glob("*.py")]
    for folder in ("tests", "fixtures", "bench", "docs"):
        files += [p for p in (root / folder).rglob("*") if p.suffix in (".py", ".sh", ".md")]
    for path in files:
        for match in _OUR_IMPORT.finditer(path.read_text(errors="replace")):
            where = str(path.relative_to(root))
            if match.group(3):
                found.append((where, match.group(3), None))
            else:
                found += [(where, match.group(1), n.strip()) for n in match.group(2).split(",")]
    return found


def _submodule(package: object, name: str) -> bool:
    if not hasattr(package, "__path__"):
        return False
    return importlib.util.find_spec(f"{package.__name__}.{name}") is not None


def test_every_import_of_ours_outside_the_package_resolves() -> None:
    """tests/gpu (skipped without a GPU) and bench/gpu_validation.sh import names that a
    re-housing moved: each such import must still find its module and name."""
    found = _imports_outside_the_package(ROOT)
    assert len(found) > 20, found  # the scan sees them (the README's, the tests' own)
    broken = []
    for where, module, name in found:
        try:
            imported = importlib.import_module(module)
        except ImportError as exc:
            broken.append(f"{where}: {module}: {exc}")
            continue
        if name and not hasattr(imported, name) and not _submodule(imported, name):
            broken.append(f"{where}: from {module} import {name}")
    assert not broken, "\n".join(broken)
