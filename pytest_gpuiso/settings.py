"""The session's settings and one test's, each read and checked once.

CLI, ini, marker, environment and pytest-timeout values become two frozen records:
``Settings`` (the session's, built by ``read_settings`` from ``options.OPTIONS`` in one
loop) and ``IsolationSpec`` (one test's, by ``spec_for_item``). The parsers and the
shared defaults are ``values``'; a bad value is ``values.SpecError``, which becomes
pytest's usage error (CLI, ini) or the test's setup error (marker).
Precedence: built-in default < ini < command line < marker; pytest-timeout's value is
the isolated test's timeout only when no gpu-isolate timeout was given anywhere.

This module imports only ``values`` and ``options`` of pytest-gpuiso's.
"""

from __future__ import annotations

import ast
import contextlib
import os
from dataclasses import dataclass
from typing import Any

import pytest

from .options import OPTIONS, Option
from .values import (
    DEFAULT_PREWARM,
    DEFAULT_RANK_WAIT,
    DEFAULT_SLOTS,
    DEFAULT_STARTUP_TIMEOUT,
    DEFAULT_TIMEOUT,
    DEFAULT_TOLERANCE_MIB,
    KINDS,
    MAX_RANKS,
    MAX_SECONDS,
    TEMPLATE_WAIT_DEFAULT,
    GpuMemory,
    SpecError,
    bad_value,
    parse_allowed,
    parse_count,
    parse_memory,
    parse_seconds,
    parse_template_wait,
)
from .wire.environment import TEMPLATE_WAIT_ENV

MARKER = "gpu_isolated"
MARKER_KWARGS = (
    "timeout",
    "startup_timeout",
    "grace",
    "gpus",
    "gpu_memory",
    "allow_leaks",
    "ranks",
    "rank_wait",
)
_DEFAULTS = {"allow_leaks": "()", "ranks": "1"}
_SHOWN = ", ".join(f"{k}={_DEFAULTS.get(k, 'None')}" for k in MARKER_KWARGS)
MARKER_DOC = (  # for pytest --markers, from the one list of its arguments
    f"{MARKER}({_SHOWN}): run this test in a fresh process with a clean CUDA context "
    "(pytest-gpuiso)"
)


@dataclass(frozen=True)
class Settings:
    """Session-wide settings, validated once at configure time (``read_settings``).

    Each field is filled by a row of ``options.OPTIONS`` (its value, or where it came
    from: the ``*_source`` fields, "" where it was not given), but ``template_wait``.
    """

    mode: str  # "all" (every test), "marked" (marked tests only) or "off"
    timeout: float | None  # None: not given on the command line or in the ini file
    timeout_source: str
    grace: float
    report_path: str | None
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT
    rank_wait: float = DEFAULT_RANK_WAIT  # a distributed test's ranks, once one ended
    devices: list[str] | None = None  # None: discover (auto)
    devices_source: str = ""
    device_sizes: tuple[tuple[str, int], ...] = ()  # declared memory: --gpu-isolate-devices=0:8GiB
    slots: int = DEFAULT_SLOTS
    gpus: int | None = None  # what a test leases unless marked gpus= (None: 1 where GPUs exist)
    gpus_source: str = ""  # where gpus was set ("--gpu-isolate-gpus", "ini gpu_isolate_gpus")
    pin_workers: bool = False  # each pytest process leases its GPUs for its whole life
    gpu_memory: GpuMemory | None = None  # each test's default lease (None: 1/slots of a GPU)
    lease_timeout: float | None = None
    leaks: tuple[tuple[str, str], ...] = tuple((kind, "warn") for kind in KINDS)
    shm_ignore: tuple[str, ...] = ()
    cleanup: bool = False
    gpu_tolerance_mib: float = DEFAULT_TOLERANCE_MIB
    torch_check: bool = False
    summary_path: str | None = None
    report_source: str = ""  # where report_path was set (a relative path's base)
    summary_source: str = ""
    start: str = "spawn"  # how isolated processes start: spawn or forkserver
    start_why: str = ""  # why the default is spawn here ("": chosen, or the fork server)
    precollect: bool = True  # forkserver: fork tests from a configured, collected template
    learn_imports: bool = True  # forkserver: the template imports what tests imported
    preload: tuple[str, ...] = ()  # imported by the fork server and by prewarmed children
    prewarm: int = DEFAULT_PREWARM  # processes of the next tests started ahead of their turn
    template_wait: float = TEMPLATE_WAIT_DEFAULT  # see TEMPLATE_WAIT_ENV
    health: str = "after-failure"  # when a test's GPUs are probed (GPU health): HEALTH_MODES
    reprobe: float | None = None  # seconds between probes of a quarantined GPU (None: never)
    annotations: str = "auto"  # ANNOTATION_MODES
    code_quality_path: str | None = None  # GitLab's Code Quality report of the same findings
    code_quality_source: str = ""
    leak_baseline: str | None = None  # the known leaks' file (``baseline``)
    leak_baseline_source: str = ""
    warnings: str = "once"  # WARNING_MODES: a warning repeated by later tests' processes

    def leak_level(self, kind: str) -> str:
        return dict(self.leaks)[kind]


@dataclass(frozen=True)
class IsolationSpec:
    """How one isolated test runs."""

    timeout: float  # the test's setup, call and teardown
    timeout_source: str  # "marker", "--gpu-isolate-timeout", "pytest-timeout", "default", ...
    grace: float
    gpus: int | None  # None: not given (the lease layer decides)
    allow_leaks: frozenset[str] = frozenset()  # leak kinds this test may leave (marker)
    gpu_memory: GpuMemory | None = None  # its lease on each GPU (None: 1/slots of it)
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT  # its process's start-up (and exit)
    ranks: int = 1  # processes that run it together (a distributed test's ranks)
    distributed: bool = False  # ranks= given (even 1): run as a group, with its environment
    # seconds the other ranks may still run once one ended (``parent.group``)
    rank_wait: float = DEFAULT_RANK_WAIT


def wants_isolation(item: pytest.Item, settings: Settings) -> bool:
    if settings.mode == "off":
        return False
    return settings.mode == "all" or item.get_closest_marker(MARKER) is not None


def spec_for_item(item: pytest.Item, settings: Settings) -> IsolationSpec:
    """Resolve the item's spec; raise ``SpecError`` for a bad marker argument."""
    marker = item.get_closest_marker(MARKER)
    kwargs: dict[str, Any] = dict(marker.kwargs) if marker is not None else {}
    if marker is not None and marker.args:
        keywords = ", ".join(f"{k}=" for k in MARKER_KWARGS)
        what = f"{MARKER} marker positional arguments"
        raise bad_value(marker.args, what, f"none, only keyword arguments {keywords}")
    unknown = sorted(set(kwargs) - set(MARKER_KWARGS))
    if unknown:
        names = f"{', '.join(MARKER_KWARGS[:-1])} or {MARKER_KWARGS[-1]}"
        raise bad_value(unknown[0], f"{MARKER} marker argument name", names)

    if "timeout" in kwargs:
        timeout = parse_seconds(
            kwargs["timeout"], f"{MARKER} marker argument timeout", allow_zero=False
        )
        timeout_source = "marker"
    elif settings.timeout is not None:
        timeout, timeout_source = settings.timeout, settings.timeout_source
    else:
        external = pytest_timeout(item.config, item)
        if external is not None:
            timeout, timeout_source = external[0], "pytest-timeout"
        else:
            timeout, timeout_source = DEFAULT_TIMEOUT, "default"

    if "grace" in kwargs:
        grace = parse_seconds(kwargs["grace"], f"{MARKER} marker argument grace", allow_zero=True)
    else:
        grace = settings.grace
    startup = settings.startup_timeout
    if "startup_timeout" in kwargs:
        what = f"{MARKER} marker argument startup_timeout"
        startup = parse_seconds(kwargs["startup_timeout"], what, allow_zero=False)

    gpus = None
    if "gpus" in kwargs:
        gpus = parse_count(kwargs["gpus"], f"{MARKER} marker argument gpus")
    memory = settings.gpu_memory
    if "gpu_memory" in kwargs:
        memory = parse_memory(kwargs["gpu_memory"], f"{MARKER} marker argument gpu_memory")
    allowed: frozenset[str] = frozenset()
    if "allow_leaks" in kwargs:
        allowed = parse_allowed(kwargs["allow_leaks"], f"{MARKER} marker argument allow_leaks")
    ranks = _ranks(item, kwargs.get("ranks", 1))
    rank_wait = settings.rank_wait
    if "rank_wait" in kwargs:
        what = f"{MARKER} marker argument rank_wait"
        rank_wait = parse_seconds(kwargs["rank_wait"], what, allow_zero=True)
    return IsolationSpec(
        timeout=timeout,
        timeout_source=timeout_source,
        grace=grace,
        gpus=gpus,
        allow_leaks=allowed,
        startup_timeout=startup,
        gpu_memory=memory,
        ranks=ranks,
        distributed="ranks" in kwargs,
        rank_wait=rank_wait,
    )


def _ranks(item: pytest.Item, value: Any) -> int:
    """The marker's ``ranks``: a count (>= 1), or the name of the test's parameter that
    holds it (``ranks="world_size"`` with ``@pytest.mark.parametrize("world_size", ...)``)."""
    what = f"{MARKER} marker argument ranks"
    if isinstance(value, str):
        params = getattr(getattr(item, "callspec", None), "params", {})
        if value not in params:
            named = ", ".join(sorted(params)) or "none"
            raise bad_value(value, what, f"a count, or the name of a parameter ({named})")
        what, value = f"{what} (parameter {value})", params[value]
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_RANKS:
        raise bad_value(
            value, what, f"an integer from 1 to {MAX_RANKS}, or the name of a parameter holding one"
        )
    return value


def pytest_timeout(
    config: pytest.Config, item: pytest.Item | None = None
) -> tuple[float, str] | None:
    """pytest-timeout's timeout for ``item`` (the session's without one) and where it came
    from, by its own precedence: its marker, ``--timeout``, ``PYTEST_TIMEOUT``, the ini key
    ``timeout``. None where it sets none: not loaded, 0, or a bad value (pytest-timeout
    reports that). Beyond ``MAX_SECONDS`` is as good as none: capped there."""
    if not config.pluginmanager.hasplugin("timeout"):
        return None
    sources = [
        (config.getoption("timeout", None), "pytest-timeout --timeout"),
        (os.environ.get("PYTEST_TIMEOUT"), "pytest-timeout PYTEST_TIMEOUT"),
        (config.getini("timeout"), "pytest-timeout ini timeout"),
    ]
    marker = item.get_closest_marker("timeout") if item is not None else None
    if marker is not None:  # timeout(seconds, method=None, func_only=False)
        given = marker.kwargs.get("timeout", marker.args[0] if marker.args else None)
        sources.insert(0, (given, "pytest-timeout marker"))
    for value, source in sources:
        if value is None or (isinstance(value, str) and not value.strip()):
            continue
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            return None
        return (min(seconds, MAX_SECONDS), source) if seconds > 0 else None
    return None


def read_settings(config: pytest.Config) -> Settings:
    """Read and validate every option; raise ``pytest.UsageError`` naming the culprit."""
    try:
        return _read(config)
    except SpecError as exc:
        raise pytest.UsageError(f"gpu-isolate: {exc}") from None


def read_early(config: pytest.Config, known: Any) -> Settings | None:
    """The settings as ``pytest_load_initial_conftests`` can know them (``known``: the
    options parsed so far; the ini file); None when they are not valid (``read_settings``
    says why, at ``pytest_configure``)."""
    try:
        return _read(_Early(config, known))  # type: ignore[arg-type] - what _read asks
    except Exception:  # noqa: BLE001 - best effort: read_settings says what is wrong
        return None


class _Early:
    """What ``_read`` asks of a config, before pytest has parsed the whole command line."""

    def __init__(self, config: pytest.Config, known: Any) -> None:
        self.config = config
        self.known = known

    def getoption(self, name: str) -> Any:
        return getattr(self.known, name, None)

    def getini(self, name: str) -> Any:
        return self.config.getini(name)


def _read(config: pytest.Config) -> Settings:
    fields: dict[str, Any] = {}
    for option in OPTIONS:
        given = _given(config, option)
        if given is None:
            value, where = option.unset() if callable(option.unset) else option.unset, ""
        else:
            value, where = option.parse(*given), given[1]
        if isinstance(option.field, str):
            fields[option.field] = value
        else:
            fields.update(zip(option.field, value, strict=True))
        if option.source:
            fields[option.source] = where
    # Derived: the fork server's wait for its template, from the environment (the test
    # suite's knob), only where there is a fork server.
    wait = os.environ.get(TEMPLATE_WAIT_ENV, "").strip()
    if fields["start"] == "forkserver" and wait:
        what = f"environment variable {TEMPLATE_WAIT_ENV}"
        fields["template_wait"] = parse_template_wait(wait, what)
    return Settings(**fields)


def _given(config: pytest.Config, option: Option) -> tuple[Any, str] | None:
    """The option's value as given and where: the command line first, then the ini file
    (a blank ini value is not given); None where it is given nowhere. A bool ini key
    always has a value (its ``ini_default``)."""
    if option.type == "args":
        patterns = config.getini(option.name)
        return (patterns, f"ini {option.name}") if patterns else None
    cli = config.getoption(option.name)
    if cli is not None and option.type == "bool":
        return bool(cli), (option.cli if cli else option.negative) or option.name
    if cli is not None:
        return str(cli), str(option.cli)
    if option.type == "bool":
        return _ini_bool(config, option.name), f"ini {option.name}"
    ini = config.getini(option.name)
    if isinstance(ini, str) and ini.strip():
        return ini.strip(), f"ini {option.name}"
    return None


# What pytest reads as a bool ini key (``_pytest.config._strtobool``), case aside.
TRUTH_VALUES = "true or false (also yes/no, y/n, t/f, on/off, 1/0)"


def _ini_bool(config: pytest.Config, name: str) -> bool:
    """An ini key of type bool; pytest's error on a bad value becomes one line naming it."""
    try:
        return bool(config.getini(name))
    except (ValueError, TypeError, pytest.UsageError) as exc:  # "invalid truth value 'x'"
        text = str(exc)
        given: Any = text
        if text.startswith("invalid truth value "):
            with contextlib.suppress(ValueError, SyntaxError):  # its repr, read back
                given = ast.literal_eval(text.removeprefix("invalid truth value "))
        raise bad_value(given, f"ini {name}", TRUTH_VALUES) from None
