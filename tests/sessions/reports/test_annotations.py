"""GitHub's annotation limits, handled on purpose (issue 50): a session with more leaks
than GitHub shows annotations of a level, on a pull request that changed one of its two
test files. The changed file's tests are annotated first, at their def (not their first
decorator), and one last notice counts what did not fit and names its tests."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from pytest_gpuiso.reports import findings
from tests.helpers import GpuIso, program

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(where, *args: str) -> None:
    subprocess.run(["git", *args], cwd=where, check=True, capture_output=True, timeout=60)


def _pull_request(gpuiso: GpuIso) -> None:
    """A repository whose main branch has both files, and a pull request (checked out)
    that changed test_b_changed.py only; origin/main as a checkout fetches it."""
    for name in ("test_a_kept.py", "test_b_changed.py"):
        shutil.copy(program("annotated_leaks.py"), gpuiso.path / name)
    where = gpuiso.path
    _git(where, "init", "-q", "-b", "main")
    _git(where, "add", "test_a_kept.py", "test_b_changed.py")
    _git(where, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base")
    _git(where, "update-ref", "refs/remotes/origin/main", "HEAD")
    _git(where, "checkout", "-qb", "pr")
    with open(where / "test_b_changed.py", "a") as f:
        f.write("# changed by the pull request\n")
    _git(where, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "pr")


def _annotations(result: pytest.RunResult) -> list[str]:
    return [line for line in result.stdout.lines if line.startswith("::")]


def test_the_pull_requests_files_first_and_one_notice_for_the_rest(
    gpuiso_spawn: GpuIso, shm_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _pull_request(gpuiso_spawn)
    monkeypatch.setenv(findings.GITHUB_ENV, "true")
    monkeypatch.setenv(findings.WORKSPACE_ENV, str(gpuiso_spawn.path))
    monkeypatch.setenv(findings.BASE_REF_ENV, "main")
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    result = gpuiso_spawn.run("--gpu-isolate-cleanup")
    result.assert_outcomes(passed=12)
    shown = _annotations(result)
    assert len(shown) == findings.PER_LEVEL + 1
    files = [line.split(",")[0] for line in shown[: findings.PER_LEVEL]]
    assert files == ["::warning file=test_b_changed.py"] * 2 + ["::warning file=test_a_kept.py"] * 8
    # at the tests' def, under their two decorators (pytest's location is the first's line)
    source = program("annotated_leaks.py").read_text().splitlines()
    lines = {line.split(",")[1] for line in shown[: findings.PER_LEVEL]}
    assert lines == {f"line={source.index('def test_leaks(n):') + 1}"}
    assert shown[-1].startswith("::notice title=pytest-gpuiso%3A 2 more not shown::2 more ")
    assert "(2 warnings; GitHub shows 10 annotations of each level a step" in shown[-1]
    assert "in test_a_kept.py::test_leaks[8], test_a_kept.py::test_leaks[9];" in shown[-1]

    # Not a pull request's run: the report's order (by node id), the rest counted alike.
    monkeypatch.delenv(findings.BASE_REF_ENV)
    shown = _annotations(
        gpuiso_spawn.run("--gpu-isolate-cleanup", "test_a_kept.py", "test_b_changed.py")
    )
    assert [line.split(",")[0] for line in shown[: findings.PER_LEVEL]] == [
        "::warning file=test_a_kept.py"
    ] * 10
    assert "in test_b_changed.py::test_leaks[0], test_b_changed.py::test_leaks[1];" in shown[-1]
