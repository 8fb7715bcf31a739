#!/usr/bin/env python3
"""Hunt flaky tests: run the README's test command on fresh clones, under several loads.

Each run clones this checkout at the commit HEAD was at its start into a scratch folder, makes the
README's venv there (``python3 -m venv .venv && .venv/bin/pip install -e ".[test]"``) and
runs ``.venv/bin/pytest`` with a JUnit XML report, optionally beside CPU hogs, with
pytest-randomly's shuffling or with more xdist workers than cores. At the end it prints
each run (load, seed, time, result) and how many runs each failing test failed in.

    python3 .ci/flakes.py                        # the standard mix: 3 quiet, 3 with two
                                                 # CPU hogs, 2 randomly, 1 with -n 8
    python3 .ci/flakes.py --plan hogs,n8+hogs    # a mix of your own
    python3 .ci/flakes.py --plan quiet*4 -k lease

A plan entry is ``+``-joined words: ``quiet``, ``hogs`` (two ``yes >/dev/null`` beside
pytest), ``randomly`` (``-p randomly`` with a fresh seed, printed), ``nN`` (``-n N``);
``entry*K`` repeats it. Logs and reports stay in --out (default: a new folder in $TMPDIR).
The exit status is 1 when any run failed.
"""

from __future__ import annotations

import argparse
import collections
import random
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STANDARD = "quiet*3,hogs*3,randomly*2,n8"


@dataclass
class Run:
    label: str
    hogs: int = 0
    seed: int | None = None
    workers: int | None = None
    seconds: float = 0.0
    rc: int | None = None
    summary: str = ""
    failed: list[str] = field(default_factory=list)

    def pytest_args(self) -> list[str]:
        args = ["-rfE"]
        if self.seed is not None:
            # tox.ini's addopts turn pytest-randomly off for the suite; this turns it on
            args += ["-p", "randomly", f"--randomly-seed={self.seed}"]
        if self.workers is not None:
            args += ["-n", str(self.workers)]
        return args


def parse_plan(text: str) -> list[Run]:
    runs = []
    for entry in filter(None, (part.strip() for part in text.split(","))):
        words, _, times = entry.partition("*")
        for _ in range(int(times or 1)):
            run = Run(label=words)
            for word in words.split("+"):
                if word == "quiet":
                    pass
                elif word == "hogs":
                    run.hogs = 2
                elif word == "randomly":
                    run.seed = random.randrange(2**32)
                elif word[:1] == "n" and word[1:].isdigit():
                    run.workers = int(word[1:])
                else:
                    raise SystemExit(f"flakes: unknown plan word {word!r} in {entry!r}")
            runs.append(run)
    if not runs:
        raise SystemExit("flakes: the plan is empty")
    return runs


def failures(junit: Path) -> list[str]:
    """The node ids of the failed and errored tests of a JUnit XML report."""
    if not junit.exists():
        return []
    found = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            module = case.get("classname", "").replace(".", "/")
            found.append(f"{module}.py::{case.get('name')}")
    return found


def sh(command: str, cwd: Path, log) -> int:
    log.write(f"$ {command}\n")
    log.flush()
    return subprocess.run(
        command, shell=True, cwd=cwd, stdout=log, stderr=subprocess.STDOUT
    ).returncode


def one(run: Run, index: int, out: Path, commit: str, extra: list[str]) -> None:
    clone = out / f"run{index}"
    log_path = out / f"run{index}.log"
    junit = out / f"run{index}.xml"
    with open(log_path, "w") as log:
        clone_it = f"git clone -q {shlex.quote(str(ROOT))} {shlex.quote(str(clone))}"
        if sh(f"{clone_it} && git -C {shlex.quote(str(clone))} checkout -q {commit}", out, log):
            raise SystemExit(f"flakes: git clone failed, see {log_path}")
        if sh('python3 -m venv .venv && .venv/bin/pip install -q -e ".[test]"', clone, log):
            raise SystemExit(f"flakes: the install failed, see {log_path}")
        hogs = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(run.hogs)]
        args = [*run.pytest_args(), f"--junitxml={junit}", *extra]
        started = time.monotonic()
        try:
            run.rc = sh(".venv/bin/pytest " + shlex.join(args), clone, log)
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
        run.seconds = time.monotonic() - started
    tail = log_path.read_text(errors="replace").rstrip().splitlines()
    run.summary = tail[-1].strip("= ") if tail else ""
    run.failed = failures(junit)
    subprocess.run(["rm", "-rf", str(clone)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", default=STANDARD, help=f"the runs (default {STANDARD})")
    parser.add_argument("--out", type=Path, help="where logs and reports go")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    options = parser.parse_args()
    runs = parse_plan(options.plan)
    out = options.out or Path(tempfile.mkdtemp(prefix="gpuiso-flakes."))
    out.mkdir(parents=True, exist_ok=True)
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    print(f"flakes: {len(runs)} runs of HEAD {head}; logs in {out}", flush=True)
    for index, run in enumerate(runs, 1):
        one(run, index, out, head, options.pytest_args)
        seed = f" seed {run.seed}" if run.seed is not None else ""
        print(
            f"run {index}: {run.label}{seed}: rc {run.rc} in {run.seconds:.0f} s: {run.summary}",
            flush=True,
        )
        for nodeid in run.failed:
            print(f"    FAILED {nodeid}", flush=True)
    counts = collections.Counter(nodeid for run in runs for nodeid in run.failed)
    print(f"\nflakes: {sum(run.rc != 0 for run in runs)} of {len(runs)} runs failed")
    for nodeid, count in counts.most_common():
        print(f"  {count}/{len(runs)}  {nodeid}")
    return 1 if any(run.rc for run in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
