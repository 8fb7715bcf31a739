"""The payloads of the frame kinds whose payload is an object (``frames.SHAPES`` checks
each frame against its kind's shape; these name the fields for the code on both ends),
and a warning's encoding as its payload (``encode_warning``)."""

from __future__ import annotations

import builtins
import warnings
from typing import TypedDict

# The warning categories every process has without importing anything, by name
BUILTIN_WARNINGS = {
    name: value
    for name, value in vars(builtins).items()
    if isinstance(value, type) and issubclass(value, Warning)
}


class Stale(TypedDict):
    """``STALE``: why a prewarmed process cannot take its GPUs (each None where it does
    not apply): CUDA was initialised, a module read CUDA_VISIBLE_DEVICES, and where."""

    cuda: str | None
    read: str | None
    module: str | None


class WarningData(TypedDict):
    """``WARNING``: a warning of the test (``encode_warning``)."""

    message: str
    category_module: str
    category_name: str
    category_base: str  # its nearest builtin base (``BUILTIN_WARNINGS``)
    filename: str
    lineno: int | None
    nodeid: str


class TorchLeak(TypedDict):
    """``TORCH_LEAK``: torch's CUDA allocator grew on a device during the test."""

    device: int | str
    bytes: int


class Imported(TypedDict):
    """``IMPORTED``: what the test imported that a template may import for the next ones."""

    names: list[tuple[str, str]]  # (module name, its origin)
    modules: int  # how many modules the test's process had imported


class ExitData(TypedDict):
    """``EXIT``: ``pytest.exit()`` or Ctrl-C in the test."""

    interrupt: bool
    message: str
    returncode: int | None


class ExceptionData(TypedDict):
    """``EXCEPTION``: what run_isolated's function raised (``describe_exception``)."""

    type: str
    message: str
    traceback: str
    pickled: bytes | None  # the exception itself, where it pickles


def encode_warning(message: warnings.WarningMessage, nodeid: str) -> WarningData:
    """A warning of the test as plain data: its category by name, and by the name of its
    nearest builtin base, which pytest's process can rebuild without importing anything."""
    category = message.category
    base = next(
        (c.__name__ for c in category.__mro__ if BUILTIN_WARNINGS.get(c.__name__) is c),
        "UserWarning",
    )
    return {
        "message": str(message.message),
        "category_module": category.__module__,
        "category_name": category.__qualname__,
        "category_base": base,
        "filename": message.filename,
        "lineno": message.lineno,
        "nodeid": nodeid,
    }
