"""Every command-line option and ini key of pytest-gpuiso, from one table.

Each ``Option`` is one setting: its ini key (also the option's ``dest``), its ini
type, the flag(s) that set it on the command line, the default shown in ``--help``
and the help text. ``add_options`` turns the table into ``parser.addoption`` and
``parser.addini`` calls, so a setting cannot have a flag without an ini key, or
differ in name or help between the two. The values are parsed and validated in
``settings.py``, which reads them by these names.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from .settings import (
    DEFAULT_GRACE,
    DEFAULT_PREWARM,
    DEFAULT_SLOTS,
    DEFAULT_STARTUP_TIMEOUT,
    DEFAULT_TIMEOUT,
)
from .settings import DEFAULT_TOLERANCE_MIB as DEFAULT_TOLERANCE


@dataclass(frozen=True)
class Option:
    name: str  # the ini key, and the option's dest
    help: str
    type: str = "string"  # the ini type: string, bool or args
    metavar: str | None = None  # a value option's metavar; None: a flag (or ini only)
    default: str = ""  # shown in --help; settings.py applies the real default
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
        type="bool",
        ini_default=False,
        negative="--no-gpu-isolate",
        negative_help="run every test in-process, marked tests included (e.g. for --pdb).",
    ),
    Option(
        "gpu_isolate_timeout",
        "timeout in seconds of an isolated test's setup, call and teardown, as pytest-timeout's",
        metavar="SECONDS",
        default=f"{DEFAULT_TIMEOUT:g}, or pytest-timeout's",
    ),
    Option(
        "gpu_isolate_startup_timeout",
        "bound in seconds on an isolated test's process before its test begins (interpreter, "
        "plugins, conftests, the test module's import) and after it ends (its exit)",
        metavar="SECONDS",
        default=f"{DEFAULT_STARTUP_TIMEOUT:g}",
    ),
    Option(
        "gpu_isolate_grace",
        "seconds between SIGTERM and SIGKILL on timeout",
        metavar="SECONDS",
        default=f"{DEFAULT_GRACE:g}",
    ),
    Option(
        "gpu_isolate_report",
        "write a JSON report of the isolated tests to PATH",
        metavar="PATH",
    ),
    Option(
        "gpu_isolate_summary",
        "write a Markdown summary (leaks, timeouts, crashes) for PR checks to PATH",
        metavar="PATH",
    ),
    Option(
        "gpu_isolate_devices",
        "GPUs to lease: auto (CUDA_VISIBLE_DEVICES, else NVML), none, or a list of indices/UUIDs, "
        "each with an optional memory size for devices NVML cannot see (0:80GiB,1:80GiB)",
        metavar="auto|none|0,1,...",
        default="auto",
    ),
    Option(
        "gpu_isolate_gpus",
        "GPUs an isolated test leases unless its marker says gpus=; 0: none (the test sees no GPU)",
        metavar="N",
        default="1 where there are GPUs to lease, else 0",
    ),
    Option(
        "gpu_isolate_pin_workers",
        "each xdist worker (or this pytest process without xdist) leases --gpu-isolate-gpus "
        "GPUs for its whole life, before the tests are collected, and its in-process tests see "
        "only those in CUDA_VISIBLE_DEVICES",
        type="bool",
        ini_default=False,
    ),
    Option(
        "gpu_isolate_slots",
        "how many isolated tests may share one GPU at once: each takes 1/N of its memory "
        "unless it declares gpu_memory",
        metavar="N",
        default=f"{DEFAULT_SLOTS}",
    ),
    Option(
        "gpu_isolate_gpu_memory",
        "GPU memory an isolated test leases on each of its GPUs unless its marker says "
        "gpu_memory=: bytes, a size (12GiB, 512MiB, 8GB) or a share of the GPU (25%); tests "
        "are packed onto a GPU while their leases fit its memory",
        metavar="SIZE",
        default="1/slots of the GPU",
    ),
    Option(
        "gpu_isolate_lease_timeout",
        "fail a test that waited longer than this many seconds for its GPUs",
        metavar="SECONDS",
        default="wait",
    ),
    Option(
        "gpu_isolate_leaks",
        "what a leak (shm, process, gpu_memory) does: warn, fail the test, or off; "
        "per kind e.g. shm=fail,process=warn",
        metavar="warn|fail|off|KIND=LEVEL,...",
        default="warn",
    ),
    Option(
        "gpu_isolate_gpu_tolerance",
        "GPU memory growth in MiB ignored by the leak check",
        metavar="MiB",
        default=f"{DEFAULT_TOLERANCE:g}",
    ),
    Option(
        "gpu_isolate_torch_check",
        "in the test's process, compare torch.cuda.memory_allocated() before and after the test",
        type="bool",
        ini_default=False,
    ),
    Option(
        "gpu_isolate_cleanup",
        "delete leaked /dev/shm entries after reporting them (only the current user's, "
        "created during that test)",
        type="bool",
        ini_default=False,
    ),
    Option(
        "gpu_isolate_shm_ignore",
        "glob patterns of /dev/shm names never reported as leaks",
        type="args",
        flag=None,
    ),
    Option(
        "gpu_isolate_start",
        "how isolated processes start: spawn a new interpreter, or fork them from a server "
        "that has imported pytest, the plugins, the conftests and the preload modules and "
        "never touched CUDA",
        metavar="spawn|forkserver",
        default="spawn",
    ),
    Option(
        "gpu_isolate_preload",
        "modules the fork server and prewarmed processes import ahead of the tests (none: nothing)",
        metavar="MODULE,...",
        default="torch when installed",
    ),
    Option(
        "gpu_isolate_prewarm",
        "start the processes of the next N isolated tests while one runs; 0: off",
        metavar="N",
        default=f"{DEFAULT_PREWARM}",
    ),
    Option(
        "gpu_isolate_precollect",
        "with the fork server, configure pytest and collect the tests' modules once in a "
        "template that each test's process is forked from",
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
        type="bool",
        ini_default=True,
        flag=None,
        negative="--gpu-isolate-no-learn-imports",
        negative_help="with the fork server, each test's process imports for itself what its "
        "test imports, even where an earlier test imported it "
        "(ini: gpu_isolate_learn_imports = false).",
    ),
)

BY_NAME = {option.name: option for option in OPTIONS}


def add_options(parser: pytest.Parser) -> None:
    """Declare every option and ini key of ``OPTIONS``."""
    group = parser.getgroup("gpu-isolate", "GPU test isolation (pytest-gpuiso)")
    for option in OPTIONS:
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
