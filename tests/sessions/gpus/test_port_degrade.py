"""Sessions where no MASTER_PORT can be leased: every name of the range taken (by
anyone: abstract socket names have no owner), or binding them refused (an LSM or
seccomp profile). The isolated tests run all the same, without MASTER_ADDR or
MASTER_PORT, and the session says why once, as a GpuIsoStartWarning; no test errors
and the session never ends in an INTERNALERROR. What ``ports.lease`` says in each case
is in tests/unit/gpu/test_ports.py."""

from __future__ import annotations

import pytest

from tests.helpers import REPORT, GpuIso, program
from tests.helpers.ports import names_held

PROGRAM = "port_degrade.py"
WITHOUT = "isolated tests run without MASTER_ADDR and MASTER_PORT from now on*"


def _all_names_held(size: int = 2):
    """Ports 29300-29499 whose names this process holds: below the plugin's, so no
    session running meanwhile loses a port."""
    return names_held(29300, 29499, size)


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
