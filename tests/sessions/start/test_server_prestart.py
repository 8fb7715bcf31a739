"""The fork server's interpreter starts before pytest's conftests load, when every test
is forked by it: it imports pytest and ours while pytest's process configures and
collects. Its tests still see what the conftests set (a variable, ``sys.path``); a
variable an interpreter reads as it starts (``PYTHONHASHSEED``), set by a conftest, gets
a server started afresh, as before.

fixtures/programs/start/server_prestart: its conftest sets them and starts a marker
process; the pids order the server's start and the marker's (the server is the test's
ancestor that is pytest's child)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pytest_gpuiso.wire.environment import OWNER_ENV
from tests.helpers import make_gpuiso

PROGRAM = "server_prestart"


def _run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, *args: str) -> dict:
    gpuiso = make_gpuiso(pytester, monkeypatch, "forkserver")
    gpuiso.copy(PROGRAM)
    out = pytester.path / "prestart.json"
    monkeypatch.setenv("PRESTART_OUT", str(out))
    monkeypatch.setenv("OWNER_NAME", OWNER_ENV)
    result = gpuiso.run("--gpu-isolate", *args, PROGRAM)
    result.assert_outcomes(passed=1)
    return json.loads(out.read_text())


def test_the_server_starts_before_the_conftests_and_sees_what_they_set(pytester, monkeypatch):
    seen = _run(pytester, monkeypatch)
    assert seen["server"] < seen["marker"], seen  # started before the conftest loaded
    assert (seen["module"], seen["path"]) == ("extra", True)
    assert seen["owned"] == [True, True]  # exec'd with the session's mark, as before


def test_a_conftest_setting_a_startup_variable_gets_a_fresh_server(pytester, monkeypatch):
    monkeypatch.setenv("PRESTART_SEED", "1234")
    seen = _run(pytester, monkeypatch)
    assert seen["server"] > seen["marker"], seen  # the early one was discarded
    env = {**os.environ, "PYTHONHASHSEED": "1234"}
    fresh = subprocess.run(
        [sys.executable, "-c", "print(hash('gpuiso'))"], env=env, capture_output=True, text=True
    )
    assert seen["hash"] == int(fresh.stdout)  # its interpreter started with the seed
