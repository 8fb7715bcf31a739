"""The documentation as a fresh clone carries it: every relative link and anchor resolves,
the options reference names every option and ini key, the development page's module map
matches the package, and the README stays a short page that says what the plugin is
in one sentence, then gives its two commands.
Reads files only: no subprocess, no pytest run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pytest_gpuiso.options import OPTIONS
from tests.helpers import ROOT

DOCS = ROOT / "docs"
README = ROOT / "README.md"
PACKAGE = ROOT / "pytest_gpuiso"

README_MAX_LINES = 260
README_COMMANDS = (
    "python3 -m venv .venv && .venv/bin/pip install . && .venv/bin/pytest --gpu-isolate "
    "fixtures/demo",
    'python3 -m venv .venv && .venv/bin/pip install -e ".[test]" && .venv/bin/pytest',
)

_FENCE = re.compile(r"^ {0,3}(```|~~~)")
_CODE_SPAN = re.compile(r"`[^`]*`")
# [text](target) and ![alt](target), the text possibly over several lines; an optional title
_LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def _pages() -> list[Path]:
    return [README, ROOT / "CHANGELOG.md", *sorted(DOCS.glob("*.md"))]


def _prose(text: str) -> str:
    """The text outside fenced code blocks (lines inside one become empty)."""
    lines, fenced = [], None
    for line in text.splitlines():
        match = _FENCE.match(line)
        if fenced is None and match:
            fenced = match.group(1)
            lines.append("")
        elif fenced is not None:
            if line.strip().startswith(fenced):
                fenced = None
            lines.append("")
        else:
            lines.append(line)
    return "\n".join(lines)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lower-cased, punctuation dropped (not ``-``
    or ``_``), spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in _prose(path.read_text()).splitlines():
        match = _HEADING.match(line)
        if not match:
            continue
        slug = _slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def _links(path: Path) -> list[str]:
    prose = _CODE_SPAN.sub("", _prose(path.read_text()))
    return [target for target in _LINK.findall(prose) if not _SCHEME.match(target)]


def test_the_slugs_follow_githubs_rules():
    assert _slug("For plugin authors: `pytest_gpuiso_*` hooks") == (
        "for-plugin-authors-pytest_gpuiso_-hooks"
    )
    assert _slug("Pinned workers, `--gpu-isolate-pin-workers`") == (
        "pinned-workers---gpu-isolate-pin-workers"
    )
    assert _slug("AMD GPUs (ROCm)") == "amd-gpus-rocm"
    assert _slug("`-n auto` counts GPU slots") == "-n-auto-counts-gpu-slots"


def test_every_relative_link_and_anchor_resolves():
    broken, checked = [], 0
    for page in _pages():
        for target in _links(page):
            checked += 1
            where = f"{page.relative_to(ROOT)}: ({target})"
            name, _, anchor = target.partition("#")
            dest = (page.parent / name).resolve() if name else page
            if not dest.is_relative_to(ROOT) or not dest.exists():
                broken.append(f"{where}: no such file in the repository")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{where}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert checked > 80, checked  # the scan sees the pages' links
    assert not broken, "\n".join(broken)


def test_every_docs_page_is_listed_in_the_index_and_the_index_in_the_readme():
    listed = {(DOCS / t.partition("#")[0]).resolve() for t in _links(DOCS / "README.md")}
    pages = {p.resolve() for p in DOCS.glob("*.md")} - {(DOCS / "README.md").resolve()}
    assert sorted(p.name for p in pages - listed) == []
    assert "docs/README.md" in _links(README)


_FLAG = re.compile(r"(?<![\w-])--(?:no-)?gpu-isolate[\w-]*")
_KEY = re.compile(r"(?<![\w-])gpu_isolate\w*")


def test_every_option_and_ini_key_has_its_row_in_the_options_reference():
    """A row per option: its flag(s) in the first cell, its ini key in the second, then
    its default and meaning."""
    text = (DOCS / "options.md").read_text()
    rows = [
        [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        for line in _prose(text).splitlines()
        if line.startswith("| ")
    ]
    missing = []
    for option in OPTIONS:
        flags = {flag for flag in (option.cli, option.negative) if flag}
        if not any(
            len(row) >= 4
            and flags <= set(_FLAG.findall(row[0]))
            and option.name in _KEY.findall(row[1])
            and row[2]
            for row in rows
        ):
            missing.append(f"{option.name} ({', '.join(sorted(flags)) or 'ini only'})")
    assert missing == []
    # and it names none that does not exist (the marker is gpu_isolated, its fixture
    # gpu_isolated_run)
    known_flags = {flag for o in OPTIONS for flag in (o.cli, o.negative) if flag}
    assert sorted(set(_FLAG.findall(text)) - known_flags) == []
    known_keys = {o.name for o in OPTIONS} | {"gpu_isolated", "gpu_isolated_run"}
    assert sorted(set(_KEY.findall(text)) - known_keys) == []


def test_every_flag_the_user_pages_name_exists():
    known = {flag for o in OPTIONS for flag in (o.cli, o.negative) if flag}
    notes = {"performance.md", "gpu-validation.md", "plugins-design.md"}  # dated lab notes
    unknown = []
    for page in _pages():
        if page.name in notes:
            continue
        for flag in set(_FLAG.findall(page.read_text())):
            if flag not in known:
                unknown.append(f"{page.relative_to(ROOT)}: {flag}")
    assert sorted(unknown) == []


def test_every_ini_key_the_pages_name_exists():
    """Besides the ini keys: the marker, its fixture, and junit's leak property."""
    known = {o.name for o in OPTIONS} | {"gpu_isolated", "gpu_isolated_run", "gpu_isolate_leak"}
    unknown = []
    for page in _pages():
        for key in set(_KEY.findall(page.read_text())) - known:
            unknown.append(f"{page.relative_to(ROOT)}: {key}")
    assert sorted(unknown) == []


def _section(text: str, heading: str) -> str:
    """A section of a page: from its heading to the next heading of its level or above
    (outside code blocks, whose comments may start with ``#``)."""
    level = len(heading.split(" ", 1)[0])
    lines, prose = text.splitlines(), _prose(text).splitlines()
    start = lines.index(heading)
    end = next(
        (
            n
            for n in range(start + 1, len(lines))
            if (match := _HEADING.match(prose[n])) and len(match.group(1)) <= level
        ),
        len(lines),
    )
    return "\n".join(lines[start:end])


_OUR_VARIABLE = re.compile(r"[\"']((?:PYTEST_)?GPUISO_[A-Z0-9_]+)[\"']")


def test_every_environment_variable_of_ours_has_its_row_in_the_options_reference():
    """Each GPUISO_* and PYTEST_GPUISO_* name the package spells (in a string: what it
    reads or sets) is named in the reference's environment section."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        names |= set(_OUR_VARIABLE.findall(path.read_text()))
    assert len(names) >= 12, names  # the scan sees them (wire/environment.py, native.py)
    section = _section((DOCS / "options.md").read_text(), "## Environment variables")
    assert sorted(n for n in names if not re.search(rf"`{n}[`=]", section)) == []


def test_every_option_of_the_commands_has_its_row_in_the_options_reference():
    """``python -m pytest_gpuiso``: each command's options in a row of its own command
    (``merge --durations``, ``compare --write-baseline``), the common ones anywhere."""
    from pytest_gpuiso.__main__ import _parser

    parser, commands = _parser()
    section = _section((DOCS / "options.md").read_text(), "## `python -m pytest_gpuiso`")
    first_cells = [line.split(" | ")[0] for line in section.splitlines() if line.startswith("| `")]
    missing = []
    for name, command in commands.items():
        for action in command._actions:
            for flag in set(action.option_strings) - {"-h", "--help"}:
                if not any(f"`{name}" in cell and flag in cell for cell in first_cells):
                    missing.append(f"{name} {flag}")
    for action in parser._actions:
        for flag in set(action.option_strings) - {"-h", "--help"}:
            if not any(flag in cell for cell in first_cells):
                missing.append(flag)
    assert sorted(missing) == []


def test_pytest_help_points_to_the_options_reference_where_a_wheels_user_can_read_it():
    """A wheel has no docs/: pytest --help names the reference by its URL, the project's."""
    from pytest_gpuiso import options

    assert f"{_REPOSITORY}/blob/main/docs/options.md" == options.REFERENCE
    assert (ROOT / options.REFERENCE.removeprefix(f"{_REPOSITORY}/blob/main/")).is_file()
    shown = [title for _, title in (options.MAIN_GROUP, options.TUNING_GROUP)]
    shown += [text for o in options.OPTIONS for text in (o.help, o.negative_help)]
    assert options.REFERENCE in options.TUNING_GROUP[1]
    assert [t for t in shown if re.search(r"(?<!/main/)\bdocs/", t)] == []


def test_the_readmes_ini_example_parses_and_sets_real_keys():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    section = _section(README.read_text(), "### In your ini file")
    block = section.split("```toml\n", 1)[1].split("```", 1)[0]
    keys = tomllib.loads(block)["tool"]["pytest"]["ini_options"]
    assert keys and set(keys) <= {o.name for o in OPTIONS}


_REPOSITORY = "https://github.com/pytest-gpuiso/pytest-gpuiso"


def test_the_project_urls_name_one_repository_and_files_it_has():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    urls = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]
    assert sorted(urls) == ["Changelog", "Documentation", "Homepage", "Issues", "Source"]
    assert urls["Source"] == urls["Homepage"] == _REPOSITORY
    assert urls["Issues"] == f"{_REPOSITORY}/issues"
    for name in ("Documentation", "Changelog"):
        prefix = f"{_REPOSITORY}/blob/main/"
        assert urls[name].startswith(prefix), urls[name]
        assert (ROOT / urls[name].removeprefix(prefix)).is_file(), urls[name]


def test_the_readme_says_how_to_install_before_the_package_is_published():
    """Nothing is on PyPI yet: the install section gives ways that work today (the
    repository, a checkout, a built wheel) and keeps the published name for later."""
    section = _section(README.read_text(), "## Install")
    for way in (
        f"pip install git+{_REPOSITORY}",
        "pip install .",
        "pip wheel --no-deps . -w dist",
        "pip install dist/pytest_gpuiso-*.whl",
        "pip install pytest-gpuiso",
    ):
        assert way in section, way
    quick_start = _section(README.read_text(), "## Use it on your own suite")
    assert f"git+{_REPOSITORY}" in quick_start.replace("\n   ", "")


def _module_map() -> list[str]:
    """The modules the development page's module map names, one per table row."""
    text = (DOCS / "development.md").read_text()
    start = text.index("\n## Module map\n")
    end = text.find("\n## ", start + 1)
    section = text[start : end if end != -1 else len(text)]
    return re.findall(r"^\| `(pytest_gpuiso/[\w/]+\.py)` \|", section, re.MULTILINE)


def _package_modules() -> set[str]:
    return {
        p.relative_to(ROOT).as_posix()
        for p in PACKAGE.rglob("*.py")
        if "__pycache__" not in p.parts
    }


def test_the_module_map_names_every_module_of_the_package_once():
    named = _module_map()
    assert sorted({m for m in named if named.count(m) > 1}) == []
    assert sorted(_package_modules() - set(named)) == []


def test_the_module_map_names_no_module_the_package_lacks():
    assert sorted(set(_module_map()) - _package_modules()) == []


def test_the_readme_is_short_and_says_what_it_is_before_its_two_commands():
    """A sentence first (a new user met two bare commands before), then the two commands,
    as they are: CI runs them."""
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, len(lines)
    demo, suite = README_COMMANDS
    assert lines[:2] == ["# pytest-gpuiso", ""]
    blank = lines.index("", 2)  # the paragraph before the commands
    sentence = " ".join(lines[2:blank])
    assert sentence.startswith("A pytest plugin that ") and sentence.endswith(".")
    assert "```" not in sentence and sentence.count(". ") == 0  # one sentence, in prose
    commands = ["```bash", demo, "```", "", "```bash", suite, "```"]
    assert lines[blank + 1 : blank + 8] == commands
    # what the commands name is there: the demo suite and the test extra
    assert (ROOT / "fixtures" / "demo").is_dir()
    assert re.search(r"^test = \[", (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
