"""Abstract socket names that lease MASTER_PORTs, held by the test process itself (the
names a squatter or another session would hold), spelled out here as the contract says."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from collections.abc import Iterator

import pytest


def port_name(port: int) -> str:
    """The abstract socket name that leases ``port`` to this user's isolated tests."""
    return f"\0pytest-gpuiso-master-port-{os.getuid()}-{port}"


@contextlib.contextmanager
def names_held(first: int, last: int, size: int = 2) -> Iterator[range]:
    """A range of ``size`` ports in ``first``..``last`` whose names this process holds: the
    first such block whose names no one else holds (another run of the same test, say)."""
    for base in range(first, last + 1, size):
        span = range(base, base + size)
        with contextlib.ExitStack() as held:
            try:
                for port in span:
                    sock = held.enter_context(socket.socket(socket.AF_UNIX))
                    sock.bind(port_name(port))
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                continue
            yield span
            return
    pytest.fail(f"no block of free port names in {first}-{last}")
