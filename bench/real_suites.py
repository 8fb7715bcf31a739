"""Isolation's cost on real test suites: in-process and isolated, side by side in one run.

Fetches the pinned sdists of a few projects that ship their tests (opt_einsum 3.4.0,
einops 0.8.2, linear_operator 0.6), extracts them, and runs chosen test files or folders
of each (a few slow tests deselected, each suite says why) from the extracted tree, in a
venv of its own: the plugin (a wheel built from this checkout, or ``--plugin
PATH_OR_SPEC``), numpy, and torch 2.13.0's CPU build where this machine has a file of it
(``pip download --no-index``, as .ci/run's ML stage); what else a suite's tests import
(linear_operator's: scipy, jaxtyping, mpmath) goes into a folder of that suite's own on
its PYTHONPATH, so that the plugins loaded are ours and pytest's (and, for that suite
only, jaxtyping's). The venv, the sdists, their trees and those folders
are kept under ``--cache DIR`` (default ~/.cache/pytest-gpuiso-bench) and reused; the
plugin is reinstalled every run. It downloads, so it is not part of CI.

Each suite runs in every configuration once per round, in an order rotated from round
to round so that drift hits all of them alike:

* in-process: ``--no-gpu-isolate``;
* forkserver: ``--gpu-isolate --gpu-isolate-start=forkserver`` (default prewarming), with
  no pytest cache: what the tests import is learnt during the run only (a fresh CI job);
* forkserver+cache: the same with pytest's cache (``-o cache_dir=``, a directory of its
  own per suite), which an untimed run of that configuration fills first: what earlier
  runs' tests imported is imported by the template's successor at once (a developer's
  second run, or CI that keeps ``.pytest_cache``);
* spawn: ``--gpu-isolate --gpu-isolate-start=spawn``, only with ``--spawn`` (slow).

Every run has ``-q`` and ``--junitxml``, and ``-p no:cacheprovider`` but with the cache;
the isolated ones also ``--gpu-isolate-report``. An untimed in-process run of each suite
comes first: it checks that the suite runs and shows pytest's header (the plugins loaded).

Prints, per suite and configuration, the wall time of the whole pytest run (best of
--repeat rounds, and the worst), its ratio to in-process, the overhead per test
((isolated - in-process) / tests, best rounds), and medians over every test of every
round: junit's time of a test (setup, call and teardown) and, for the isolated runs,
the JSON report's ``duration`` (the same), ``startup`` (from the test's turn until its
protocol began), ``wall`` (until its process had ended) and ``after`` (wall - startup -
duration: from the test's end until its process had ended); then how the isolated
tests' processes started, and each test whose outcome (junit's passed, failed, error,
skipped or xfailed) differs from in-process in some round, or "outcomes identical".
The load average is printed before and after each round. A step that fails (no
download, a venv that does not build, pytest exiting with a status above 1) ends the
run with one line and its command's output tail.

    python bench/real_suites.py [--suite opt_einsum,einops] [--repeat 3] [--spawn]
                                [--cache DIR] [--plugin PATH_OR_SPEC | --python PATH]
                                [--files PATH,...] [--timeout S]

On a machine without a network (the GPU machine), ``--python`` runs the suites with an
interpreter that has everything already, from trees copied under ``--cache DIR/src``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

# python bench/real_suites.py puts bench/ first on sys.path: overhead.py's runner is shared.
from overhead import run as run_command
from overhead import tail

ROOT = Path(__file__).resolve().parent.parent
TORCH = "torch==2.13.0"  # its CPU build, as .ci/run's ML stage installs it


@dataclass(frozen=True)
class Suite:
    name: str  # the distribution, as pip names it
    version: str
    files: tuple[str, ...]  # test files or folders, relative to the extracted sdist's root
    env: tuple[tuple[str, str], ...] = ()  # what its tests need in the environment
    deselect: tuple[str, ...] = ()  # node ids left out (--deselect), and why in a comment
    # What else its tests import, installed into a folder of its own on its PYTHONPATH
    # only (pip --target), so that the other suites' runs load the same plugins as before.
    requires: tuple[str, ...] = ()


SUITES = {
    suite.name: suite
    for suite in (
        # The whole of tests/ is ~9,000 tests, mostly test_contract's; these two are ~225.
        Suite(
            "opt_einsum",
            "3.4.0",
            ("opt_einsum/tests/test_paths.py", "opt_einsum/tests/test_backends.py"),
        ),
        # The backends tested are named in EINOPS_TEST_BACKENDS; numpy and torch are the
        # ordinary ML environment's (jax, tensorflow, paddle... are not installed, and
        # their tests skip). The three torch.compile tests take ~10 s of the suite's
        # ~14 s, and vary from run to run by more than isolation costs the other 63.
        Suite(
            "einops",
            "0.8.2",
            ("einops/tests",),
            (("EINOPS_TEST_BACKENDS", "numpy,torch"),),
            (
                "einops/tests/test_ops.py::test_torch_compile_with_dynamic_shape",
                "einops/tests/test_other.py::test_torch_compile_for_functions",
                "einops/tests/test_other.py::test_torch_compile_for_layers",
            ),
        ),
        # GPyTorch's linear algebra: 4,795 tests in test/operators, mostly fast; these four
        # files are 574. jaxtyping brings a pytest plugin of its own (in the header).
        Suite(
            "linear_operator",
            "0.6",
            tuple(
                f"test/operators/test_{name}_linear_operator.py"
                for name in ("diag", "dense", "identity", "zero")
            ),
            requires=("scipy==1.17.1", "jaxtyping==0.3.11", "mpmath==1.3.0"),
        ),
    )
}


class StepFailed(Exception):
    """A step of the benchmark failed: its one line, and the output tail to show under it."""

    def __init__(self, line: str, output: str = "") -> None:
        super().__init__(line)
        self.line = line
        self.output = output


@dataclass
class Config:
    label: str
    args: list[str]
    isolated: bool
    cached: bool = False  # with pytest's cache, filled by an untimed run first
    walls: list[float] = field(default_factory=list)  # s, one a round
    outcomes: list[dict[str, str]] = field(default_factory=list)  # one a round
    junit_times: list[float] = field(default_factory=list)  # s, every test of every round
    records: list[dict] = field(default_factory=list)  # JSON report records, every round


def run(
    cmd: list[str], timeout: float, cwd: Path | None = None, env: dict[str, str] | None = None
) -> tuple[float, int, str]:
    """Run ``cmd``; return (seconds, exit status, output). Its session is killed on timeout."""
    seconds, rc, out = run_command(cmd, cwd, env, timeout)
    if rc is None:
        raise StepFailed(f"timed out after {timeout:g} s: {shlex.join(cmd)}", out)
    return seconds, rc, out


def step(what: str, cmd: list[str], timeout: float = 1800, **kwargs) -> str:
    """Run a preparation step that must succeed; its output."""
    _, rc, out = run(cmd, timeout, **kwargs)
    if rc != 0:
        raise StepFailed(f"{what} failed (exit status {rc}): {shlex.join(cmd)}", out)
    return out


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


# -- the environment ---------------------------------------------------------------------


def prepare_venv(cache: Path, plugin: str | None, with_torch: bool) -> Path:
    """The venv's python: created once, numpy (and torch) installed once, the plugin each run."""
    venv = cache / f"venv-py{sys.version_info.major}.{sys.version_info.minor}"
    python = venv / "bin" / "python"
    wanted = ["numpy", *([TORCH] if with_torch else [])]
    ready = venv / "bench-installed.txt"  # what was installed into it, once it all was
    if not (python.exists() and ready.exists() and ready.read_text().split() == wanted):
        shutil.rmtree(venv, ignore_errors=True)
        step("creating the venv", [sys.executable, "-m", "venv", str(venv)])
        step("installing " + ", ".join(wanted), [str(python), "-m", "pip", "install", *wanted])
        ready.write_text("\n".join(wanted) + "\n")
    plugin = plugin_wheel(cache, python, plugin)
    pip = [str(python), "-m", "pip", "install"]
    step(f"installing the plugin ({plugin})", [*pip, plugin])  # and its dependencies
    # The same version string may name another build: this run's replaces the installed one.
    step(f"reinstalling the plugin ({plugin})", [*pip, "--force-reinstall", "--no-deps", plugin])
    return python


def plugin_wheel(cache: Path, python: Path, plugin: str | None) -> str:
    """What to install as the plugin: ``plugin`` itself (a wheel or a pip requirement), or
    the wheel built (by ``python``'s pip) from the checkout ``plugin`` names (default: this
    one), under ``cache``."""
    if plugin is not None and not Path(plugin).is_dir():
        return plugin
    source = Path(plugin or ROOT).resolve()
    wheels = cache / "plugin-wheel"
    shutil.rmtree(wheels, ignore_errors=True)
    step(
        f"building the plugin's wheel from {source}",
        [str(python), "-m", "pip", "wheel", "--no-deps", "-w", str(wheels), str(source)],
    )
    found = sorted(wheels.glob("*.whl"))
    if len(found) != 1:
        raise StepFailed(f"building the plugin's wheel left {len(found)} wheels in {wheels}")
    return str(found[0])


def torch_available(cache: Path) -> bool:
    """Whether this machine has a file of torch's CPU build (the registry's brings CUDA's)."""
    _, rc, _ = run(
        [sys.executable, "-m", "pip", "download", "--no-index", "--no-deps"]
        + ["-d", str(cache / "torch"), TORCH],
        timeout=600,
    )
    return rc == 0


def sdist_of(cache: Path, python: Path, suite: Suite) -> Path:
    """The sdist of ``suite`` (``name`` and ``version``), downloaded once under ``cache``."""
    sdists = cache / "sdists"
    wanted = f"{suite.name}-{suite.version}.tar.gz".lower().replace("-", "_")

    def found() -> list[Path]:
        return [p for p in sdists.glob("*.tar.gz") if p.name.lower().replace("-", "_") == wanted]

    if not found():
        spec = f"{suite.name}=={suite.version}"
        step(
            f"downloading the sdist of {spec}",
            [str(python), "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
            + ["-d", str(sdists), spec],
        )
    if not found():
        raise StepFailed(f"pip downloaded no {suite.name}-{suite.version}.tar.gz into {sdists}")
    return found()[0]


def fetch_suite(cache: Path, python: Path, suite: Suite) -> Path:
    """The extracted sdist of ``suite`` (downloaded and extracted once)."""
    tree = cache / "src" / f"{suite.name}-{suite.version}"
    if tree.is_dir():
        return tree
    sdist = sdist_of(cache, python, suite)
    staging = Path(tempfile.mkdtemp(prefix="extract-", dir=cache))
    try:
        with tarfile.open(sdist) as archive:
            if hasattr(tarfile, "data_filter"):  # no links or paths out of the tree
                archive.extractall(staging, filter="data")
            else:
                archive.extractall(staging)
        tops = list(staging.iterdir())
        if len(tops) != 1 or not tops[0].is_dir():
            raise StepFailed(f"{sdist.name} does not hold one top folder")
        tree.parent.mkdir(parents=True, exist_ok=True)
        tops[0].rename(tree)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return tree


def versions(python: Path) -> str:
    code = (
        "import importlib.metadata as m, platform\n"
        "def v(d):\n"
        "    try:\n"
        "        return m.version(d)\n"
        "    except m.PackageNotFoundError:\n"
        "        return 'not installed'\n"
        "print(f'Python {platform.python_version()}, ' + ', '.join(\n"
        "    f'{d} {v(d)}' for d in ('pytest', 'pytest-gpuiso', 'numpy', 'torch')))\n"
    )
    return step("reading the venv's versions", [str(python), "-c", code]).strip()


# -- the runs ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One test case of a junit XML: its outcome and, if it has one, junit's message."""

    outcome: str  # passed, failed, error, skipped or xfailed; several joined by "+"
    message: str  # the first failure's, error's or skip's message ("" for a pass)


def junit_cases(junit: Path) -> tuple[dict[str, Case], list[float]]:
    """Each test's case (by ``classname::name``) and junit's times, in the file's order."""
    try:
        tree = ET.parse(junit)
    except (OSError, ET.ParseError) as exc:
        raise StepFailed(f"could not read the junit XML {junit}: {exc}") from None
    seen: dict[str, set[str]] = {}
    messages: dict[str, str] = {}
    times = []
    for case in tree.iter("testcase"):
        nodeid = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = set()
        for child in case:
            if child.tag == "failure":
                kinds.add("failed")
            elif child.tag == "error":
                kinds.add("error")
            elif child.tag == "skipped":
                kinds.add("xfailed" if child.get("type") == "pytest.xfail" else "skipped")
            else:
                continue
            if not messages.get(nodeid):
                messages[nodeid] = child.get("message") or (child.text or "").strip()
        seen.setdefault(nodeid, set()).update(kinds or {"passed"})
        times.append(float(case.get("time", "0")))
    cases = {k: Case("+".join(sorted(v)), messages.get(k, "")) for k, v in seen.items()}
    return cases, times


def outcomes_of(junit: Path) -> tuple[dict[str, str], list[float]]:
    """Each test's outcome (passed, failed, error, skipped, xfailed) and junit's times."""
    cases, times = junit_cases(junit)
    return {k: case.outcome for k, case in cases.items()}, times


def suite_env(python: Path, tree: Path, suite: Suite) -> dict[str, str]:
    """The environment of a suite's pytest: as if its venv were active and the suite installed.

    Tests that start ``python`` or import the package in a subprocess (einops'
    threading test) then find the venv's interpreter and the extracted package.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTHONPATH")}
    env["PATH"] = f"{python.parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *map(str, requirements(tree, suite))])
    env.update(suite.env)
    return env


def requirements(tree: Path, suite: Suite) -> list[Path]:
    """The folder ``suite.requires`` is installed into (none when it requires nothing)."""
    return [tree.parent / f"{tree.name}-requires"] if suite.requires else []


def install_requirements(python: Path, tree: Path, suite: Suite) -> None:
    """Install ``suite.requires`` into its folder once (numpy and torch are the venv's)."""
    for folder in requirements(tree, suite):
        ready = folder / "bench-installed.txt"
        if ready.exists() and ready.read_text().split() == list(suite.requires):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        pip = [str(python), "-m", "pip", "install", "--target", str(folder), *suite.requires]
        step(f"installing what {suite.name}'s tests import: " + ", ".join(suite.requires), pip)
        for duplicate in folder.glob("numpy*"):  # the venv's numpy, not a second one
            shutil.rmtree(duplicate, ignore_errors=True)
        ready.write_text("\n".join(suite.requires) + "\n")


def run_suite(
    python: Path,
    tree: Path,
    suite: Suite,
    files: list[str],
    cfg: Config,
    work: Path,
    opts,
    timed: bool = True,
) -> tuple[float, str]:
    """One timed pytest run of ``suite`` under ``cfg``: its wall seconds and output
    (``timed=False``: nothing of it is kept)."""
    junit = work / f"{suite.name}-{cfg.label}.xml"
    report = work / f"{suite.name}-{cfg.label}.json"
    for path in (junit, report):
        path.unlink(missing_ok=True)
    cmd = [str(python), "-m", "pytest", "-q", f"--junitxml={junit}"]
    cache = work / f"cache-{suite.name}"
    cmd += [f"-ocache_dir={cache}"] if cfg.cached else ["-pno:cacheprovider"]
    cmd += cfg.args
    if cfg.isolated:
        cmd.append(f"--gpu-isolate-report={report}")
    cmd += files
    seconds, rc, out = run(cmd, opts.timeout, cwd=tree, env=suite_env(python, tree, suite))
    if rc not in (0, 1):  # 1: some tests failed, which the outcomes show
        raise StepFailed(f"{suite.name}, {cfg.label}: pytest exited {rc}: {shlex.join(cmd)}", out)
    if not timed:
        return seconds, out
    outcomes, times = outcomes_of(junit)
    cfg.walls.append(seconds)
    cfg.outcomes.append(outcomes)
    cfg.junit_times += times
    if cfg.isolated:
        try:
            cfg.records += json.loads(report.read_text())["tests"]
        except (OSError, ValueError, KeyError) as exc:
            raise StepFailed(f"{suite.name}, {cfg.label}: no JSON report: {exc}", out) from None
    return seconds, out


def header(python: Path, tree: Path, suite: Suite, files: list[str], opts) -> list[str]:
    """An untimed in-process run (it must run): pytest's header lines that name what ran."""
    cmd = [str(python), "-m", "pytest", "-p", "no:cacheprovider", "--no-gpu-isolate", *files]
    _, rc, out = run(cmd, opts.timeout, cwd=tree, env=suite_env(python, tree, suite))
    if rc not in (0, 1):
        raise StepFailed(f"{suite.name}: the untimed run exited {rc}: {shlex.join(cmd)}", out)
    keep = ("platform ", "rootdir:", "configfile:", "plugins:", "gpuiso", "collected ")
    return [line for line in out.splitlines() if line.startswith(keep)]


# -- the table ---------------------------------------------------------------------------


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.2f}" if values else "-"


def started(records: list[dict]) -> str:
    counts: dict[str, int] = {}
    for r in records:
        method = (r.get("start") or {}).get("method") or "none"
        counts[method] = counts.get(method, 0) + 1
    prewarmed = sum(1 for r in records if (r.get("start") or {}).get("prewarmed"))
    collected = sum(1 for r in records if (r.get("start") or {}).get("collected"))
    parts = [f"{n} {method}" for method, n in sorted(counts.items())]
    text = ", ".join(parts) + f"; {prewarmed} prewarmed; {collected} forked from the template"
    return text + " (every round)"


def counts(outcomes: dict[str, str]) -> str:
    tally: dict[str, int] = {}
    for outcome in outcomes.values():
        tally[outcome] = tally.get(outcome, 0) + 1
    return ", ".join(f"{n} {outcome}" for outcome, n in sorted(tally.items()))


def differences(configs: list[Config]) -> list[str]:
    """Tests whose outcome in some round differs from in-process's first round."""
    reference = configs[0].outcomes[0]
    lines = []
    for cfg in configs:
        for r, outcomes in enumerate(cfg.outcomes):
            for nodeid in sorted(set(reference) | set(outcomes)):
                was, now = reference.get(nodeid, "absent"), outcomes.get(nodeid, "absent")
                if was != now:
                    lines.append(f"{nodeid}: in-process {was}, {cfg.label} {now} (round {r + 1})")
    return lines


def print_table(results: list[tuple[Suite, list[Config]]], repeat: int) -> None:
    print()
    print(
        f"{'suite':<12}{'tests':>6}  {'configuration':<16}{'wall s':>8}{'worst s':>9}"
        f"{'x in-proc':>11}{'overhead/test':>15}{'junit':>8}{'duration':>10}{'startup':>9}"
        f"{'wall':>8}{'after':>8}"
    )
    for suite, configs in results:
        tests = len(configs[0].outcomes[0])
        inproc = min(configs[0].walls)
        for cfg in configs:
            wall = min(cfg.walls)
            line = (
                f"{suite.name if cfg is configs[0] else '':<12}"
                f"{tests if cfg is configs[0] else '':>6}  {cfg.label:<16}"
                f"{wall:>8.2f}{max(cfg.walls):>9.2f}{wall / inproc:>10.2f}x"
            )
            per_test = f"{(wall - inproc) / tests * 1000:.1f} ms" if cfg.isolated else "-"
            line += f"{per_test:>15}{ms(cfg.junit_times):>8}"
            if cfg.isolated:
                recs = [r for r in cfg.records if r.get("startup") is not None]
                after = [r["wall"] - r["startup"] - r["duration"] for r in recs]
                line += f"{ms([r['duration'] for r in recs]):>10}"
                line += f"{ms([r['startup'] for r in recs]):>9}{ms([r['wall'] for r in recs]):>8}"
                line += f"{ms(after):>8}"
            print(line)
    print(
        f"wall: the whole pytest run, best of {repeat} round{'s' if repeat != 1 else ''} "
        "(worst beside it); overhead/test: (wall - in-process wall) / tests; the rest are "
        "medians over every test of every round, in ms: junit's time of a test, and the JSON "
        "report's duration, startup, wall and after (= wall - startup - duration)"
    )
    for suite, configs in results:
        print(f"\n{suite.name}:")
        for cfg in configs:
            print(f"  {cfg.label}: {counts(cfg.outcomes[-1])} (last round)")
        for cfg in configs[1:]:
            print(f"  {cfg.label} started: {started(cfg.records)}")
        diffs = differences(configs)
        if diffs:
            print(f"  outcomes differ ({len(diffs)}):")
            for line in diffs[:40]:
                print(f"    {line}")
            if len(diffs) > 40:
                print(f"    ... and {len(diffs) - 40} more")
        else:
            rounds = sum(len(c.outcomes) for c in configs)
            print(f"  outcomes identical (every test, {rounds} runs)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--suite",
        default=",".join(SUITES),
        help=f"comma-separated suites to run, of {', '.join(SUITES)} (default: all)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="rounds; the best is kept (3)")
    parser.add_argument("--spawn", action="store_true", help="also time spawn (slow)")
    parser.add_argument(
        "--cache",
        type=Path,
        default=Path.home() / ".cache" / "pytest-gpuiso-bench",
        help="where the venv, sdists and extracted suites are kept (~/.cache/pytest-gpuiso-bench)",
    )
    parser.add_argument(
        "--plugin",
        metavar="PATH_OR_SPEC",
        help="what to install as the plugin: a checkout (its wheel is built), a wheel or a pip "
        "requirement (default: a wheel built from this checkout)",
    )
    parser.add_argument(
        "--files",
        help="comma-separated test files, relative to the sdist's root, instead of the suite's "
        "own (with one --suite only)",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="limit per command, s (1800)")
    parser.add_argument(
        "--python",
        type=Path,
        help="run the suites with this interpreter as it is: no venv, nothing installed or "
        "downloaded (the plugin and what the suites import must be there already, their "
        "trees under --cache): a machine without a network, such as a GPU machine",
    )
    opts = parser.parse_args()
    names = [n.strip() for n in opts.suite.split(",") if n.strip()]
    unknown = [n for n in names if n not in SUITES]
    if unknown or not names:
        parser.error(f"--suite: unknown {', '.join(unknown) or 'none'}; known: {', '.join(SUITES)}")
    if opts.files and len(names) != 1:
        parser.error("--files needs exactly one --suite")
    if opts.repeat < 1:
        parser.error("--repeat must be at least 1")
    try:
        measure_all([SUITES[n] for n in names], opts)
    except StepFailed as exc:
        if exc.output:
            print(f"--- output tail ---\n{tail(exc.output)}\n---", file=sys.stderr)
        sys.exit(f"real_suites.py: {exc.line}")
    except OSError as exc:
        sys.exit(f"real_suites.py: {exc}")
    except KeyboardInterrupt:
        sys.exit("real_suites.py: interrupted")


def measure_all(suites: list[Suite], opts) -> None:
    cache = opts.cache.expanduser().resolve()
    cache.mkdir(parents=True, exist_ok=True)
    if opts.python:
        python, with_torch = opts.python, True
    else:
        with_torch = torch_available(cache)
        python = prepare_venv(cache, opts.plugin, with_torch)
    trees = {suite.name: fetch_suite(cache, python, suite) for suite in suites}
    for suite in suites if not opts.python else ():
        install_requirements(python, trees[suite.name], suite)
    print(f"python: {python}: {versions(python)}")
    if not with_torch:
        print(f"no CPU build of {TORCH} on this machine: the venv has numpy without torch")
    print(f"machine: {os.cpu_count()} CPUs, {load()}")
    results = []
    files = {}
    for suite in suites:
        tree = trees[suite.name]
        chosen = opts.files.split(",") if opts.files else list(suite.files)
        missing = [f for f in chosen if not (tree / f).exists()]
        if missing:
            raise StepFailed(f"{suite.name} {suite.version}'s sdist has no {', '.join(missing)}")
        files[suite.name] = chosen + [f"--deselect={d}" for d in suite.deselect]
        print(f"\n{suite.name} {suite.version}: {shlex.join(files[suite.name])}")
        if suite.env:
            print("  env: " + " ".join(f"{k}={v}" for k, v in suite.env))
        for line in header(python, tree, suite, chosen, opts):
            print(f"  {line}")
        configs = [
            Config("in-process", ["--no-gpu-isolate"], isolated=False),
            Config(
                "forkserver", ["--gpu-isolate", "--gpu-isolate-start=forkserver"], isolated=True
            ),
            Config(
                "forkserver+cache",
                ["--gpu-isolate", "--gpu-isolate-start=forkserver"],
                isolated=True,
                cached=True,
            ),
        ]
        if opts.spawn:
            configs.append(
                Config("spawn", ["--gpu-isolate", "--gpu-isolate-start=spawn"], isolated=True)
            )
        results.append((suite, configs))
    sys.stdout.flush()
    with tempfile.TemporaryDirectory(prefix="real-suites-") as tmp:
        work = Path(tmp)
        for suite, configs in results:  # fills the cache of the configurations that keep one
            tree, chosen = trees[suite.name], files[suite.name]
            for cfg in configs:
                if cfg.cached:
                    run_suite(python, tree, suite, chosen, cfg, work, opts, timed=False)
        for r in range(opts.repeat):
            print(f"round {r + 1}/{opts.repeat}: {load()}", file=sys.stderr, flush=True)
            for suite, configs in results:
                k = r % len(configs)
                for cfg in configs[k:] + configs[:k]:
                    seconds, _ = run_suite(
                        python, trees[suite.name], suite, files[suite.name], cfg, work, opts
                    )
                    print(f"  {suite.name}, {cfg.label}: {seconds:.2f} s", file=sys.stderr)
        print(f"after the last round: {load()}", file=sys.stderr, flush=True)
    print_table(results, opts.repeat)


if __name__ == "__main__":
    main()
