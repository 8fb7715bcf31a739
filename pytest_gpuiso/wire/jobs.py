"""The job contract: what pytest's process hands a test's process to run, as plain values.

``Bootstrap`` says how the process is set up (its output, stack dumps, spill files,
environment, what to import ahead); ``ItemJob`` is one test to run through pytest,
``CallJob`` one ``run_isolated`` call. Made in pytest's process (``parent.plans``,
``parent.call``, ``parent.launcher``), pickled to the test's process, run there by
``child.bootstrap``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Bootstrap:
    parent_pid: int
    output: str | None  # file for fds 1 and 2; None: keep the parent's (pytest -s)
    stack_file: str
    stack_signal: int
    spill_prefix: str
    capture_prefix: str  # pytest's capture files get these names, so a crash can't lose them
    env: tuple[tuple[str, str], ...] = ()  # e.g. CUDA_VISIBLE_DEVICES of the leased GPUs
    preload: tuple[str, ...] = ()  # modules to import while waiting for the go (prewarming)
    collect_ahead: bool = False  # collect the test's module before the go (prewarming)


@dataclass(frozen=True)
class CallJob:
    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class ItemJob:
    nodeid: str
    collect_arg: str  # what to collect: "path::Class::func" or the file path
    args: tuple[str, ...]  # the parent's invocation arguments
    invocation_dir: str
    basetemp: str
    junit_family: str | None = None  # the parent writes junitxml with this family
    torch_check: bool = False  # compare torch's CUDA allocator before and after the test
    options: tuple[tuple[str, Any], ...] = ()  # pytest_gpuiso_child_options: (dest, value)
    # item.location in pytest's process, computed there already (it reads the source)
    location: tuple[str, int | None, str] | None = None
    # The files and folders pytest's own session started from (its arguments, testpaths or
    # the rootdir): the assertion rewriter's "named on the command line", which the test's
    # process, collecting only its test's file, must not take for its own (None: its own)
    initial_paths: tuple[str, ...] | None = None
