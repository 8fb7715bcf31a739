"""Fidelity on real suites: each test's outcome isolated, against in-process, test by test.

Fetches the pinned sdists of real projects that ship their tests (``pip download
--no-binary :all: --no-deps``, through real_suites.py's machinery), extracts each once, and
runs its suite from the extracted tree, with the project's own configuration as shipped
(its pyproject.toml, setup.cfg, tox.ini or pytest.ini; nothing is added to it but
``--junitxml``, a cache directory of the run's own and, where a suite says so, the test
files chosen and a few tests deselected, each with its reason), in a venv of the suite's
own: the project installed from its sdist, what its tests need (pinned), pytest 9.2.0,
pytest-xdist 3.8.0 and the plugin (a wheel built from this checkout, or ``--plugin
PATH_OR_SPEC``, reinstalled every run). A second venv per suite holds pytest 9.1.1 and
pytest-forked 1.7.5 (which needs pytest < 9.2) instead, without the plugin: the reference
a plain fork of pytest gives. Venvs, sdists and trees are kept under ``--cache DIR``
(default ~/.cache/pytest-gpuiso-bench/fidelity) and reused.

Modes (``--modes``, comma-separated; in-process always runs, as the reference):

* in-process: ``--no-gpu-isolate``;
* forkserver: ``--gpu-isolate`` (the default start method);
* spawn: ``--gpu-isolate --gpu-isolate-start=spawn``;
* xdist: ``--gpu-isolate -n 2``;
* forked: ``--forked`` in the second venv (pytest-forked; shown, never judged).

Prints, per suite, the number of tests, each mode's wall time and how many tests' junit
outcomes (passed, failed, error, skipped, xfailed) differ from in-process; then every
differing test (junit's ``classname::name``, both outcomes, a line of junit's message, and
the explanation when ``EXPLAINED`` has one), and which suites cover which configuration
feature. Exit status: 0 when no outcome differs, 1 when a judged mode differs for a test
``EXPLAINED`` does not explain (or a judged mode's pytest ended with a status above 1),
2 when a step of the setup fails (one line, and its command's output tail).

    python bench/fidelity.py [--suite a,b | --fastest N] [--modes forkserver,spawn,xdist,forked]
                             [--cache DIR] [--plugin PATH_OR_SPEC] [--timeout S]
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import os
import shlex
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

# python bench/fidelity.py puts bench/ first on sys.path: real_suites.py's machinery is shared.
from overhead import tail
from real_suites import (
    Case,
    StepFailed,
    fetch_suite,
    junit_cases,
    plugin_wheel,
    run,
    sdist_of,
    step,
)

PYTEST = "pytest==9.2.0"
XDIST = "pytest-xdist==3.8.0"
FORKED = ("pytest==9.1.1", "pytest-forked==1.7.5")  # pytest-forked 1.7.5 needs pytest < 9.2

# The configuration features a suite covers, and what each means.
FEATURES = {
    "filterwarnings=error": "filterwarnings turns warnings into errors",
    "strict-config": "--strict-config in addopts",
    "strict-markers": "--strict-markers in addopts",
    "xfail_strict": "xfail_strict = true",
    "import-mode=importlib": "--import-mode=importlib in addopts",
    "src-layout": "the package under src/, imported from its installation",
    "nested-conftests": "conftest.py files at more than one level",
    "doctest-modules": "--doctest-modules in addopts",
    "pytest-asyncio": "pytest-asyncio's plugin and asyncio_mode",
    "anyio": "anyio's pytest plugin (anyio_backend)",
    "hypothesis-profiles": "a hypothesis settings profile registered and loaded by a conftest",
    "log_cli": "live-logging ini keys (log_cli_level)",
    "addopts-plugins": "plugins loaded or blocked by -p in addopts",
    "testpaths": "testpaths in the configuration (no path on the command line)",
    "python_files": "python_files patterns other than the default",
    "unittest": "unittest.TestCase classes",
    "fixtures-io": "heavy tmp_path / monkeypatch / capsys use",
    "pytester": "tests that run pytest themselves (the pytester fixture)",
    "ini-file": "the configuration in tox.ini or setup.cfg (not pyproject.toml)",
    "native-toml": "pytest's native [tool.pytest] table",
    "addopts-m": "a -m marker expression in addopts",
}


@dataclass(frozen=True)
class Suite:
    name: str  # the distribution, as pip names it
    version: str
    covers: tuple[str, ...]  # FEATURES keys
    requires: tuple[str, ...] = ()  # what its tests import, pinned
    args: tuple[str, ...] = ()  # test paths chosen (none: its own testpaths or rootdir)
    deselect: tuple[tuple[str, str], ...] = ()  # (node id, why)
    env: tuple[tuple[str, str], ...] = ()
    # Wall seconds of one run of all five modes on the 2-core development VM (the table in
    # docs/semantics.md): --fastest N picks the N smallest.
    seconds: float = 0.0


SUITES = {
    suite.name: suite
    for suite in (
        Suite(
            "iniconfig",
            "2.3.1",
            ("native-toml", "testpaths", "src-layout", "fixtures-io"),
            seconds=20,
        ),
        Suite(
            "pluggy",
            "1.7.0",
            ("ini-file", "filterwarnings=error", "testpaths", "src-layout"),
            seconds=85,
        ),
        Suite(
            "exceptiongroup",
            "1.3.2",
            ("strict-config", "strict-markers", "unittest", "src-layout", "testpaths"),
            seconds=50,
        ),
        Suite(
            "packaging",
            "26.4",
            (
                "strict-config",
                "strict-markers",
                "xfail_strict",
                "filterwarnings=error",
                "addopts-plugins",
                "addopts-m",
                "src-layout",
            ),
            requires=("pretend==1.0.9", "tomli_w==1.2.0", "hypothesis==6.170.17"),
            # tests/ is ~65,000 tests (test_version.py alone 51,524): the smaller files.
            args=tuple(
                f"tests/test_{name}.py"
                for name in ("elffile", "errors", "manylinux", "musllinux", "tags", "utils")
            ),
            seconds=150,
        ),
        Suite(
            "typeguard",
            "4.6.1",
            ("filterwarnings=error", "xfail_strict", "testpaths", "src-layout"),
            seconds=200,
        ),
        Suite(
            "anyio",
            "4.16.0",
            (
                "anyio",
                "addopts-plugins",
                "strict-config",
                "strict-markers",
                "xfail_strict",
                "filterwarnings=error",
                "native-toml",
                "src-layout",
            ),
            requires=(
                "pytest-mock==3.17.0",
                "pytest-timeout==2.4.0",
                "hypothesis==6.170.17",
                "psutil",
                "trustme",
                "blockbuster",
                "trio",
            ),
            # tests/ is ~2,900 tests (most parametrized over asyncio, uvloop and trio, some
            # opening sockets): two files that need no network.
            args=("tests/test_synchronization.py", "tests/test_to_thread.py"),
            seconds=150,
        ),
        Suite(
            "attrs",
            "26.1.0",
            (
                "hypothesis-profiles",
                "import-mode=importlib",
                "strict-config",
                "strict-markers",
                "xfail_strict",
                "src-layout",
            ),
            requires=("hypothesis==6.170.17", "cloudpickle", "pympler"),
            # tests/ is ~1,400 tests, many of them hypothesis-driven: two files.
            args=("tests/test_make.py", "tests/test_funcs.py"),
            seconds=140,
        ),
        Suite(
            "python-dateutil",
            "4.0.0",
            ("python_files", "filterwarnings=error", "xfail_strict", "unittest", "src-layout"),
            # pytest-cov registers the no_cover marker its conftest adds to some tests
            requires=("freezegun==1.5.5", "hypothesis==6.170.17", "pytest-cov==7.1.0"),
            # tests/ is ~3,800 tests: two files (relativedelta's are unittest.TestCase's).
            args=("tests/test_relativedelta.py", "tests/test_easter.py"),
            seconds=150,
        ),
        Suite(
            "humanize",
            "4.17.0",
            ("doctest-modules", "filterwarnings=error", "native-toml", "src-layout"),
            requires=("freezegun==1.5.5", "pytest-benchmark==5.3.1"),
            # testpaths (src, tests) is 908 tests: src's doctests and three of tests/ files.
            args=(
                "src",
                "tests/test_filesize.py",
                "tests/test_lists.py",
                "tests/test_benchmarks.py",
            ),
            seconds=60,
        ),
        Suite(
            "toolz",
            "1.2.0",
            ("log_cli", "testpaths", "strict-config", "strict-markers", "xfail_strict"),
            seconds=70,
        ),
        # No pytest configuration (its tox.ini runs unittest): pytest's defaults, from the
        # rootdir; tests/ is 765 tests, test_more.py ~30 s of them: the recipes' file.
        Suite(
            "more-itertools", "11.2.1", ("unittest",), args=("tests/test_recipes.py",), seconds=60
        ),
        Suite(
            "pytest-asyncio",
            "1.5.0",
            (
                "pytest-asyncio",
                "nested-conftests",
                "python_files",
                "filterwarnings=error",
                "pytester",
            ),
            requires=("hypothesis==6.170.17",),
            # testpaths (docs, tests) is ~330 tests, most of them running pytest (pytester,
            # ~1-2 s each): docs (its nested conftests), the modes' tests and the skips'.
            args=("docs", "tests/modes", "tests/test_skips.py"),
            seconds=200,
        ),
        Suite(
            "structlog",
            "26.1.0",
            (
                "pytest-asyncio",
                "import-mode=importlib",
                "strict-config",
                "strict-markers",
                "xfail_strict",
                "fixtures-io",
                "src-layout",
            ),
            requires=("pytest-asyncio==1.5.0", "simplejson", "time-machine", "pretend==1.0.9"),
            # tests/ is 921 tests: three files, capsys- and monkeypatch-heavy.
            args=("tests/test_stdlib.py", "tests/test_output.py", "tests/test_config.py"),
            seconds=130,
        ),
        Suite(
            "click",
            "8.5.1",
            ("filterwarnings=error", "addopts-m", "fixtures-io", "src-layout"),
            # tests/ is 2,459 tests: the utilities (files, streams, tmp_path, monkeypatch), the
            # CliRunner's own tests and the context's.
            args=("tests/test_utils", "tests/test_testing.py", "tests/test_context.py"),
            seconds=150,
        ),
        Suite(
            "zipp",
            "4.1.2",
            ("doctest-modules", "import-mode=importlib", "ini-file"),
            requires=(
                "jaraco.itertools==6.4.3",
                "jaraco.functools==4.6.0",
                "more_itertools==11.2.1",
                "big-O==0.11.0",
                "pytest-ignore-flaky==2.2.1",
                "jaraco.test==5.7.0",
            ),
            # Marked flaky upstream: each fits a complexity class to wall-clock timings
            # (big-O), which a loaded machine bends; the first run failed one in-process.
            deselect=tuple(
                (f"tests/test_complexity.py::TestComplexity::test_{name}", "timing: flaky")
                for name in (
                    "implied_dirs_performance",
                    "glob_depth",
                    "glob_width",
                    "glob_width_and_depth",
                )
            ),
            seconds=145,
        ),
        Suite(
            "jinja2",
            "3.1.6",
            ("filterwarnings=error", "testpaths", "src-layout"),
            requires=("trio==0.35.0",),
            seconds=300,
        ),
        Suite(
            "markupsafe",
            "3.0.4",
            ("filterwarnings=error", "testpaths", "src-layout"),
            seconds=25,
        ),
        Suite("cachetools", "8.0.2", ("unittest", "src-layout"), seconds=110),
        Suite(
            "pytest-mock",
            "3.17.0",
            ("ini-file", "pytester", "pytest-asyncio", "src-layout"),
            requires=("pytest-asyncio==1.5.0",),
            args=("tests",),  # as its tox.ini runs it (no testpaths)
            seconds=90,
        ),
        Suite("six", "1.17.0", ("ini-file",), seconds=65),
    )
}

# Differences understood, by fnmatch pattern over "<suite>::<junit classname>::<name>":
# the reason (each also written in docs/semantics.md, "A corpus of real suites").
EXPLAINED: dict[str, str] = {
    "pytest-asyncio::docs.*": (
        "the docs' examples hand a module global (loop) from one test to the next: an "
        "isolated test sees only what its own process set"
    ),
    "click::tests.test_utils.test_echo_via_pager::*": (
        "spawn only: the test reaches click._termui_impl as an attribute of click, which "
        "exists once an earlier test imported the submodule; a fresh spawned process has "
        "not (the fork server's template learnt the import)"
    ),
    # Both race anyio's worker thread, and both fail in pytest's own process too once its
    # heap is frozen (gc.freeze() in a plugin) on a busy or one-CPU machine: 8 of 8 runs.
    "anyio::tests.test_to_thread::test_run_sync_worker_cyclic_references*": (
        "a race in the test: it checks before the worker thread dropped its copy of the "
        "context, which a gc.collect() over the whole heap gives it time to; the test's "
        "process collects only the test's own objects (docs/semantics.md)"
    ),
    "anyio::tests.test_to_thread::test_asyncio_run_does_not_leak_event_loop": (
        "a race in the test: it checks before the stopped worker thread, which still "
        "refers to the loop, has exited (anyio.run does not join it); the test's process "
        "collects only the test's own objects, in far less time (docs/semantics.md)"
    ),
}

MODES = {
    "forkserver": ("--gpu-isolate",),
    "spawn": ("--gpu-isolate", "--gpu-isolate-start=spawn"),
    "xdist": ("--gpu-isolate", "-n", "2"),
    "forked": ("--forked",),
}
JUDGED = ("forkserver", "spawn", "xdist")  # forked is pytest-forked's: shown, never judged
REFERENCE = ("in-process", ("--no-gpu-isolate",))


@dataclass
class Result:
    mode: str
    seconds: float
    rc: int
    cases: dict[str, Case]
    output: str


@dataclass
class Measured:
    suite: Suite
    results: dict[str, Result] = field(default_factory=dict)
    plugins: str = ""  # pytest's header line naming the plugins loaded (in-process)


# -- the environment ---------------------------------------------------------------------


def venv_for(cache: Path, suite: Suite, sdist: Path, wanted: list[str], kind: str) -> Path:
    """The python of a venv of ``kind`` for ``suite``: ``wanted`` and the project (from its
    sdist) installed once, by this interpreter's pip (the venv has none of its own)."""
    key = hashlib.sha256("\n".join([sdist.name, *wanted]).encode()).hexdigest()[:10]
    venv = cache / "venvs" / f"{suite.name}-{suite.version}-{kind}-{key}"
    python = venv / "bin" / "python"
    ready = venv / "bench-installed.txt"
    if python.exists() and ready.exists():
        return python
    shutil.rmtree(venv, ignore_errors=True)
    step("creating a venv", [sys.executable, "-m", "venv", "--without-pip", str(venv)])
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q"]
    step(
        f"installing {suite.name}'s {kind} venv: " + ", ".join(wanted), [*pip, str(sdist), *wanted]
    )
    ready.write_text("\n".join([sdist.name, *wanted]) + "\n")
    return python


def install_plugin(python: Path, plugin: str) -> None:
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q"]
    step(f"installing the plugin ({plugin})", [*pip, plugin])  # and its dependencies
    # The same version string may name another build: this run's replaces the installed one.
    step(f"reinstalling the plugin ({plugin})", [*pip, "--force-reinstall", "--no-deps", plugin])


def suite_env(python: Path, suite: Suite) -> dict[str, str]:
    """As if the suite's venv were active: no PYTEST_* (nor xdist's, when this runs under
    xdist), no PYTHONPATH, nothing of a coverage run."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTEST_", "COV_CORE_")) and k not in ("PYTHONPATH",)
    }
    env["PATH"] = f"{python.parent}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(python.parent.parent)
    env.update(suite.env)
    return env


# -- the runs ----------------------------------------------------------------------------


def run_mode(
    python: Path, tree: Path, suite: Suite, mode: str, args: tuple[str, ...], work: Path, opts
) -> Result:
    junit = work / f"{suite.name}-{mode}.xml"
    junit.unlink(missing_ok=True)
    cache_dir = work / f"cache-{suite.name}-{mode}"
    cmd = [str(python), "-m", "pytest", f"--junitxml={junit}", f"-ocache_dir={cache_dir}"]
    cmd += [*args, *suite.args, *(f"--deselect={nodeid}" for nodeid, _ in suite.deselect)]
    seconds, rc, out = run(cmd, opts.timeout, cwd=tree, env=suite_env(python, suite))
    if mode == REFERENCE[0] and rc not in (0, 1):
        raise StepFailed(f"{suite.name}, in-process: pytest exited {rc}: {shlex.join(cmd)}", out)
    cases = junit_cases(junit)[0] if junit.exists() else {}
    return Result(mode, seconds, rc, cases, out)


def measure(suite: Suite, cache: Path, plugin: str, modes: list[str], work: Path, opts):
    sdist = sdist_of(cache, Path(sys.executable), suite)
    tree = fetch_suite(cache, Path(sys.executable), suite)
    measured = Measured(suite)
    # in-process always runs: the reference
    python = venv_for(cache, suite, sdist, [PYTEST, XDIST, *suite.requires], "gpuiso")
    install_plugin(python, plugin)
    ref = run_mode(python, tree, suite, REFERENCE[0], REFERENCE[1], work, opts)
    measured.results[ref.mode] = ref
    measured.plugins = next(
        (line for line in ref.output.splitlines() if line.startswith("plugins:")), ""
    )
    print(f"  {suite.name}, in-process: {ref.seconds:.1f} s", file=sys.stderr, flush=True)
    for mode in (m for m in modes if m != "forked"):
        result = run_mode(python, tree, suite, mode, MODES[mode], work, opts)
        measured.results[mode] = result
        print(f"  {suite.name}, {mode}: {result.seconds:.1f} s", file=sys.stderr, flush=True)
    if "forked" in modes:
        python = venv_for(cache, suite, sdist, [*FORKED, *suite.requires], "forked")
        result = run_mode(python, tree, suite, "forked", MODES["forked"], work, opts)
        measured.results["forked"] = result
        print(f"  {suite.name}, forked: {result.seconds:.1f} s", file=sys.stderr, flush=True)
    return measured


# -- the comparison ----------------------------------------------------------------------


@dataclass(frozen=True)
class Difference:
    suite: str
    mode: str
    nodeid: str
    was: str
    now: str
    message: str  # one line of junit's message, from the side that did not pass
    explained: str  # EXPLAINED's reason, or ""


def one_line(text: str, width: int = 160) -> str:
    line = next((s.strip() for s in text.splitlines() if s.strip()), "")
    return line if len(line) <= width else line[: width - 3] + "..."


def explanation(suite: str, nodeid: str) -> str:
    key = f"{suite}::{nodeid}"
    return next(
        (why for pattern, why in EXPLAINED.items() if fnmatch.fnmatchcase(key, pattern)), ""
    )


def differences(measured: Measured, mode: str) -> list[Difference]:
    ref = measured.results[REFERENCE[0]].cases
    cases = measured.results[mode].cases
    absent = Case("absent", "")
    found = []
    for nodeid in sorted(set(ref) | set(cases)):
        was, now = ref.get(nodeid, absent), cases.get(nodeid, absent)
        if was.outcome != now.outcome:
            message = one_line(now.message or was.message)
            why = explanation(measured.suite.name, nodeid)
            found.append(
                Difference(
                    measured.suite.name, mode, nodeid, was.outcome, now.outcome, message, why
                )
            )
    return found


def print_report(all_measured: list[Measured], modes: list[str]) -> bool:
    """Print the table, the differences and the coverage; whether any judged mode differs
    unexplained (or ended with a status above 1)."""
    columns = [REFERENCE[0], *modes]
    print()
    head = f"{'suite':<16}{'tests':>6}"
    for mode in columns:
        head += f"{mode + ' s':>14}" + ("" if mode == REFERENCE[0] else f"{'diff':>6}")
    print(head)
    unexplained = False
    listed: list[Difference] = []
    broken: list[tuple[Measured, Result]] = []
    for m in all_measured:
        ref = m.results[REFERENCE[0]]
        line = f"{m.suite.name:<16}{len(ref.cases):>6}"
        for mode in columns:
            result = m.results.get(mode)
            if result is None:
                line += f"{'-':>14}" + ("" if mode == REFERENCE[0] else f"{'-':>6}")
                continue
            line += f"{result.seconds:>14.1f}"
            if mode == REFERENCE[0]:
                continue
            diffs = differences(m, mode)
            listed += diffs
            line += f"{len(diffs):>6}" if result.rc in (0, 1) else f"{'rc' + str(result.rc):>6}"
            if result.rc not in (0, 1):
                broken.append((m, result))
            if mode in JUDGED and (result.rc not in (0, 1) or any(not d.explained for d in diffs)):
                unexplained = True
        print(line)
    print(
        "tests: junit test cases in-process; <mode> s: wall seconds of the whole pytest run; "
        "diff: tests whose junit outcome differs from in-process (rcN: pytest exited N); "
        "forked (pytest-forked, pytest 9.1.1) is shown, never judged"
    )
    for m in all_measured:
        print(f"\n{m.suite.name} {m.suite.version}: {m.plugins or 'plugins: (none named)'}")
        if m.suite.args:
            print("  tests chosen: " + " ".join(m.suite.args))
        for nodeid, why in m.suite.deselect:
            print(f"  deselected {nodeid}: {why}")
        print("  " + tally(m.results[REFERENCE[0]].cases) + " (in-process)")
    if listed:
        print(f"\ndifferences ({len(listed)}):")
        for d in listed:
            what = f"explained: {d.explained}" if d.explained else "UNEXPLAINED"
            judged = "" if d.mode in JUDGED else " (not judged)"
            print(f"  [{d.suite}] {d.mode}{judged}: {d.nodeid}: in-process {d.was}, {d.now}")
            print(f"      {d.message or '(no message)'} -- {what}")
    else:
        print("\nno differences: every test's outcome is the same in every mode")
    for m, result in broken:
        print(f"\n{m.suite.name}, {result.mode}: pytest exited {result.rc}; its output's tail:")
        print(tail(result.output, 20))
    print("\ncoverage of configuration features:")
    for feature, what in FEATURES.items():
        names = [m.suite.name for m in all_measured if feature in m.suite.covers]
        print(f"  {feature:<24}{', '.join(names) or 'NOT COVERED'}  ({what})")
    return unexplained


def tally(cases: dict[str, Case]) -> str:
    counts: dict[str, int] = {}
    for case in cases.values():
        counts[case.outcome] = counts.get(case.outcome, 0) + 1
    return ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--suite", help=f"comma-separated suites, of {', '.join(SUITES)} (default: all)"
    )
    parser.add_argument(
        "--fastest", type=int, metavar="N", help="only the N fastest suites (by Suite.seconds)"
    )
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"comma-separated modes besides in-process, of {', '.join(MODES)} (default: all)",
    )
    parser.add_argument(
        "--cache",
        type=Path,
        default=Path.home() / ".cache" / "pytest-gpuiso-bench" / "fidelity",
        help="where the venvs, sdists and extracted suites are kept",
    )
    parser.add_argument(
        "--plugin",
        metavar="PATH_OR_SPEC",
        help="what to install as the plugin: a checkout (its wheel is built), a wheel or a pip "
        "requirement (default: a wheel built from this checkout)",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="limit per command, s (1800)")
    opts = parser.parse_args()
    if opts.suite and opts.fastest is not None:
        parser.error("--suite and --fastest exclude each other")
    if opts.suite:
        names = [n.strip() for n in opts.suite.split(",") if n.strip()]
        unknown = [n for n in names if n not in SUITES]
        if unknown or not names:
            parser.error(
                f"--suite: unknown {', '.join(unknown) or 'none'}; known: {', '.join(SUITES)}"
            )
    elif opts.fastest is not None:
        if opts.fastest < 1:
            parser.error("--fastest must be at least 1")
        names = sorted(SUITES, key=lambda n: SUITES[n].seconds)[: opts.fastest]
    else:
        names = list(SUITES)
    modes = [m.strip() for m in opts.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown {', '.join(unknown)}; known: {', '.join(MODES)}")
    try:
        failed = run_all([SUITES[n] for n in names], modes, opts)
    except StepFailed as exc:
        if exc.output:
            print(f"--- output tail ---\n{tail(exc.output)}\n---", file=sys.stderr)
        print(f"fidelity.py: {exc.line}", file=sys.stderr)
        sys.exit(2)
    except OSError as exc:
        print(f"fidelity.py: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit("fidelity.py: interrupted")
    sys.exit(1 if failed else 0)


def run_all(suites: list[Suite], modes: list[str], opts) -> bool:
    cache = opts.cache.expanduser().resolve()
    cache.mkdir(parents=True, exist_ok=True)
    plugin = plugin_wheel(cache, Path(sys.executable), opts.plugin)
    print(
        f"plugin: {plugin}; suites: {', '.join(s.name for s in suites)}; modes: in-process, "
        + ", ".join(modes)
    )
    print(f"machine: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}", flush=True)
    measured = []
    with tempfile.TemporaryDirectory(prefix="fidelity-") as tmp:
        for suite in suites:
            measured.append(measure(suite, cache, plugin, modes, Path(tmp), opts))
    return print_report(measured, modes)


if __name__ == "__main__":
    main()
