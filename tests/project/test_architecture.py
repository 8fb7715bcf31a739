"""The house rules that can be checked mechanically (GUIDE.md, "The house we aim for"):
no import cycle inside pytest_gpuiso, counting imports inside functions and under
TYPE_CHECKING; values.py (the parsers) on the bottom floor, options.py (the option table)
just above it, settings.py above both; plugin.py thin
(hooks only); no module over 400 lines; the folder rules (which role
folder may import which) and each folder's docstring; every import of ours written
outside the package (tests, fixtures, benches, docs, code in strings) still resolves;
and one fact, one place: the settings built by one loop over the option table, names of
the outside world spelled in one module each, private pytest APIs in _compat.py only."""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.util
import re
from pathlib import Path

import pytest

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
    call = graph["pytest_gpuiso.parent.call"]
    assert "pytest_gpuiso.parent.supervisor" in call  # from .supervisor import
    assert "pytest_gpuiso._lease" in graph["pytest_gpuiso.gpu.leases"]  # inside open_region()
    assert "pytest_gpuiso.leaks" in graph["pytest_gpuiso.leaks.process"]  # from . import Leak
    bootstrap = graph["pytest_gpuiso.child.bootstrap"]
    assert "pytest_gpuiso.child.cuda_state" in bootstrap  # from . import cuda_state
    assert "pytest_gpuiso.child" not in bootstrap  # ... which is not __init__
    assert "pytest_gpuiso.wire.frames" in bootstrap  # from ..wire import frames


def test_no_import_cycle_inside_the_package() -> None:
    assert _cycles(_graph()) == []


def test_values_is_the_bottom_floor() -> None:
    graph = _graph()
    assert _ours(graph, "pytest_gpuiso.values") == set()
    assert _ours(graph, "pytest_gpuiso.settings") == {
        "pytest_gpuiso.values",
        "pytest_gpuiso.options",
        "pytest_gpuiso.wire.environment",
    }


# Folder rules (GUIDE.md, "The house"): folder -> the folders of ours it never imports.
# "face" is what pytest and users meet (the package's __init__, the hooks, the header, the
# recorder, the command line): no folder imports it. "top" is the rest of the top level,
# the floor every folder stands on (the values, the option table, the settings, _compat,
# the warning categories, the terminal's text).
FOLDERS = ("parent", "child", "forkserver", "wire", "gpu", "leaks", "reports", "proc", "adapters")
FACE = {
    "pytest_gpuiso",
    "pytest_gpuiso.plugin",
    "pytest_gpuiso.header",
    "pytest_gpuiso.recorder",
    "pytest_gpuiso.__main__",
}
NEVER = {
    "wire": {"parent", "child", "forkserver", "gpu", "leaks", "reports", "adapters", "top"},
    "proc": {"parent", "child", "forkserver", "gpu", "leaks", "reports", "adapters", "top"},
    "child": {"parent", "forkserver", "gpu", "reports", "adapters"},
    "forkserver": {"parent", "gpu", "reports", "adapters"},
    "reports": {"parent", "child", "forkserver", "adapters"},
    "gpu": {"parent", "child", "forkserver", "leaks", "reports", "adapters"},
    "leaks": {"parent", "child", "forkserver", "reports", "adapters"},
    "adapters": {"parent", "child", "forkserver", "gpu", "leaks", "reports", "proc"},
    "parent": {"adapters"},
}


def _folder(module: str) -> str:
    if module in FACE:
        return "face"
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in FOLDERS) else "top"


def _crossings(graph: dict[str, set[str]], leaves: frozenset[str] = frozenset()) -> list[str]:
    """Imports that break a folder rule (a folder importing the face breaks one too);
    ``leaves`` (the C extensions) may be imported from anywhere."""
    return sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        if target not in leaves
        and _folder(module) in FOLDERS
        and (_folder(target) == "face" or _folder(target) in NEVER.get(_folder(module), ()))
    )


def _folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Which folders (the face and the floor as two more) import which."""
    folders: dict[str, set[str]] = {}
    for module, targets in graph.items():
        mine = folders.setdefault(_folder(module), set())
        mine.update(_folder(t) for t in targets if _folder(t) != _folder(module))
    for targets in list(folders.values()):
        for target in targets:
            folders.setdefault(target, set())
    return folders


def test_each_folder_imports_only_what_its_role_may() -> None:
    """wire/ and proc/ import nothing of ours above them; the test's process (child/)
    knows nothing of pytest's side, the fork server, GPUs or reports; the fork server
    nothing of pytest's side, GPUs or reports; reports/ nothing of the processes; gpu/ and
    leaks/ nothing of the processes' sides (and gpu/ not the leaks); adapters/ only the
    floor and the wire; no folder the face."""
    native = frozenset(name for name, path in _modules().items() if path.suffix != ".py")
    assert _crossings(_graph(), native) == []
    planted = {
        "pytest_gpuiso.child.relay": {"pytest_gpuiso.parent.runner"},
        "pytest_gpuiso.wire.frames": {"pytest_gpuiso._compat", "pytest_gpuiso._lease"},
        "pytest_gpuiso.reports.run_info": {"pytest_gpuiso", "pytest_gpuiso.values"},
        "pytest_gpuiso.forkserver.server": {"pytest_gpuiso.gpu.leases"},
    }
    assert _crossings(planted, frozenset({"pytest_gpuiso._lease"})) == [
        "pytest_gpuiso.child.relay -> pytest_gpuiso.parent.runner",
        "pytest_gpuiso.forkserver.server -> pytest_gpuiso.gpu.leases",
        "pytest_gpuiso.reports.run_info -> pytest_gpuiso",
        "pytest_gpuiso.wire.frames -> pytest_gpuiso._compat",
    ]


def test_the_folders_import_each_other_without_a_loop() -> None:
    """Folders stand on floors: no two import each other, even through others (the face
    on top, the floor below the folders that read the configuration, wire/ and proc/ at
    the bottom)."""
    assert _cycles(_folder_graph(_graph())) == []
    looped = {
        "pytest_gpuiso.gpu.health": {"pytest_gpuiso.leaks"},
        "pytest_gpuiso.leaks": {"pytest_gpuiso.gpu.nvml"},
    }
    assert _cycles(_folder_graph(looped)) == [["gpu", "leaks"]]


def test_each_folders_docstring_names_every_module_in_it() -> None:
    """A folder's door says what is inside: each module's name appears in its docstring."""
    unnamed = {}
    for folder in FOLDERS:
        doc = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text())) or ""
        modules = sorted(p.stem for p in (PACKAGE / folder).glob("*.py") if p.stem != "__init__")
        missing = [m for m in modules if not re.search(rf"\b{re.escape(m)}\b", doc)]
        if missing:
            unnamed[folder] = missing
    assert unnamed == {}


def test_the_package_shows_its_roles() -> None:
    """At most 15 modules at the top; each role folder says, in its docstring, which
    process runs it and what it owns."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 15, top
    for folder in FOLDERS:
        init = PACKAGE / folder / "__init__.py"
        assert init.is_file(), folder
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(doc.split()) >= 20, f"{folder}/__init__.py: its docstring says too little"


def test_options_come_from_values_only() -> None:
    """The option table names the parsers of values.py and nothing else of ours (so that
    settings.py, which builds Settings from it, sits above both)."""
    assert _ours(_graph(), "pytest_gpuiso.options") == {"pytest_gpuiso.values"}


def test_the_hooks_module_holds_hooks_only() -> None:
    """plugin.py hands each test to runner.py; it neither starts processes nor judges leaks."""
    graph = _graph()
    assert "pytest_gpuiso.parent.runner" in graph["pytest_gpuiso.plugin"]
    assert (
        not {
            "pytest_gpuiso.parent.launcher",
            "pytest_gpuiso.parent.supervisor",
            "pytest_gpuiso.parent.results",
            "pytest_gpuiso.leaks",
            "pytest_gpuiso.parent.prewarm",
        }
        & graph["pytest_gpuiso.plugin"]
    )


LINE_LIMIT = 400  # GUIDE.md: a module holds one role; past 400 lines it holds two
LIMITS = {
    "pytest_gpuiso.plugin": 320,  # pytest's hooks, thin
    # the table of every option and ini key: one role however many rows (~10 lines each)
    "pytest_gpuiso.options": 440,
}


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
    files = [root / "README.md", root / ".ci" / "run", root / "tox.ini", *root.glob("*.py")]
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


# --------------------------------------------------------------------------- one fact, one place


def _trees() -> dict[str, ast.Module]:
    return {
        name: ast.parse(path.read_text(), str(path))
        for name, path in _modules().items()
        if path.suffix == ".py"
    }


def _literal_homes(trees: dict[str, ast.Module], text: str) -> set[str]:
    """The modules where ``text`` is written as a whole string literal."""
    return {
        name
        for name, tree in trees.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value == text
    }


def test_each_name_of_the_outside_world_is_written_once() -> None:
    """Our plugins' registered names, GitHub's summary variable and pytest-timeout's: one
    module each spells them (a second spelling drifts: the rerunfailures adapter once had
    its own copy of the child plugin's name)."""
    trees = _trees()
    assert _literal_homes({"m": ast.parse("x = 'a'\ny = f'{x}a'\nz = 'a'")}, "a") == {"m"}
    homes = {
        text: _literal_homes(trees, text)
        for text in ("gpuiso-child", "gpuiso-forkserver", "GITHUB_STEP_SUMMARY", "PYTEST_TIMEOUT")
    }
    assert homes == {
        "gpuiso-child": {"pytest_gpuiso.wire.plugin_names"},
        "gpuiso-forkserver": {"pytest_gpuiso.wire.plugin_names"},
        "GITHUB_STEP_SUMMARY": {"pytest_gpuiso.reports.files"},
        "PYTEST_TIMEOUT": {"pytest_gpuiso.settings"},  # pytest-timeout's value: one rule
    }


def _reads_of_our_options(tree: ast.Module) -> list[str]:
    """``getoption``/``getini``/``getvalue`` calls naming one of our options by a literal."""
    return [
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("getoption", "getini", "getvalue")
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and str(node.args[0].value).startswith("gpu_isolate")
    ]


def test_settings_are_built_by_one_loop_over_the_option_table() -> None:
    """Every Settings field is filled by exactly one row of OPTIONS (its value, or where
    it came from), or is one of the few derived in the loop's post-step; Settings is made
    in one place; no module reads one of our options by name (a second parse of it)."""
    import dataclasses

    from pytest_gpuiso import options
    from pytest_gpuiso.settings import Settings

    filled: list[str] = list(options.DERIVED)
    for option in options.OPTIONS:
        filled += [option.field] if isinstance(option.field, str) else list(option.field)
        filled += [option.source] if option.source else []
    assert sorted(filled) == sorted(field.name for field in dataclasses.fields(Settings))

    trees = _trees()
    makers = {
        name
        for name, tree in trees.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Settings"
    }
    assert makers == {"pytest_gpuiso.settings"}
    sample = ast.parse("config.getoption('gpu_isolate_cleanup')\nconfig.getini(option.name)")
    assert _reads_of_our_options(sample) == ["gpu_isolate_cleanup"]
    reads = {name: _reads_of_our_options(tree) for name, tree in trees.items()}
    assert {name: found for name, found in reads.items() if found} == {}


# Objects of pytest's that code names (a variable or an attribute of that name).
_PYTEST_OBJECTS = {
    "config",
    "early_config",
    "item",
    "session",
    "request",
    "node",
    "parser",
    "pluginmanager",
    "report",
    "rep",
    "terminalreporter",
    "excinfo",
}
# Private names on pytest's objects that belong to other plugins (what their adapters are
# for), and the plugin each belongs to. Not pytest's upgrade surface, so not in _compat.
_OTHER_PLUGINS = {
    "_benchmarksession": "pytest-benchmark",
    "_syrupy": "syrupy",
    "_assertions": "syrupy (its SnapshotSession, named session)",
    "_written_snapshot_locations": "syrupy (its SnapshotSession)",
    "_terminal_errors": "pytest-rerunfailures",
    "_test_xfailed": "pytest-rerunfailures",
    "_rerun_condition_excinfos": "pytest-rerunfailures",
}
_UNDOCUMENTED = {"known_args_namespace"}  # pytest's, without an underscore


def _private_pytest_uses(tree: ast.Module) -> list[str]:
    """Imports of ``_pytest`` and private attributes of pytest's objects in ``tree``."""

    def named(node: ast.AST) -> str | None:
        return getattr(node, "id", None) or getattr(node, "attr", None)

    def private(attr: str) -> bool:
        if attr in _UNDOCUMENTED:
            return True
        return attr.startswith("_") and not attr.startswith("__") and attr not in _OTHER_PLUGINS

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "_pytest"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "_pytest":
            found.append(node.module)
        elif isinstance(node, ast.Attribute) and private(node.attr):
            if named(node.value) in _PYTEST_OBJECTS or node.attr in _UNDOCUMENTED:
                found.append(f"{named(node.value)}.{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) >= 2
            and named(node.args[0]) in _PYTEST_OBJECTS
            and isinstance(node.args[1], ast.Constant)
            and private(str(node.args[1].value))
        ):
            found.append(f"{named(node.args[0])}.{node.args[1].value}")
    return found


def test_private_pytest_apis_are_used_in_compat_only() -> None:
    """GUIDE: private pytest APIs in one place (``_compat.py``, with the versions they were
    checked on), so that the upgrade surface is visible."""
    sample = ast.parse(
        "import _pytest.capture\nfrom _pytest.runner import runtestprotocol\n"
        "getattr(config, '_tmp_path_factory', None)\nitem.config._inicache\n"
        "early_config.known_args_namespace\nconfig._syrupy\nconfig.__class__\nself._x\n"
    )
    assert _private_pytest_uses(sample) == [
        "_pytest.capture",
        "_pytest.runner",
        "config._tmp_path_factory",
        "config._inicache",
        "early_config.known_args_namespace",
    ]
    found = {
        name: uses
        for name, tree in _trees().items()
        if name != "pytest_gpuiso._compat" and (uses := _private_pytest_uses(tree))
    }
    assert found == {}


# ----------------------------------------------------------------- one test's run, parent side
# runner.protocol -> run_item -> launcher (start / take prewarmed) -> supervisor.go ->
# prewarm -> wait: each entered downward, none calls back up (GUIDE.md, "The next shape").

LIFECYCLE = ("launcher", "supervisor", "prewarm", "watch")


def _tree(module: str) -> ast.Module:
    path = _modules()[f"pytest_gpuiso.parent.{module}"]
    return ast.parse(path.read_text(), str(path))


def test_the_floors_of_one_run_call_only_downward() -> None:
    """The launcher knows nothing of the supervisor, prewarming or the runner; the
    supervisor and the prewarmer know nothing of each other or the runner."""
    graph = _graph()
    above = {
        "launcher": {"supervisor", "prewarm", "runner", "session", "jobs"},
        "supervisor": {"prewarm", "runner", "session", "jobs"},
        "prewarm": {"supervisor", "runner", "session", "jobs"},
        "watch": {"launcher", "supervisor", "prewarm", "runner", "session", "jobs"},
    }
    climbs = {
        module: sorted(
            graph[f"pytest_gpuiso.parent.{module}"] & {f"pytest_gpuiso.parent.{m}" for m in up}
        )
        for module, up in above.items()
    }
    assert climbs == {module: [] for module in above}


def _callable_parameters(tree: ast.Module) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
                if arg.annotation is not None and "Callable" in ast.unparse(arg.annotation):
                    found.append(f"{node.name}({arg.arg})")
    return found


def test_no_callback_is_handed_down_the_floors_of_one_run() -> None:
    """No function of the launcher, supervisor, prewarmer or watch takes a callable: control
    never goes down and back up (the old ``after_go``, ``prepare`` and ``leave``)."""
    found = {m: _callable_parameters(_tree(m)) for m in LIFECYCLE}
    assert found == {m: [] for m in LIFECYCLE}
    planted = ast.parse("def go(after: Callable[[], None] | None = None) -> None: ...")
    assert _callable_parameters(planted) == ["go(after)"]  # the check sees one


_MUTATORS = {"append", "extend", "pop", "popleft", "clear", "update", "add", "remove", "discard"}


def _launcher_writes(tree: ast.Module) -> list[str]:
    """Writes to a launcher's attributes: ``<...>launcher.x = ...``, ``+=``, ``del``, and
    mutating calls on one of them (``launcher.notices.append(...)``)."""

    def is_launcher(node: ast.AST) -> bool:
        name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
        return name.lower().endswith("launcher")

    found = []
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            mutates = node.func.attr in _MUTATORS and isinstance(owner, ast.Attribute)
            if mutates and is_launcher(owner.value):
                found.append(ast.unparse(node.func))
        for target in targets:
            for part in target.elts if isinstance(target, ast.Tuple) else [target]:
                while isinstance(part, ast.Subscript):  # launcher.live[key] = ...
                    part = part.value
                if isinstance(part, ast.Attribute) and is_launcher(part.value):
                    found.append(ast.unparse(part))
    return found


def test_the_launchers_state_is_written_only_by_the_launcher() -> None:
    writes = {}
    for name, path in _modules().items():
        if path.suffix != ".py" or name == "pytest_gpuiso.parent.launcher":
            continue
        found = _launcher_writes(ast.parse(path.read_text(), str(path)))
        if found:
            writes[name] = found
    assert writes == {}
    planted = ast.parse(
        "state.launcher.method = 'spawn'\nlauncher.notices.append('x')\n"
        "self.launcher.live[1] = s\nlauncher.notice('fine')"
    )
    assert sorted(_launcher_writes(planted)) == [
        "launcher.notices.append",
        "self.launcher.live",
        "state.launcher.method",
    ]


# Where a frame kind may be named: the wire itself, the one dispatcher, the watch (the
# marks that end its bounds) and the senders, as what they send.
_WATCHED_KINDS = {"BEGIN", "END", "EXITING", "READY"}


def _kind_uses(tree: ast.Module, kinds: frozenset[str]) -> list[tuple[str, bool]]:
    """(kind, sent) for each ``frames.KIND`` named: ``sent`` when it is an argument of a
    call to a ``send``/``send_frame`` function."""
    sent_nodes = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("send", "send_frame"):
                sent_nodes.update(id(arg) for arg in node.args)
    return [
        (node.attr, id(node) in sent_nodes)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "frames"
        and node.attr in kinds
    ]


def test_frames_are_decoded_by_one_dispatcher() -> None:
    """Every kind of the vocabulary has its handler in ``Outcome.decode``, an unknown kind
    is an error, and no other module of pytest's side reads frame kinds (senders name
    them only as what they send; the watch and the group's wait only the marks of the
    bounds)."""
    from pytest_gpuiso.parent import outcome
    from pytest_gpuiso.wire import frames

    constants = {n: getattr(frames, n) for n in dir(frames) if n.isupper()}
    names = frozenset(n for n, v in constants.items() if isinstance(v, str) and v in frames.KINDS)
    assert len(names) == len(frames.KINDS)
    assert set(outcome._HANDLERS) == frames.KINDS
    with pytest.raises(frames.FrameError, match="unknown frame kind 'gossip'"):
        outcome.Outcome(outcome.End(1, 0, None, 0.0)).decode([("gossip", 1)])
    readers = {}
    for name, path in _modules().items():
        if path.suffix != ".py" or name in (
            "pytest_gpuiso.wire.frames",
            "pytest_gpuiso.parent.outcome",
        ):
            continue
        uses = _kind_uses(ast.parse(path.read_text(), str(path)), names)
        watching = ("pytest_gpuiso.parent.watch", "pytest_gpuiso.parent.group")
        allowed = _WATCHED_KINDS if name in watching else set()
        read = sorted({kind for kind, sent in uses if not sent and kind not in allowed})
        if read:
            readers[name] = read
    assert readers == {}
    planted = ast.parse("if kind == frames.REPORT: pass\nchannel.send(frames.DONE, 0)")
    assert _kind_uses(planted, names) == [("REPORT", False), ("DONE", True)]


# The sizes the roles of one run come to (the targets, with room to grow): a
# module kept under its limit by moving code out is the smell this guards against.
ROLE_LIMITS = {"runner": 400, "supervisor": 260, "launcher": 400, "prewarm": 160}


def test_the_roles_of_one_run_stay_their_size() -> None:
    modules = _modules()
    sizes = {
        m: len(modules[f"pytest_gpuiso.parent.{m}"].read_text().splitlines()) for m in ROLE_LIMITS
    }
    assert {m: n for m, n in sizes.items() if n > ROLE_LIMITS[m]} == {}


def _test_imports(source: str) -> list[str]:
    """The test modules ``source`` imports (``tests.test_x``, ``tests.gpu.test_y``, ``.test_z``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ("." * node.level) + (node.module or "")
            dot = "" if base.endswith(".") else "."
            names = [base] + [f"{base}{dot}{alias.name}" for alias in node.names]
        found += [n for n in names if n.rpartition(".")[2].startswith("test_")]
    return found


def test_no_test_module_imports_another() -> None:
    """Shared code lives in tests/helpers/, shared fixtures in a conftest.py."""
    imports = {
        str(path.relative_to(ROOT)): found
        for path in sorted((ROOT / "tests").rglob("*.py"))
        if (found := _test_imports(path.read_text()))
    }
    assert imports == {}
    planted = "from tests.test_lease_table import wait_until\nfrom . import test_units"
    assert _test_imports(planted) == ["tests.test_lease_table", ".test_units"]
