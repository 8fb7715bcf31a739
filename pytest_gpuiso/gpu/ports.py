"""A free ``MASTER_PORT`` for each isolated test: distributed tests never collide.

torch.distributed (and anything built on its ``env://`` rendezvous) reads
``MASTER_ADDR`` and ``MASTER_PORT``; two tests that both use the default 29500 at
once fail with "address already in use", or worse, join each other's group. Each
isolated test therefore leases a port, as it leases its GPUs: before the test's
process starts, the pytest process (the xdist worker) binds a Unix socket in the
abstract namespace named after the user and the port, and closes it after the
process is reaped. No other running isolated test of any worker or session of
the user can bind the same name, so none holds the same port; the kernel frees
the name when the pytest process dies (a crash strands no port), and no file is
left behind. Abstract names live in the network namespace, as TCP ports do: two
containers with their own network share neither.

A port is taken from ``PORTS`` (29500 up, torch's default first, below the
kernel's ephemeral range, which it never hands out on its own) only when nothing
on the machine has it bound: a port some other program uses is skipped.
Where the user's environment sets ``MASTER_PORT``, it is left alone.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from dataclasses import dataclass

ADDR_ENV, PORT_ENV = "MASTER_ADDR", "MASTER_PORT"
ADDR = "127.0.0.1"
PORTS = range(29500, 31500)  # below Linux's default ephemeral range (32768-60999)


class PortError(RuntimeError):
    """No port could be leased: the one-line message says why (fails the test's setup)."""


@dataclass
class PortLease:
    port: int
    held: socket.socket  # bound to the port's abstract name; closing it releases the port

    def env(self) -> dict[str, str]:
        return {ADDR_ENV: ADDR, PORT_ENV: str(self.port)}

    def release(self) -> None:
        self.held.close()


def wanted() -> bool:
    """Whether tests get a port: not when the user's own environment sets MASTER_PORT."""
    return PORT_ENV not in os.environ


def lease(ports: range = PORTS) -> PortLease:
    """The first port of ``ports`` (after the last one this process took) that no other
    isolated test holds and that nothing has bound; ``PortError`` when there is none,
    ``OSError`` when a socket cannot be made (out of descriptors)."""
    start = _next.get(ports, 0)
    busy = 0
    for i in range(len(ports)):
        port = ports[(start + i) % len(ports)]
        held = _hold(f"pytest-gpuiso-master-port-{os.getuid()}-{port}")
        if held is None:
            busy += 1
            continue
        if _bindable(port):
            _next[ports] = (start + i + 1) % len(ports)
            return PortLease(port, held)
        held.close()
    raise PortError(
        f"no free {PORT_ENV} in {ports.start}-{ports.stop - 1}: {busy} held by other isolated "
        f"tests, the rest bound by other programs; set {PORT_ENV} to choose one yourself"
    )


_next: dict[range, int] = {}  # by range: where this process's next search starts


def _hold(name: str) -> socket.socket | None:
    """A Unix socket bound to the abstract ``name``, or None when another process has it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # close-on-exec: never inherited
    try:
        sock.bind("\0" + name)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            return None
        raise
    return sock


def _bindable(port: int) -> bool:
    """Whether a TCP server could listen on ``port`` now (all IPv4 addresses, as
    torch's TCPStore does)."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True
