"""Every value pytest-gpuiso accepts, parsed and checked: the bottom floor.

Each parser takes the value as given and where it came from, and raises ``SpecError``
with one line of one shape (``bad_value``): where it came from (``--gpu-isolate-timeout``,
``ini gpu_isolate_timeout``, ``gpu_isolated marker argument timeout``), the value, and
every form accepted there; callers turn it into a usage error (CLI, ini) or the test's
setup error (marker). The defaults and bounds every setting shares live here too.

This module imports nothing of pytest-gpuiso's: everything else may import it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import re
import sys
from dataclasses import dataclass
from typing import Any

DEFAULT_TIMEOUT = 900.0
DEFAULT_STARTUP_TIMEOUT = 300.0  # bounds start-up (until the test's protocol) and exit
DEFAULT_GRACE = 5.0
# Once one rank of a distributed test ended, how long the others may still run before
# they are stopped with their stacks: ranks of an SPMD test end within moments of each
# other (their last collective), and a rank whose peer died notices it through its
# collective's own error within a few seconds at most; 10 s covers a slow teardown and
# still ends a rank stuck in a collective long before any timeout (marker: rank_wait=).
DEFAULT_RANK_WAIT = 10.0
# the most ranks one test may have: processes on one machine, each a whole interpreter
MAX_RANKS = 1024
# The longest duration any bound accepts (a week): waits below it fit the kernel's poll
# timeout (2**31 ms, 24.8 days), where 1e10 seconds overflowed mid-session.
MAX_SECONDS = 7 * 24 * 3600.0
DEFAULT_PREWARM = 1
DEFAULT_SLOTS = 1
MAX_SLOTS = MAX_GPUS = 64  # the lease table's holders per device; its devices
WHOLE = 1_000_000  # a share of a GPU in parts per million (the lease table's unit)
_SIZE = re.compile(r"^\s*(\d{1,30})(?:\.(\d{1,30}))?\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20}
_UNITS |= {"GIB": 2**30, "TIB": 2**40}
DEFAULT_TOLERANCE_MIB = 64.0  # GPU memory growth the leak check ignores
START_METHODS = ("spawn", "forkserver")
HEALTH_MODES = ("off", "after-failure", "always")  # when a test's GPUs are probed
# where annotations go: GitHub's workflow commands where GITHUB_ACTIONS=true (auto), always, never
ANNOTATION_MODES = ("auto", "github", "off")
WARNING_MODES = ("once", "each")
KINDS = ("shm", "process", "gpu_memory")  # leak kinds
LEVELS = ("warn", "fail", "off")  # what a leak of a kind does
# Seconds, from the template's start, that fork requests wait for it to collect (then the
# server forks tests itself: ~50 ms a test, not ~10); bounds a template stuck in an import.
# The test suite sets a long one, so that its fork-server runs take one path, whatever the timing.
TEMPLATE_WAIT_DEFAULT = 30.0
TEMPLATE_WAIT_MAX = 240.0  # below the 300 s pytest waits for a fork's answer
CUDA_ID = re.compile(r"^(\d+|(GPU|MIG)-[0-9A-Za-z./-]+)$")  # a CUDA_VISIBLE_DEVICES entry
_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")

VERSION = "0.1.0"  # the one place the version is written (pyproject and the package read it)


class SpecError(ValueError):
    """A bad setting. The message is one line naming the source and the value."""


SHOWN = 40  # characters of a bad value's repr an error shows whole (400 digits: the start)


def bad_value(value: Any, what: str, expected: str, problem: str = "") -> SpecError:
    """The one shape of a bad setting's error: ``invalid value V for WHERE: expected
    FORMS`` (every form accepted there), then what is wrong with it where the forms alone
    do not say, in parentheses."""
    shown = repr(value)
    if len(shown) > SHOWN:  # its start, and the closing quote of a string
        shown = shown[: SHOWN - 4] + "..." + (shown[-1] if shown[-1] in "'\"" else "")
    why = f" ({problem})" if problem else ""
    return SpecError(f"invalid value {shown} for {what}: expected {expected}{why}")


def parse_seconds(
    value: Any, what: str, *, allow_zero: bool, high: float = MAX_SECONDS, unit: str = "seconds"
) -> float:
    """Parse a duration in seconds (or another ``unit``) up to ``high``; ``what`` names
    the source for the error message."""
    seconds = math.nan
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            seconds = float(value)
        except OverflowError:  # an int too large for a float
            seconds = math.inf
    elif isinstance(value, str):
        with contextlib.suppress(ValueError):
            seconds = float(value.strip())
    low_ok = seconds >= 0 if allow_zero else seconds > 0  # False for NaN
    if low_ok and seconds <= high and math.isfinite(seconds):
        return seconds
    if math.isinf(high):
        forms = f"a number of {unit} {'>= 0' if allow_zero else '> 0'}"
    elif allow_zero:
        forms = f"a number of {unit} from 0 to {high:g}"
    else:
        forms = f"a number of {unit} > 0, at most {high:g}"
    raise bad_value(value, what, forms)


def parse_int(value: Any, what: str, low: int, high: int) -> int:
    """Parse an integer in [low, high] from an option or ini text."""
    number = int(value.strip()) if isinstance(value, str) and value.strip().isdigit() else None
    if number is None or not low <= number <= high or isinstance(value, bool):
        raise bad_value(value, what, f"an integer from {low} to {high}")
    return number


def parse_count(value: Any, what: str) -> int:
    """Parse a non-negative integer (a GPU count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise bad_value(value, what, "an integer >= 0")
    return value


def parse_start(value: str, what: str) -> tuple[str, str]:
    """A start method given (and no reason for it: it was chosen)."""
    text = value.strip().lower()
    if text not in START_METHODS:
        raise bad_value(value, what, " or ".join(START_METHODS))
    return text, ""


# A sanitizer's runtime mapped into this process (an instrumented interpreter or an
# LD_PRELOAD): the fork server's forks would share its state and threads.
_SANITIZER = re.compile(r"/(lib(?:asan|hwasan|tsan|msan|lsan)[^/\s]*\.so[^/\s]*)$", re.MULTILINE)


def default_start(maps: str = "/proc/self/maps") -> tuple[str, str]:
    """The start method where none is chosen: the fork server where it is safe, else
    spawn and why (a phrase for the header). Where the server turns out not to serve
    (pidfd_open missing, CUDA touched before it forked), the launcher falls back then."""
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return "spawn", f"the fork server needs Linux, this is {sys.platform}"
    try:
        with open(maps, encoding="utf-8", errors="replace") as file:
            found = _SANITIZER.search(file.read())
    except OSError:
        found = None
    if found:
        return "spawn", f"a sanitizer's runtime is loaded ({found.group(1)})"
    return "forkserver", ""


def parse_health(value: str, what: str) -> str:
    return _choice(value, what, HEALTH_MODES)


def parse_annotations(value: str, what: str) -> str:
    return _choice(value, what, ANNOTATION_MODES)


def parse_warnings(value: str, what: str) -> str:
    return _choice(value, what, WARNING_MODES)


def _choice(value: str, what: str, choices: tuple[str, ...]) -> str:
    text = value.strip().lower()
    if text not in choices:
        raise bad_value(value, what, ", ".join(choices))
    return text


PRELOAD_FORMS = "none, or names of installed modules separated by commas or spaces"


def parse_preload(value: str, what: str) -> tuple[str, ...]:
    """Module names separated by commas or spaces; each top-level package must be found
    (looked up, not imported: pytest's process must not import torch to check a name)."""
    if value.strip().lower() == "none":
        return ()
    names = tuple(dict.fromkeys(n for n in re.split(r"[,\s]+", value.strip()) if n))
    for name in names:
        if not _MODULE_NAME.match(name):
            raise bad_value(value, what, PRELOAD_FORMS, f"{name!r} is not a module name")
        top = name.split(".", 1)[0]
        try:
            found = importlib.util.find_spec(top) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise bad_value(value, what, PRELOAD_FORMS, f"no module named {top!r}")
    return names


@dataclass(frozen=True)
class GpuMemory:
    """A test's GPU memory lease on each of its GPUs: bytes, or a share of the device."""

    text: str  # as written, for messages
    size: int = 0  # bytes; 0: a share
    share: int = 0  # parts per million of the device (WHOLE: all of it)

    def on(self, capacity: int) -> int:  # bytes on a device of that size (0: unknown)
        return self.size or capacity * self.share // WHOLE

    def times(self, n: int) -> GpuMemory | None:
        """``n`` of it on one GPU (a distributed test's ranks sharing it); None where that
        is more than a whole GPU."""
        if self.share and self.share * n > WHOLE:
            return None
        return GpuMemory(f"{n} x {self.text}", self.size * n, self.share * n)


UNITS_TEXT = "B, KB, MB, GB, TB, KiB, MiB, GiB or TiB"
SIZE_FORMS = (
    f"bytes or a size such as 12GiB, 512MiB or 1.5GB (in {UNITS_TEXT}), more than 0 bytes "
    "and less than 8 EiB"
)
MEMORY_FORMS = f"{SIZE_FORMS}, or a share of the GPU such as 25% (more than 0%, at most 100%)"


def parse_size(value: Any, what: str, forms: str = SIZE_FORMS) -> int:
    """Bytes from an int or ``"12GiB"``, ``"512 MiB"``, ``"1.5GB"``, ``"80000000"``
    (``forms``: what the error says is accepted where the size is read)."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str) and (m := _SIZE.match(value)):
        whole, fraction, unit = m.group(1), m.group(2) or "", (m.group(3) or "B").upper()
        size = int(whole + fraction) * _UNITS[unit] // 10 ** len(fraction)  # exact
    else:
        raise bad_value(value, what, forms)
    if not 0 < size < 1 << 63:
        raise bad_value(value, what, forms)
    return size


def count_text(n: int, one: str, many: str = "") -> str:
    """``n`` and the noun, singular or plural, for messages: "1 leak", "2 leaks",
    "1 escaped process" (``many``: the plural where it is not ``one`` + "s")."""
    return f"{n:,} {one if n == 1 else many or one + 's'}"


def size_text(size: int, form: str = ".4g") -> str:
    """Bytes for messages, in the largest binary unit they reach: 12 GiB, 1.5 GiB, 512 MiB
    (``form``: the number's format, ``.2f`` for a table's column)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:{form}} {unit}"
    return f"{size} bytes"


def parse_memory(value: Any, what: str) -> GpuMemory:
    """A size (``parse_size``) or a percentage of the device, ``"25%"``."""
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            percent = float(value.strip()[:-1])
        except ValueError:
            percent = math.nan
        if not 0 < percent <= 100:
            raise bad_value(value, what, MEMORY_FORMS)
        return GpuMemory(value.strip(), share=max(1, round(percent * WHOLE / 100)))
    return GpuMemory(str(value).strip(), size=parse_size(value, what, MEMORY_FORMS))


DEVICES_FORMS = (
    "auto, none, or GPU indices or UUIDs separated by commas, each once and each with an "
    "optional :SIZE such as 0:80GiB"
)


def parse_devices(value: str, what: str) -> tuple[list[str] | None, tuple[tuple[str, int], ...]]:
    """``auto`` -> None (discover), ``none`` -> [], ``0,1`` or GPU UUIDs -> the list; each
    entry may declare its memory, ``0:80GiB`` (second: the declared sizes by name)."""
    text = value.strip()
    if text.lower() in ("auto", "none"):
        return (None if text.lower() == "auto" else []), ()
    names, sizes = [], {}
    for part in text.split(","):
        name, colon, size = part.strip().partition(":")
        if not CUDA_ID.match(name):
            raise bad_value(value, what, DEVICES_FORMS, f"bad entry {part!r}")
        names.append(name)
        if colon:
            sizes[name] = parse_size(size, f"{what} (device {name})")
    twice = [name for n, name in enumerate(names) if name in names[:n]]
    if twice:
        raise bad_value(value, what, DEVICES_FORMS, f"device {twice[0]} is listed twice")
    return names, tuple(sizes.items())


def parse_policy(text: str, what: str) -> dict[str, str]:
    """``warn``, ``fail``, ``off`` or per kind ``shm=fail,process=warn`` (a bare level sets
    the default of the kinds not named). Raises ``SpecError`` naming the bad part."""
    default = "warn"
    named: dict[str, str] = {}
    parts = [part.strip() for part in text.split(",")]
    forms = f"{'|'.join(LEVELS)}, or kind=level with kinds {', '.join(KINDS)}, comma-separated"
    seen_default = False
    for part in parts:
        kind, sep, level = (s.strip() for s in part.partition("="))
        if not sep:
            kind, level = "", kind
        bad = f"bad part {part!r}"
        if level not in LEVELS or (sep and kind not in KINDS):
            raise bad_value(text, what, forms, bad)
        if kind in named:
            raise bad_value(text, what, forms, f"{bad}: {kind} is given twice")
        if kind:
            named[kind] = level
        elif seen_default:
            raise bad_value(text, what, forms, f"{bad}: a level for every kind is given twice")
        else:
            default, seen_default = level, True
    return {kind: named.get(kind, default) for kind in KINDS}


def parse_leaks(text: str, what: str) -> tuple[tuple[str, str], ...]:
    """``parse_policy`` as ``Settings.leaks`` keeps it: (kind, level) pairs."""
    return tuple(parse_policy(text, what).items())


def parse_allowed(value: Any, what: str) -> frozenset[str]:
    """The marker's ``allow_leaks``: a list of kinds (or one kind as a string, or ``"all"``)."""
    items = [value] if isinstance(value, str) else value
    forms = f"a kind or a list of kinds ({', '.join(KINDS)}), or all"
    if not isinstance(items, (list, tuple, set, frozenset)) or not all(
        isinstance(k, str) for k in items
    ):
        raise bad_value(value, what, forms)
    unknown = sorted(set(items) - {*KINDS, "all"})
    if unknown:
        raise bad_value(value, what, forms, f"unknown kind {unknown[0]!r}")
    return frozenset(KINDS) if "all" in items else frozenset(items)


def parse_template_wait(value: str, what: str) -> float:
    """Seconds a fork request waits for the template: from 0 to ``TEMPLATE_WAIT_MAX``."""
    return parse_seconds(value, what, allow_zero=True, high=TEMPLATE_WAIT_MAX)


def parse_mode(on: bool, what: str) -> str:
    """``gpu_isolate``: "all" isolates every test; false on the command line
    (``--no-gpu-isolate``) is "off", even for marked tests; false in the ini file (the
    default) is "marked", only marked tests."""
    return "all" if on else "marked" if what.startswith("ini ") else "off"


def parse_path(value: str, what: str) -> str | None:
    """A report's path as written (checked where it is written); blank: none."""
    return value.strip() or None


def parse_patterns(value: Any, what: str) -> tuple[str, ...]:
    """An ini ``args`` list (glob patterns)."""
    return tuple(value)


def parse_flag(value: bool, what: str) -> bool:
    """A boolean, already checked where it was read (pytest's flags and bool ini keys)."""
    return bool(value)


def torch_if_installed() -> tuple[str, ...]:
    """The default preload: torch, where it can be found (looked up, not imported)."""
    return ("torch",) if importlib.util.find_spec("torch") is not None else ()
