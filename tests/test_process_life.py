"""Issue 31: a test's process lives as a Python process does for the code it runs. Dead
classes are collected before what exists is frozen out of garbage collection, and at its
end threading's exit hooks and multiprocessing's finalizers run (not atexit's handlers,
as in multiprocessing's own processes), under both start methods."""

from __future__ import annotations

from tests.helpers import GpuIso

PROGRAM = "process_life.py"


def test_garbage_is_collected_and_the_exit_ends_what_multiprocessing_started(
    gpuiso: GpuIso, lease_region
):
    gpuiso.copy(PROGRAM)
    result = gpuiso.run("--gpu-isolate", "--gpu-isolate-leaks=fail", "-p", "no:randomly", PROGRAM)
    text = result.stdout.str()
    result.assert_outcomes(passed=3)
    assert "leaked semaphore" not in text + result.stderr.str()
    assert "gpu-isolate leaks" not in text
    assert not list(gpuiso.path.glob("atexit-*.txt"))  # as in a multiprocessing.Process


def test_a_spawned_process_preloads_only_what_its_test_imports(gpuiso_spawn: GpuIso, lease_region):
    """Prewarmed spawned processes import a preload module only for tests whose module
    (or conftest) imports it: test_plain's never import it, test_uses' get it ahead."""
    gpuiso_spawn.copy("preload_used")
    used = gpuiso_spawn.path / "preload_used"
    (used / "heavy_mod.py").rename(gpuiso_spawn.path / "heavy_mod.py")  # on sys.path
    result = gpuiso_spawn.run(
        "--gpu-isolate",
        "--gpu-isolate-preload=heavy_mod",
        "--gpu-isolate-prewarm=2",
        "-p",
        "no:randomly",
        "preload_used/test_plain.py",
        "preload_used/test_uses.py",
        "preload_used/test_plain.py::test_plain[0]",
    )
    result.assert_outcomes(passed=6)
    assert "prewarmed" in result.stdout.str()
