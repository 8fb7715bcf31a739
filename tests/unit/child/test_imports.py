"""Which preload modules a test's process needs: those its files import."""

from __future__ import annotations

from pytest_gpuiso.child import imports


def test_the_preload_modules_a_test_needs_are_those_its_files_import(tmp_path):
    (tmp_path / "conftest.py").write_text("import numpy as np\n")
    (tmp_path / "sub").mkdir()
    module = tmp_path / "sub" / "test_x.py"
    module.write_text(
        "import os, einops.layers as layers\n"
        "from safetensors import numpy\n"
        "def test_t():\n"
        "    torch = pytest.importorskip('torch')\n"
        '    jax = importlib.import_module("jax")\n'
    )
    preload = ("torch", "numpy", "einops", "cattrs", "safetensors.torch", "jax", "scipy")
    assert imports.needed(preload, module) == (
        "torch",
        "numpy",
        "einops",
        "safetensors.torch",
        "jax",
    )
    assert imports.needed(preload, tmp_path / "missing.py") == ("numpy",)  # the conftest's
