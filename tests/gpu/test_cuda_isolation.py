"""GPU checks: each isolated test starts with a fresh, uninitialised CUDA context.

Skipped without CUDA or torch (tests/gpu/conftest.py). Run on a GPU machine:
`pytest tests/gpu -v`. The tests in fixtures/programs/gpus/gpu_state.py run isolated
inside pytester sessions; this module itself never imports torch nor initialises
CUDA in the pytest parent.
"""

from __future__ import annotations


def test_each_isolated_test_gets_a_clean_cuda_context(gpuiso):
    gpuiso.copy("gpu_state.py")
    result = gpuiso.run("--gpu-isolate", "-v", "gpu_state.py")
    result.assert_outcomes(passed=5)


def test_parent_never_initialises_cuda(gpuiso):
    gpuiso.copy("gpu_state.py")
    # The conftest is loaded by the isolated test processes too, where CUDA is expected:
    # the check runs only in the pytest parent (the one without the child plugin).
    gpuiso.pytester.makeconftest(
        "import sys\n"
        "from pytest_gpuiso.child.relay import CHILD_PLUGIN\n"
        "def pytest_sessionfinish(session):\n"
        "    if session.config.pluginmanager.has_plugin(CHILD_PLUGIN):\n"
        "        return\n"
        "    torch = sys.modules.get('torch')\n"
        "    assert torch is None or not torch.cuda.is_initialized(), 'CUDA in parent'\n"
        "    print('PARENT-CUDA-CLEAN')\n"
    )
    result = gpuiso.run("--gpu-isolate", "-s", "gpu_state.py")
    result.assert_outcomes(passed=5)
    result.stdout.fnmatch_lines(["*PARENT-CUDA-CLEAN*"])
