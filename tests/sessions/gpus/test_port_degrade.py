"""Sessions where no MASTER_PORT can be leased: every name of the range taken (by
anyone: abstract socket names have no owner), or binding them refused (an LSM or
seccomp profile). The isolated tests run all the same, without MASTER_ADDR or
MASTER_PORT, and the session says why once, as a GpuIsoStartWarning; no test errors
and the session never ends in an INTERNALERROR. What ``ports.lease`` says in each case
is in tests/unit/gpu/test_ports.py."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from collections.abc import Iterator

import pytest

from tests.helpers import REPORT, GpuIso, program

PROGRAM = "port_degrade.py"
WITHOUT = "isolated tests run without MASTER_ADDR and MASTER_PORT from now on*"


def _name(port: int) -> str:
    """The abstract socket name that leases ``port`` to this user's isolated tests."""
    return f"\0pytest-gpuiso-master-port-{os.getuid()}-{port}"


@contextlib.contextmanager
def _all_names_held(size: int = 2) -> Iterator[range]:
    """A range of ``size`` ports (29300-29499: below the plugin's, so no session running
    meanwhile loses a port) whose names this process holds."""
    for base in range(29300, 29500, size):
        span = range(base, base + size)
        with contextlib.ExitStack() as held:
            try:
                for port in span:
                    sock = held.enter_context(socket.socket(socket.AF_UNIX))
                    sock.bind(_name(port))
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                continue
            yield span
            return
    pytest.fail("no block of free port names in 29300-29499")


@pytest.mark.parametrize("how", ["taken", "refused"])
def test_no_port_to_lease_runs_the_tests_without_one_said_once(
    gpuiso_spawn: GpuIso, lease_region, monkeypatch, how
):
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("GPUISO_PORTS_DENIED", how)
    gpuiso_spawn.copy(PROGRAM)
    (gpuiso_spawn.path / "conftest.py").write_text(program("port_denied_conftest.py").read_text())
    args = ("--gpu-isolate-devices=none", "-p", "no:randomly", REPORT, PROGRAM)
    with _all_names_held() as span:
        monkeypatch.setenv("GPUISO_PORTS", f"{span.start}-{span.stop - 1}")
        result = gpuiso_spawn.run(*args)
    result.assert_outcomes(passed=2, warnings=1)
    if how == "taken":
        why = (
            f"no free MASTER_PORT in {span.start}-{span.stop - 1}: 2 of its names held by your own"
        )
    else:
        why = "no MASTER_PORT can be leased: binding the abstract Unix socket names that lease "
        why += "ports is refused here (EACCES: Permission denied; an LSM or seccomp profile?)"
    result.stdout.fnmatch_lines(["*warnings summary*", f"*GpuIsoStartWarning: gpu-isolate: {why}*"])
    out = result.stdout.str() + result.stderr.str()
    assert out.count("GpuIsoStartWarning: gpu-isolate:") == 1
    assert "INTERNALERROR" not in out and "other isolated tests" not in out
    assert [r.get("master_port") for r in gpuiso_spawn.records().values()] == [None, None]
