"""Every command-line option and ini key of pytest-gpuiso, from one table.

Each ``Option`` is one setting: its ini key (also the option's ``dest``), its ini
type, the flag(s) that set it on the command line, the default shown in ``--help``,
the help text, the ``Settings`` field it fills, its parser (from ``values``) and
its value where it is given nowhere. ``add_options`` turns the table into
``parser.addoption`` and ``parser.addini`` calls, so a setting cannot have a flag
without an ini key, or differ in name or help between the two;
``settings.read_settings`` turns it into ``Settings`` in one loop: no second list.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from .values import (
    DEFAULT_GRACE,
    DEFAULT_PREWARM,
    DEFAULT_RANK_WAIT,
    DEFAULT_SLOTS,
    DEFAULT_STARTUP_TIMEOUT,
    DEFAULT_TIMEOUT,
    KINDS,
    MAX_GPUS,
    MAX_SLOTS,
    default_start,
    parse_annotations,
    parse_devices,
    parse_flag,
    parse_health,
    parse_int,
    parse_leaks,
    parse_memory,
    parse_mode,
    parse_path,
    parse_patterns,
    parse_preload,
    parse_seconds,
    parse_start,
    parse_warnings,
    torch_if_installed,
)
from .values import DEFAULT_TOLERANCE_MIB as DEFAULT_TOLERANCE

Parser = Callable[[Any, str], Any]  # (the value as given, where it came from) -> the field's


def _seconds(*, allow_zero: bool, **bounds: Any) -> Parser:
    return functools.partial(parse_seconds, allow_zero=allow_zero, **bounds)


def _integer(low: int, high: int) -> Parser:
    return functools.partial(parse_int, low=low, high=high)


@dataclass(frozen=True)
class Option:
    name: str  # the ini key, and the option's dest
    help: str
    field: str | tuple[str, ...]  # the Settings field it fills (a tuple: the parser's, in order)
    parse: Parser = parse_flag
    unset: Any = None  # the field's value where it is given nowhere; a callable: called then
    source: str = ""  # a Settings field that keeps where the value came from ("": not given)
    type: str = "string"  # the ini type: string, bool or args
    metavar: str | None = None  # a value option's metavar; None: a flag (or ini only)
    default: str = ""  # shown in --help (``unset`` is the default applied)
    flag: str | None = ""  # the flag that sets it true; "": --name; None: none
    negative: str | None = None  # a bool's flag that sets it false
    negative_help: str = ""
    ini_default: bool | None = None  # a bool's default in the ini file

    @property
    def cli(self) -> str | None:
        if self.flag is None:
            return None
        return self.flag or "--" + self.name.replace("_", "-")

    def option_help(self) -> str:
        default = f"default {self.default}; " if self.default else ""
        return f"{self.help} ({default}ini: {self.name})."


OPTIONS: tuple[Option, ...] = (
    Option(
        "gpu_isolate",
        "run every test in a fresh process",
        field="mode",
        parse=parse_mode,
        type="bool",
        ini_default=False,
        negative="--no-gpu-isolate",
        negative_help="run every test in-process, marked tests included (e.g. for --pdb).",
    ),
    Option(
        "gpu_isolate_timeout",
        "timeout in seconds of an isolated test's setup, call and teardown, as pytest-timeout's",
        field="timeout",
        parse=_seconds(allow_zero=False),
        source="timeout_source",
        metavar="SECONDS",
        default=f"{DEFAULT_TIMEOUT:g}, or pytest-timeout's",
    ),
    Option(
        "gpu_isolate_startup_timeout",
        "bound in seconds on an isolated test's process before its test begins (interpreter, "
        "plugins, conftests, the test module's import) and after it ends (its exit)",
        field="startup_timeout",
        parse=_seconds(allow_zero=False),
        unset=DEFAULT_STARTUP_TIMEOUT,
        metavar="SECONDS",
        default=f"{DEFAULT_STARTUP_TIMEOUT:g}",
    ),
    Option(
        "gpu_isolate_grace",
        "seconds between SIGTERM and SIGKILL on timeout",
        field="grace",
        parse=_seconds(allow_zero=True),
        unset=DEFAULT_GRACE,
        metavar="SECONDS",
        default=f"{DEFAULT_GRACE:g}",
    ),
    Option(
        "gpu_isolate_rank_wait",
        "seconds a distributed test's other ranks may still run once one rank ended, "
        "before they are stopped with their stacks (ranks=N)",
        field="rank_wait",
        parse=_seconds(allow_zero=True),
        unset=DEFAULT_RANK_WAIT,
        metavar="SECONDS",
        default=f"{DEFAULT_RANK_WAIT:g}",
    ),
    Option(
        "gpu_isolate_report",
        "write a JSON report of the isolated tests to PATH",
        field="report_path",
        parse=parse_path,
        source="report_source",
        metavar="PATH",
    ),
    Option(
        "gpu_isolate_summary",
        "write a Markdown summary (leaks, timeouts, crashes) for PR checks to PATH",
        field="summary_path",
        parse=parse_path,
        source="summary_source",
        metavar="PATH",
    ),
    Option(
        "gpu_isolate_annotations",
        "each leak, crash and timeout of an isolated test as an annotation at the test's "
        "line: GitHub Actions' workflow commands where GITHUB_ACTIONS=true (auto), always "
        "(github), or never (off)",
        field="annotations",
        parse=parse_annotations,
        unset="auto",
        metavar="auto|github|off",
        default="auto",
    ),
    Option(
        "gpu_isolate_warnings",
        "a warning that isolated tests' processes repeat (the same category, message and "
        "line: a library's warn-once, given again by each fresh process) is shown once, "
        "under the first test, with the repeats counted (once), or for every test (each)",
        field="warnings",
        parse=parse_warnings,
        unset="once",
        metavar="once|each",
        default="once",
    ),
    Option(
        "gpu_isolate_code_quality",
        "write the same findings as a GitLab Code Quality report (JSON) to PATH",
        field="code_quality_path",
        parse=parse_path,
        source="code_quality_source",
        metavar="PATH",
    ),
    Option(
        "gpu_isolate_leak_baseline",
        "known leaks (python -m pytest_gpuiso compare --write-baseline, or a JSON report): "
        "reported as known, they never fail a test; an entry that no longer leaks is "
        "reported as fixed",
        field="leak_baseline",
        parse=parse_path,
        source="leak_baseline_source",
        metavar="FILE",
    ),
    Option(
        "gpu_isolate_devices",
        "GPUs to lease: auto (CUDA_VISIBLE_DEVICES, else NVML), none, or a list of indices/UUIDs, "
        "each with an optional memory size for devices NVML cannot see (0:80GiB,1:80GiB)",
        field=("devices", "device_sizes"),
        parse=parse_devices,
        unset=(None, ()),
        source="devices_source",
        metavar="auto|none|0,1,...",
        default="auto",
    ),
    Option(
        "gpu_isolate_gpus",
        "GPUs an isolated test leases unless its marker says gpus=; 0: none (the test sees no GPU)",
        field="gpus",
        parse=_integer(0, MAX_GPUS),
        source="gpus_source",
        metavar="N",
        default="1 where there are GPUs to lease, else 0",
    ),
    Option(
        "gpu_isolate_pin_workers",
        "each xdist worker (or this pytest process without xdist) leases --gpu-isolate-gpus "
        "GPUs for its whole life, before the tests are collected, and its in-process tests see "
        "only those in CUDA_VISIBLE_DEVICES",
        field="pin_workers",
        type="bool",
        ini_default=False,
    ),
    Option(
        "gpu_isolate_slots",
        "how many isolated tests may share one GPU at once: each takes 1/N of its memory "
        "unless it declares gpu_memory",
        field="slots",
        parse=_integer(1, MAX_SLOTS),
        unset=DEFAULT_SLOTS,
        metavar="N",
        default=f"{DEFAULT_SLOTS}",
    ),
    Option(
        "gpu_isolate_gpu_memory",
        "GPU memory an isolated test leases on each of its GPUs unless its marker says "
        "gpu_memory=: bytes, a size (12GiB, 512MiB, 8GB) or a share of the GPU (25%); tests "
        "are packed onto a GPU while their leases fit its memory",
        field="gpu_memory",
        parse=parse_memory,
        metavar="SIZE",
        default="1/slots of the GPU",
    ),
    Option(
        "gpu_isolate_lease_timeout",
        "fail a test that waited longer than this many seconds for its GPUs",
        field="lease_timeout",
        parse=_seconds(allow_zero=False),
        metavar="SECONDS",
        default="wait",
    ),
    Option(
        "gpu_isolate_health",
        "when a test's GPUs are probed before anyone leases them again: after a test that "
        "held them crashed, timed out or hit a sticky CUDA error (after-failure), also the "
        "NVML part before every lease (always), or never (off); a GPU that fails is "
        "quarantined for every session of the user",
        field="health",
        parse=parse_health,
        unset="after-failure",
        metavar="off|after-failure|always",
        default="after-failure",
    ),
    Option(
        "gpu_isolate_reprobe",
        "probe a quarantined GPU again every SECONDS while the session leases, and lift its "
        "quarantine when it passes",
        field="reprobe",
        parse=_seconds(allow_zero=False),
        metavar="SECONDS",
        default="never",
    ),
    Option(
        "gpu_isolate_leaks",
        "what a leak (shm, process, gpu_memory) does: warn, fail the test, or off; "
        "per kind e.g. shm=fail,process=warn",
        field="leaks",
        parse=parse_leaks,
        unset=tuple((kind, "warn") for kind in KINDS),
        metavar="warn|fail|off|KIND=LEVEL,...",
        default="warn",
    ),
    Option(
        "gpu_isolate_gpu_tolerance",
        "GPU memory growth in MiB ignored by the leak check",
        field="gpu_tolerance_mib",
        parse=_seconds(allow_zero=True, high=math.inf, unit="MiB"),
        unset=DEFAULT_TOLERANCE,
        metavar="MiB",
        default=f"{DEFAULT_TOLERANCE:g}",
    ),
    Option(
        "gpu_isolate_torch_check",
        "in the test's process, compare torch.cuda.memory_allocated() before and after the test",
        field="torch_check",
        type="bool",
        ini_default=False,
    ),
    Option(
        "gpu_isolate_cleanup",
        "delete leaked /dev/shm entries after reporting them (only the current user's, "
        "created during that test)",
        field="cleanup",
        type="bool",
        ini_default=False,
    ),
    Option(
        "gpu_isolate_shm_ignore",
        "glob patterns of /dev/shm names never reported as leaks",
        field="shm_ignore",
        parse=parse_patterns,
        unset=(),
        type="args",
        flag=None,
    ),
    Option(
        "gpu_isolate_start",
        "how isolated processes start: spawn a new interpreter, or fork them from a server "
        "that has imported pytest, the plugins, the conftests and the preload modules and "
        "never touched CUDA",
        field=("start", "start_why"),
        parse=parse_start,
        unset=default_start,
        metavar="spawn|forkserver",
        default="forkserver on Linux, spawn where it is not safe (not Linux, a sanitizer)",
    ),
    Option(
        "gpu_isolate_preload",
        "modules the fork server and prewarmed processes import ahead of the tests (none: nothing)",
        field="preload",
        parse=parse_preload,
        unset=torch_if_installed,
        metavar="MODULE,...",
        default="torch when installed",
    ),
    Option(
        "gpu_isolate_prewarm",
        "start the processes of the next N isolated tests while one runs; 0: off",
        field="prewarm",
        parse=_integer(0, 16),
        unset=DEFAULT_PREWARM,
        metavar="N",
        default=f"{DEFAULT_PREWARM}",
    ),
    Option(
        "gpu_isolate_precollect",
        "with the fork server, configure pytest and collect the tests' modules once in a "
        "template that each test's process is forked from",
        field="precollect",
        type="bool",
        ini_default=True,
        flag=None,
        negative="--gpu-isolate-no-precollect",
        negative_help="with the fork server, each test's process configures and collects "
        "for itself instead of being forked from a pre-collected template "
        "(ini: gpu_isolate_precollect = false).",
    ),
    Option(
        "gpu_isolate_learn_imports",
        "with the fork server, the template imports the modules a test imported while it "
        "ran, for the tests forked after it (as in-process pytest keeps them imported)",
        field="learn_imports",
        type="bool",
        ini_default=True,
        flag=None,
        negative="--gpu-isolate-no-learn-imports",
        negative_help="with the fork server, each test's process imports for itself what its "
        "test imports, even where an earlier test imported it "
        "(ini: gpu_isolate_learn_imports = false).",
    ),
)

# Settings fields no row fills: the post-step of read_settings makes them from other values.
DERIVED = ("template_wait",)

# What most users set, first in ``pytest --help``; the others (tuning) in a group of their own.
MAIN = frozenset(
    f"gpu_isolate{suffix}"
    for suffix in ("", "_timeout", "_start", "_gpus", "_devices", "_leaks", "_report", "_summary")
)
REFERENCE = "https://github.com/pytest-gpuiso/pytest-gpuiso/blob/main/docs/options.md"
MAIN_GROUP = ("gpu-isolate", "GPU test isolation (pytest-gpuiso)")
TUNING_GROUP = ("gpu-isolate-tuning", f"GPU test isolation, tuning (pytest-gpuiso: {REFERENCE})")


def add_options(parser: pytest.Parser) -> None:
    """Declare every option and ini key of ``OPTIONS``."""
    main, tuning = parser.getgroup(*MAIN_GROUP), parser.getgroup(*TUNING_GROUP)
    for option in OPTIONS:
        group = main if option.name in MAIN else tuning
        if option.type == "bool":
            flags = ((option.cli, True, option.option_help()), (option.negative, False, None))
            for flag, value, text in flags:
                if flag is not None:
                    group.addoption(
                        flag,
                        action="store_true" if value else "store_false",
                        dest=option.name,
                        default=None,
                        help=text or option.negative_help,
                    )
            parser.addini(option.name, option.help, type="bool", default=option.ini_default)
        elif option.type == "args":
            parser.addini(option.name, option.help, type="args")
        else:
            group.addoption(
                option.cli,
                dest=option.name,
                metavar=option.metavar,
                help=option.option_help().replace("%", "%%"),  # argparse formats it
            )
            parser.addini(option.name, option.help, type="string", default="")
