"""Whether pytest's process starts the fork server's interpreter before its conftests load
(``plugin._early_server``): only where a fork server will serve every test, as far as the
options known then tell; never where pytest-cov measures subprocesses."""

from __future__ import annotations

import contextlib
import os

import pytest

from pytest_gpuiso.parent import serving

# (arguments, ini lines, what prestart is called with: whether the /dev/shm shim is
# preloaded into it; [] where it is not called)
EARLY = [
    ((), "", []),  # nothing isolated
    (("--gpu-isolate",), "", [True]),
    ((), "gpu_isolate = true", [True]),
    (("--gpu-isolate", "--gpu-isolate-leaks=off"), "", [False]),
    (("--gpu-isolate", "--gpu-isolate-start=spawn"), "", []),
    ((), "gpu_isolate = true\ngpu_isolate_start = spawn", []),
    (("--gpu-isolate", "--collect-only"), "", []),
    (("--gpu-isolate", "--pdb"), "", []),
    (("--gpu-isolate", "-n", "2"), "", []),  # an xdist controller runs no test
    (("--gpu-isolate", "--gpu-isolate-timeout=never"), "", []),  # an error, said later
]


@pytest.mark.parametrize(("args", "ini", "early"), EARLY)
def test_started_early_only_where_a_fork_server_serves_every_test(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, args, ini, early
) -> None:
    pytest.importorskip("xdist")
    shims: list[bool] = []
    monkeypatch.setattr(serving, "prestart", shims.append)
    monkeypatch.delenv("COVERAGE_PROCESS_START", raising=False)
    for name in [n for n in os.environ if n.startswith("COV_CORE_")]:
        monkeypatch.delenv(name)
    pytester.makeini(f"[pytest]\n{ini}\n")
    with contextlib.suppress(pytest.UsageError):  # a bad value: said at configure
        pytester.parseconfig("-p", "xdist", *args)
    assert shims == early


def test_not_where_pytest_cov_measures_subprocesses(pytester, monkeypatch) -> None:
    shims: list[bool] = []
    monkeypatch.setattr(serving, "prestart", shims.append)
    monkeypatch.setenv("COV_CORE_SOURCE", "src")
    pytester.parseconfig("--gpu-isolate")
    assert shims == []
