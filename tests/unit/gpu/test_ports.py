"""MASTER_PORT leases where none can be had: every name of the range taken (by this user,
by another user, by whom unknown) or binding abstract Unix socket names refused (an LSM or
seccomp profile) is a ``PortError`` saying which, never another exception and never a
message blaming other isolated tests it cannot know of. The ranges here are short and
below the plugin's (29500-31499), so that no session running meanwhile loses a port.
Whole sessions that run without a port are in tests/sessions/gpus/test_port_degrade.py."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys

import pytest

from pytest_gpuiso.gpu import ports
from tests.helpers.ports import names_held, port_name

NOBODY = 65534


def _all_names_held(size: int = 2):
    """Ports 28300-29299 (apart from the session tests' block) whose names this process holds."""
    return names_held(28300, 29299, size)


def _refuse_abstract_binds(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    """Binding an abstract Unix socket name fails with ``code``, as under an AppArmor
    profile with unix rules or a seccomp filter; every other bind works."""
    bind = socket.socket.bind

    def refused(sock: socket.socket, address) -> None:
        if sock.family == socket.AF_UNIX and str(address).startswith("\0"):
            raise OSError(code, os.strerror(code))
        bind(sock, address)

    monkeypatch.setattr(socket.socket, "bind", refused)


@pytest.mark.parametrize("code", [errno.EACCES, errno.EPERM])
def test_abstract_binds_refused_are_a_port_error_saying_so(monkeypatch, code):
    _refuse_abstract_binds(monkeypatch, code)
    with pytest.raises(ports.PortError) as raised:
        ports.lease(range(28290, 28292))
    message = str(raised.value)
    assert f"refused here ({errno.errorcode[code]}: {os.strerror(code)};" in message
    assert "run without MASTER_ADDR and MASTER_PORT" in message
    assert "isolated tests," not in message and "held" not in message


def test_running_out_of_descriptors_is_still_an_os_error(monkeypatch):
    """The test's start fails for the same reason, and says so (the runner's path)."""
    _refuse_abstract_binds(monkeypatch, errno.EMFILE)
    with pytest.raises(OSError) as raised:
        ports.lease(range(28290, 28292))
    assert raised.value.errno == errno.EMFILE
    assert not isinstance(raised.value, ports.PortError)


def test_every_name_held_by_this_user_names_no_isolated_tests():
    with _all_names_held() as span, pytest.raises(ports.PortError) as raised:
        ports.lease(span)
    message = str(raised.value)
    assert message.startswith(
        f"no free MASTER_PORT in {span.start}-{span.stop - 1}: "
        "2 of its names held by your own processes; isolated tests run without"
    )
    assert "other isolated tests" not in message


def test_who_holds_the_names_unknown_is_said(monkeypatch):
    """Where the kernel does not say who holds a name (no sock_diag, or no uid in it)."""
    monkeypatch.setattr(ports, "_owners", lambda names: None)
    unknown = r": 2 of its names held, by whom is unknown;"
    with _all_names_held() as span, pytest.raises(ports.PortError, match=unknown):
        ports.lease(span)


@pytest.mark.skipif(os.geteuid() != 0, reason="takes another user's uid: needs root")
def test_names_squatted_by_another_user_are_named_as_such():
    """Another user's process binds this user's names (any local user can): the message
    names its uid, as the kernel records it, and says the names have no owner."""
    with _all_names_held(1) as free:  # a free name, let go of for the squatter
        port = free.start
    squat = (
        f"import os, socket, time\nos.setuid({NOBODY})\ns = socket.socket(socket.AF_UNIX)\n"
        f"s.bind({port_name(port)!r})\nprint('holding', flush=True)\ntime.sleep(60)\n"
    )
    squatter = subprocess.Popen([sys.executable, "-c", squat], stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout.readline().strip() == "holding"
        with pytest.raises(ports.PortError) as raised:
            ports.lease(range(port, port + 1))
    finally:
        squatter.kill()
        squatter.wait()
    assert f": 1 of its names held by processes of another user (uid {NOBODY}), as any " in str(
        raised.value
    )
    assert "abstract socket names have no owner" in str(raised.value)


def test_a_free_name_of_a_bound_port_is_skipped_and_said():
    """A port whose name is free but that some program listens on is not leased."""
    with _all_names_held(1) as free:
        port = free.start
    with socket.socket() as other:
        other.bind(("", port))
        with pytest.raises(ports.PortError, match=r": 1 port bound by other programs;"):
            ports.lease(range(port, port + 1))


def test_the_default_range_is_read_when_leasing(monkeypatch):
    """``lease()`` leases from ``PORTS`` as it is then (a session's conftest may shrink it)."""
    with _all_names_held(1) as free:
        port = free.start
    monkeypatch.setattr(ports, "PORTS", range(port, port + 1))
    got = ports.lease()
    assert got.port == port
    assert got.env() == {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    got.release()
