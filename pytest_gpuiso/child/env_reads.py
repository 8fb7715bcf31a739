"""Which environment variables a process read, and where (a test's process before its
go; a successor template while it imports what tests imported).

A module that reads ``CUDA_VISIBLE_DEVICES`` at import before its process's go saw the
hidden value, not its GPUs; one imported where tests' processes are forked from holds
that process's value in every test. Both are told by the names read meanwhile.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any


class EnvReads:
    """Which environment variables the process read before its go, and where.

    A module that reads ``CUDA_VISIBLE_DEVICES`` at import before the go saw the
    hidden value (``""``), not its GPUs: it must run in a fresh process. Until the
    go, ``os.environ`` (which ``os.getenv`` reads too) notes each name read. A copy
    of the whole environment (``dict(os.environ)``, ``os.environ.copy()``, ``items()``:
    what starting a subprocess does, as ``platform.architecture()`` at pytest-benchmark's
    configure) reads every name in iteration order: those reads are not noted.
    """

    names: dict[str, str | None] = {}  # name -> module being collected ahead, or None
    where: str | None = None
    _class: type | None = None
    walk: list[str] = []  # the names an iteration of os.environ just gave, still to be read

    @classmethod
    def start(cls) -> None:
        if cls._class is None:
            cls._class = type(os.environ)
            os.environ.__class__ = _NotingEnviron

    @classmethod
    def stop(cls) -> dict[str, str | None]:
        if cls._class is not None:
            os.environ.__class__ = cls._class
            cls._class = None
        return cls.names


@contextlib.contextmanager
def env_reads() -> Iterator[dict[str, str | None]]:
    """The environment variables read while it lasts, by name (``EnvReads``; a process's
    go is not awaited meanwhile)."""
    EnvReads.names = {}
    EnvReads.start()
    try:
        yield EnvReads.names
    finally:
        EnvReads.stop()
        EnvReads.names = {}


class _NotingEnviron(os._Environ):  # type: ignore[type-arg] - os.environ's own class
    def __iter__(self) -> Any:
        names = list(super().__iter__())
        EnvReads.walk = names[::-1]  # popped from the end, in iteration order
        return iter(names)

    def __getitem__(self, key: Any) -> Any:
        walk = EnvReads.walk
        if walk and walk[-1] == key:  # the next name of a whole copy: not a read of it
            walk.pop()
        else:
            EnvReads.walk = []
            EnvReads.names.setdefault(key, EnvReads.where)
        return super().__getitem__(key)
