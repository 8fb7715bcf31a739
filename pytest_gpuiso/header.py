"""The gpu-isolate lines of pytest's header: what is isolated, how processes start,
the GPUs and what each test leases, its MASTER_PORT, the leak checks, -n auto.

Three lines at most at pytest's default verbosity (what is isolated and its timeout,
the GPUs, the leak checks); every detail with ``-v``. None at all in a session that
isolates nothing (``plugin.pytest_report_header``).
"""

from __future__ import annotations

import os

import pytest

from .gpu import ports, workers
from .parent.session import State
from .settings import MARKER, Settings, pytest_timeout
from .values import DEFAULT_TIMEOUT, count_text


def lines(config: pytest.Config, state: State, debugger: str, marked: int = 0) -> list[str]:
    """The header's gpu-isolate lines (``debugger``: --pdb or --trace when given;
    ``marked``: how many marked tests were collected, where only they are isolated)."""
    s = state.settings
    if s.mode == "off":
        why = debugger or "--no-gpu-isolate"
        return [f"gpu-isolate: off ({why}): every test runs in-process"]
    scope = "every test"
    if s.mode != "all":
        scope = f"{count_text(marked, 'test') if marked else 'tests'} marked {MARKER}"
    seconds, source = s.timeout, s.timeout_source
    if seconds is None:  # markers aside, pytest-timeout's value applies, else ours
        seconds, source = pytest_timeout(config) or (DEFAULT_TIMEOUT, "default")
    timeout = f"{seconds:g} s ({source})"
    if config.get_verbosity() <= 0:
        return _brief(config, state, scope, timeout)
    auto = config.stash.get(workers.AUTO, None)
    lines = [
        f"gpu-isolate: {scope} in a fresh process, timeout {timeout}, grace {s.grace:g} s, "
        f"start-up bound {s.startup_timeout:g} s",
        _start_header(s),
    ]
    d = state.gpus.devices
    if d.names:
        lines.append(f"gpu-isolate: GPUs {d.describe()} (from {d.source}), {_packing(s)}")
    else:
        lines.append(f"gpu-isolate: no GPUs to lease (from {d.source})")
    lines.append(_each_test_leases(s, state))
    if s.pin_workers:
        lines.append(_pin_header(config, s, state))
    lines.append(_port_header(state.master_port))
    lines.append(_leak_header(s, state))
    if auto is not None:
        lines.append(auto.describe())
    return lines


def _brief(config: pytest.Config, state: State, scope: str, timeout: str) -> list[str]:
    """The header at pytest's default verbosity: three lines."""
    s, d = state.settings, state.gpus.devices
    first = f"gpu-isolate: {scope} in a fresh process ({s.start}), timeout {timeout}"
    if s.pin_workers:
        gpus = _pin_header(config, s, state)
    elif d.names:
        n = state.gpus.default_gpus(s.gpus)
        each = "none" if n == 0 else count_text(n, "GPU")
        gpus = f"gpu-isolate: GPUs {d.describe()} (from {d.source}), {_packing(s)}; "
        gpus += f"each test leases {each}"
    else:
        gpus = f"gpu-isolate: no GPUs to lease (from {d.source})"
    auto = config.stash.get(workers.AUTO, None)
    if auto is not None:  # -n auto counted the workers from the GPUs: said on their line
        gpus += "; " + auto.describe().removeprefix("gpu-isolate: ")
    return [first, gpus, _leak_header(s, state)]


def _each_test_leases(s: Settings, state: State) -> str:
    """What an isolated test leases unless its marker says gpus=, and why."""
    n = state.gpus.default_gpus(s.gpus)
    why = f"({s.gpus_source})" if s.gpus is not None else "(default where there are GPUs)"
    what = "no GPU: it sees none" if n == 0 else f"{n} GPU{'s' if n != 1 else ''}"
    if s.gpus is None and not state.gpus.devices.names:
        what, why = "no GPU", "(no GPUs to lease)"
    return f"gpu-isolate: each isolated test leases {what} {why}, unless marked gpus="


def _pin_header(config: pytest.Config, s: Settings, state: State) -> str:
    line = "gpu-isolate: pinned workers (--gpu-isolate-pin-workers): "
    n = s.gpus or 1
    if state.gpus.pin is not None:
        names = ", ".join(state.gpus.pin.devices)
        return line + f"this process holds GPU {names} for its whole life; its tests see only that"
    if not state.gpus.devices.names:
        return line + "no GPUs to pin"
    slots = workers.gpu_slots(s, state.gpus.devices)
    count = len(config.getoption("tx", None) or [])
    return line + (
        f"each of the {count} xdist workers holds {n} GPU{'s' if n != 1 else ''} for its "
        f"whole life, before its tests are collected ({slots} GPU slots)"
    )


def _port_header(leased: bool) -> str:
    if not leased:
        port = os.environ.get(ports.PORT_ENV)
        return f"gpu-isolate: MASTER_PORT={port} from the environment: left alone"
    span = f"{ports.PORTS.start}-{ports.PORTS.stop - 1}"
    return (
        f"gpu-isolate: each test gets MASTER_ADDR=127.0.0.1 and a MASTER_PORT of its own ({span})"
    )


def _packing(s: Settings) -> str:
    if s.gpu_memory is not None:
        return f"tests packed by memory, {s.gpu_memory.text} each unless marked gpu_memory="
    return f"{s.slots} test{'s' if s.slots != 1 else ''} per GPU at once"


def _start_header(s: Settings) -> str:
    line = f"gpu-isolate: start {s.start}"
    if s.start_why:  # the default is spawn here
        line += f" ({s.start_why})"
    if s.start == "forkserver":
        how = "pre-collected session" if s.precollect else "parsed configuration"
        line += f" (a server per pytest process that never initialises CUDA; forks from a {how})"
    preload = ",".join(s.preload) or "none"
    prewarm = f"next {s.prewarm} test{'s' if s.prewarm != 1 else ''}" if s.prewarm else "off"
    return f"{line}, preload {preload}, prewarm {prewarm}"


def _leak_header(s: Settings, state: State) -> str:
    levels = ", ".join(f"{kind}={level}" for kind, level in s.leaks)
    line = f"gpu-isolate: leak checks {levels}"
    if s.cleanup:
        line += ", leaked /dev/shm entries deleted"
    if s.leak_level("gpu_memory") != "off":
        if not state.gpus.devices.names:
            line += " (gpu_memory: no GPUs to check)"
        elif not state.gpus.nvml.available():
            line += f" (gpu_memory unavailable: {state.gpus.nvml.error})"
        else:
            line += f" (gpu_memory tolerance {s.gpu_tolerance_mib:g} MiB)"
    return line
