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

Abstract names have no owner and no permissions: any local user can bind all of
another user's names, and an LSM or seccomp profile may refuse such binds
altogether. Either way ``lease`` raises ``PortError``, whose message says which
(naming the other users that hold the names, where the kernel tells), and the
caller runs its tests without a leased port rather than failing them.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import struct
from dataclasses import dataclass

ADDR_ENV, PORT_ENV = "MASTER_ADDR", "MASTER_PORT"
ADDR = "127.0.0.1"
PORTS = range(29500, 31500)  # below Linux's default ephemeral range (32768-60999)


class PortError(RuntimeError):
    """No port can be leased (all names taken, or binding them refused): the one-line
    message says why, and that isolated tests run without a ``MASTER_PORT`` of ours."""


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


def name(port: int) -> str:
    """The abstract socket name (without its leading NUL) that leases ``port``."""
    return f"pytest-gpuiso-master-port-{os.getuid()}-{port}"


def lease(ports: range | None = None) -> PortLease:
    """The first port of ``ports`` (default ``PORTS``; after the last one this process
    took) that no other isolated test holds and that nothing has bound. ``PortError``
    when there is none or abstract names cannot be bound here; ``OSError`` when a
    socket cannot be made for want of a resource (``workdir.EXHAUSTED``)."""
    ports = PORTS if ports is None else ports
    start = _next.get(ports, 0)
    busy = 0
    for i in range(len(ports)):
        port = ports[(start + i) % len(ports)]
        held = _hold(name(port))
        if held is None:
            busy += 1
            continue
        with contextlib.ExitStack() as unless_leased:
            unless_leased.callback(held.close)
            if _bindable(port):
                unless_leased.pop_all()
                _next[ports] = (start + i + 1) % len(ports)
                return PortLease(port, held)
    raise PortError(f"{_taken(ports, busy)}; {_WITHOUT}")


_next: dict[range, int] = {}  # by range: where this process's next search starts
_WITHOUT = (
    f"isolated tests run without {ADDR_ENV} and {PORT_ENV} from now on "
    f"(set {PORT_ENV} to choose one yourself)"
)


def _hold(abstract: str) -> socket.socket | None:
    """A Unix socket bound to the abstract name, or None when another process has it."""
    what = "binding the abstract Unix socket names that lease ports"
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # close-on-exec
    except OSError as exc:
        raise _refused(exc, what) from exc
    try:
        sock.bind("\0" + abstract)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            return None
        raise _refused(exc, what) from exc
    return sock


def _refused(exc: OSError, what: str) -> OSError:
    """``exc`` as ``PortError`` (``what`` is refused here: an LSM or seccomp profile), or
    as it is where a resource ran out (descriptors, memory: the test's start fails too,
    and says why)."""
    from ..proc.workdir import EXHAUSTED  # here: a session that leases no port never loads it

    if exc.errno in EXHAUSTED:
        return exc
    code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return PortError(
        f"no {PORT_ENV} can be leased: {what} is refused here ({code}: {exc.strerror}; "
        f"an LSM or seccomp profile?); {_WITHOUT}"
    )


def _bindable(port: int) -> bool:
    """Whether a TCP server could listen on ``port`` now (all IPv4 addresses, as
    torch's TCPStore does)."""
    try:
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    except OSError as exc:
        raise _refused(exc, "making a TCP socket to test the ports") from exc
    with contextlib.closing(tcp) as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def _taken(ports: range, busy: int) -> str:
    """Why no port of ``ports`` is free: ``busy`` names held (by whom, where the kernel
    tells), the rest bound by other programs."""
    span = f"no free {PORT_ENV} in {ports.start}-{ports.stop - 1}"
    parts = []
    if busy:
        owners = _owners({("\0" + name(p)).encode() for p in ports})
        uids = list(owners.values()) if owners is not None else []
        others = sorted({uid for uid in uids if uid != os.getuid()})
        mine = uids.count(os.getuid())
        if others:
            parts.append(
                f"{len(uids) - mine} of its names held by processes of another user (uid "
                f"{', '.join(map(str, others))}), as any local user can (abstract socket "
                "names have no owner)"
            )
        if mine:
            parts.append(f"{mine} of its names held by your own processes")
        if busy > len(uids):
            parts.append(f"{busy - len(uids)} of its names held, by whom is unknown")
    if busy < len(ports):
        bound = len(ports) - busy
        parts.append(f"{bound} port{'s' if bound != 1 else ''} bound by other programs")
    return f"{span}: {'; '.join(parts)}"


# sock_diag (linux/sock_diag.h, linux/unix_diag.h)
_NETLINK_SOCK_DIAG, _SOCK_DIAG_BY_FAMILY = 4, 20
_NLM_F_REQUEST, _NLM_F_DUMP, _NLMSG_ERROR, _NLMSG_DONE = 0x1, 0x300, 2, 3
_UDIAG_SHOW_NAME, _UDIAG_SHOW_UID, _UNIX_DIAG_NAME, _UNIX_DIAG_UID = 0x1, 0x40, 0, 7
_HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, sequence, port id
_ATTR = struct.Struct("=HH")  # rtattr: length, type
_MSG = 16  # unix_diag_msg: family, type, state, pad, inode, cookie[2]


def _owners(names: set[bytes]) -> dict[bytes, int] | None:
    """For each of the abstract ``names`` bound now, the uid that made its socket (the
    kernel's record, which the holder cannot change), from one sock_diag dump of the
    Unix sockets; None where the kernel does not tell (netlink refused, or a kernel
    before Linux 5.3, which gives no uid)."""
    show = _UDIAG_SHOW_NAME | _UDIAG_SHOW_UID
    request = struct.pack("=BBHIII2I", socket.AF_UNIX, 0, 0, 0xFFFFFFFF, 0, show, 0, 0)
    flags = _NLM_F_REQUEST | _NLM_F_DUMP
    request = _HEADER.pack(_HEADER.size + len(request), _SOCK_DIAG_BY_FAMILY, flags, 1, 0) + request
    found: dict[bytes, int] = {}
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG) as sock:
            sock.settimeout(2)
            sock.sendto(request, (0, 0))
            while data := sock.recv(1 << 16):
                at = 0
                while at + _HEADER.size <= len(data):
                    length, kind = _HEADER.unpack_from(data, at)[:2]
                    if kind == _NLMSG_DONE:
                        return found
                    if kind == _NLMSG_ERROR or length < _HEADER.size:
                        return None
                    sock_name, uid = _attributes(data[at + _HEADER.size : at + length])
                    if sock_name in names:
                        if uid is None:
                            return None
                        found[sock_name] = uid
                    at += (length + 3) & ~3
    except (OSError, struct.error):
        pass
    return None


def _attributes(message: bytes) -> tuple[bytes | None, int | None]:
    """The name and uid attributes of one unix_diag_msg."""
    sock_name = uid = None
    at = _MSG
    while at + _ATTR.size <= len(message):
        length, kind = _ATTR.unpack_from(message, at)
        if length < _ATTR.size:
            break
        value = message[at + _ATTR.size : at + length]
        if kind == _UNIX_DIAG_NAME:
            sock_name = value
        elif kind == _UNIX_DIAG_UID and len(value) == 4:
            uid = struct.unpack("=I", value)[0]
        at += (length + 3) & ~3
    return sock_name, uid
