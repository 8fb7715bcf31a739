"""What users install: the wheel's and the sdist's contents, the build's errors, the CLI.

CI also runs this whole suite against the installed wheel (``.ci/run``); there
``GPUISO_TEST_EXPECT_INSTALLED=1`` makes ``test_the_installed_package_is_what_runs`` prove
it, since a checkout's ``pytest_gpuiso/`` on ``sys.path`` would otherwise go unnoticed.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest

import pytest_gpuiso
from tests.helpers import ROOT

# What is installed and how: CI's wheel stage runs it against the installed wheel
# The module's tests share one build (the module-scoped dists): one xdist worker runs them.
pytestmark = [pytest.mark.installation, pytest.mark.xdist_group("packaging")]

PACKAGE_DIR = Path(pytest_gpuiso.__file__).resolve().parent
BUILD_FILES = (
    "setup.py",
    "pyproject.toml",
    "MANIFEST.in",
    "README.md",
    "CHANGELOG.md",
    "LICENSE",
    "conftest.py",
    "tox.ini",
)


def _needs_build_tools() -> None:
    for dist, what in (("setuptools", "77"), ("build", "1")):
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pytest.skip(f"{dist} is not installed (pip install -e '.[test]')")
        if int(version.split(".")[0]) < int(what):
            pytest.skip(f"{dist} {version} is older than {what}")


def _source_copy(dest: Path) -> Path:
    """The files a build reads, copied out of the tree (a build writes build/ and egg-info)."""
    for name in BUILD_FILES:
        shutil.copy(ROOT / name, dest / name)
    for tree in ("native", "pytest_gpuiso", "tests", "fixtures", "bench", "docs", ".ci"):
        if (ROOT / tree).is_dir():
            shutil.copytree(
                ROOT / tree, dest / tree, ignore=shutil.ignore_patterns("__pycache__", "*.so")
            )
    return dest


def _build(src: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(src / "dist"), *args],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def _subpackages(top: Path) -> set[str]:
    return {str(p.parent.relative_to(top.parent)) for p in top.rglob("__init__.py")}


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(source copy, sdist, wheel) built the way ``python -m build`` builds them."""
    _needs_build_tools()
    src = _source_copy(tmp_path_factory.mktemp("src"))
    built = _build(src)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (sdist,) = (src / "dist").glob("*.tar.gz")
    (wheel,) = (src / "dist").glob("*.whl")
    return src, sdist, wheel


def test_the_wheel_holds_every_subpackage_and_extension(dists):
    src, _, wheel = dists
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in _subpackages(src / "pytest_gpuiso"):
        assert f"{package}/__init__.py" in names, package
    for ext in ("_lease", "_fork", "_shmtrace"):
        assert any(n.startswith(f"pytest_gpuiso/{ext}.") and n.endswith(".so") for n in names), ext
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "gpuiso = pytest_gpuiso.plugin" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_the_sdist_carries_what_its_tests_need(dists):
    src, sdist, _ = dists
    with tarfile.open(sdist) as tar:
        top, *_ = tar.getnames()
        names = {n.partition("/")[2] for n in tar.getnames()}
    expected = {"conftest.py", "tox.ini", "setup.py", "pyproject.toml", "LICENSE"}
    expected |= {"README.md", "CHANGELOG.md"}
    expected |= {f"{p}/__init__.py" for p in _subpackages(src / "pytest_gpuiso")}
    # docs/: the README's links and tests/project/test_docs.py
    for tree in ("tests", "fixtures", "native", "bench", "docs"):
        expected |= {
            str(p.relative_to(src))
            for p in (src / tree).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts
        }
    assert expected - names == set()
    assert not [n for n in names if n.endswith((".pyc", ".so"))]


def test_a_missing_compiler_is_one_line_naming_what_to_install(tmp_path: Path):
    _needs_build_tools()
    src = _source_copy(tmp_path)
    env = dict(os.environ, CC=str(tmp_path / "no-such-gcc"))
    built = _build(src, "--wheel", env=env)
    assert built.returncode != 0
    out = built.stdout + built.stderr
    lines = [line for line in out.splitlines() if "pytest-gpuiso cannot be built" in line]
    assert len(lines) == 1, out[-3000:]
    assert f"no C compiler found (CC='{tmp_path / 'no-such-gcc'}')" in lines[0]
    assert "install gcc and the Python headers" in lines[0] and "python3-dev" in lines[0]
    assert "Traceback" not in out


# ------------------------------------------------- not Linux: a wheel without the C extensions

# The tiny suite a machine other than Linux runs: a marked test, and a plain one, both in
# pytest's own process (the conftest notes its pid; a test's process would inherit it).
NO_NATIVE_SUITE = {
    "pytest.ini": "[pytest]\n",
    "conftest.py": """
import os

def pytest_configure(config):
    os.environ.setdefault("SMOKE_PYTEST_PID", str(os.getpid()))
""",
    "test_smoke.py": """
import os
from pathlib import Path

import pytest
import pytest_gpuiso

def test_the_wheel_without_extensions_runs():
    assert Path(os.environ["SMOKE_VENV"]) in Path(pytest_gpuiso.__file__).parents

@pytest.mark.gpu_isolated(timeout=120)
def test_marked_runs_in_process():
    assert os.getpid() == int(os.environ["SMOKE_PYTEST_PID"])
""",
}


@pytest.fixture(scope="module")
def nonative(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(source copy, wheel) built with ``GPUISO_NO_NATIVE=1``: what a machine other than
    Linux builds (setup.py compiles nothing there)."""
    _needs_build_tools()
    src = _source_copy(tmp_path_factory.mktemp("src-nonative"))
    built = _build(src, "--wheel", env=dict(os.environ, GPUISO_NO_NATIVE="1"))
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = (src / "dist").glob("*.whl")
    return src, wheel


def test_without_native_the_wheel_is_pure_python(nonative):
    src, wheel = nonative
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    names = set(zipfile.ZipFile(wheel).namelist())
    assert not [n for n in names if n.endswith(".so")]
    for package in _subpackages(src / "pytest_gpuiso"):
        assert f"{package}/__init__.py" in names, package
    assert "pytest_gpuiso/native.py" in names


def _fresh_venv(where: Path, wheel: Path) -> Path:
    """A venv with ``wheel`` installed and this one's packages (pytest, psutil...) beside;
    its python. Not this one's .pth files: an editable install's finder among them would
    find the checkout's extensions for the wheel's package."""
    venv.create(where, symlinks=True, with_pip=False)
    python = where / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    outer = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (Path(site) / "outer.pth").write_text("".join(f"{path}\n" for path in outer))
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet"]
    installed = subprocess.run(
        [*pip, "--target", site, str(wheel)], capture_output=True, text=True, timeout=120
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return python


@pytest.mark.parametrize("isolate", [[], ["--gpu-isolate"]], ids=["marked", "all"])
def test_without_native_marked_tests_pass_in_process(nonative, tmp_path: Path, isolate):
    """Installed, the plugin still registers its marker (--strict-markers), runs every test
    in-process and says why in exactly one header line."""
    from pytest_gpuiso.native import NOT_BUILT

    _, wheel = nonative
    python = _fresh_venv(tmp_path / "venv", wheel)
    suite = tmp_path / "suite"
    suite.mkdir()
    for name, text in NO_NATIVE_SUITE.items():
        (suite / name).write_text(text)
    env = dict(os.environ, SMOKE_VENV=str(tmp_path / "venv"))
    for name in (
        "PYTHONPATH",
        "PYTEST_ADDOPTS",
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD",
        "PYTEST_PLUGINS",
    ):
        env.pop(name, None)
    result = subprocess.run(
        # -p no:randomly: the outer site's pytest-randomly 3.3 (CI's lowest versions) needs
        # the cache plugin, and shuffling is not what this checks
        [python, "-m", "pytest", "-p", "no:randomly", "--strict-markers", *isolate],
        cwd=suite,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "2 passed" in out, out
    ours = [line for line in out.splitlines() if line.startswith("gpu-isolate:")]
    assert len(ours) == 1, out
    assert NOT_BUILT in ours[0], out


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m pytest_gpuiso``, run in ``cwd``: "-m" puts the cwd first on sys.path, and
    a checkout's ``pytest_gpuiso/`` there would shadow the installed package."""
    return subprocess.run(
        [sys.executable, "-m", "pytest_gpuiso", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_version(tmp_path: Path):
    result = _cli(tmp_path, "--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"pytest-gpuiso {pytest_gpuiso.__version__}"
    assert importlib.metadata.version("pytest-gpuiso") == pytest_gpuiso.__version__


@pytest.mark.parametrize("command", [[], ["status"], ["reset"], ["merge"]])
def test_help_is_plain_text(tmp_path: Path, command: list[str]):
    result = _cli(tmp_path, *command, "--help")
    assert result.returncode == 0
    assert "usage: python -m pytest_gpuiso" in result.stdout
    for markup in ("``", ":class:", ":func:", ".. ", "**"):
        assert markup not in result.stdout, markup


@pytest.mark.parametrize("order", ["before", "after"])
def test_options_before_or_after_the_command(tmp_path: Path, order: str):
    region = ["--region", str(tmp_path / "table")]
    args = [*region, "status"] if order == "before" else ["status", *region]
    result = _cli(tmp_path, *args)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"lease table {tmp_path / 'table'}\n")


def test_the_installed_package_is_what_runs(pytester: pytest.Pytester):
    """The isolated test's process imports the same pytest_gpuiso as pytest does.

    Under ``GPUISO_TEST_EXPECT_INSTALLED=1`` (CI's wheel run) that copy must also be an
    installed one, not the sources of the directory the tests run from.
    """
    if os.environ.get("GPUISO_TEST_EXPECT_INSTALLED") == "1":
        installed = {Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")}
        assert PACKAGE_DIR.parent in installed, (PACKAGE_DIR, installed)
        assert (ROOT / "pytest_gpuiso").resolve() != PACKAGE_DIR, PACKAGE_DIR
    pytester.makepyfile(
        f"""
        import pytest, pytest_gpuiso, pytest_gpuiso._lease
        from pathlib import Path

        EXPECTED = Path({str(PACKAGE_DIR)!r})

        @pytest.mark.gpu_isolated
        def test_where():
            assert Path(pytest_gpuiso.__file__).resolve().parent == EXPECTED
            assert Path(pytest_gpuiso._lease.__file__).resolve().parent == EXPECTED
        """
    )
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "no:randomly", "--gpu-isolate-preload=none"
    )
    result.assert_outcomes(passed=1)
