"""Build the native parts; all metadata is in pyproject.toml.

* ``pytest_gpuiso._lease`` (native/gpuiso_lease.c): the GPU lease table, a Python extension.
* ``pytest_gpuiso._fork`` (native/gpuiso_fork.c): ``fork_sibling()``, one fork whose child is
  the caller's sibling, for the fork server.
* ``pytest_gpuiso._shmtrace`` (native/gpuiso_shmtrace.c): a plain shared library that
  isolated tests run with in LD_PRELOAD, logging the /dev/shm entries they create.
  setuptools builds it like an extension (same compiler, same install location);
  Python never imports it.

Building needs a C compiler and Python's headers; without them the build stops with one
line saying what to install (``toolchain_problem``), not a compiler's traceback.

They are built on Linux only, and not even there with ``GPUISO_NO_NATIVE`` set (not "" or
"0"; CI tests that path on Linux): the wheel is then pure Python (py3-none-any), needs no
compiler, and its plugin runs every test in-process (``pytest_gpuiso.native``).
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build import build
from setuptools.command.build_ext import build_ext
from setuptools.command.editable_wheel import editable_wheel

INSTALL_HINT = (
    "install gcc and the Python headers (Debian/Ubuntu: apt-get install gcc python3-dev; "
    "Fedora/RHEL: dnf install gcc python3-devel; Alpine: apk add gcc musl-dev python3-dev), "
    "or install a prebuilt wheel"
)


# pytest_gpuiso/native.py spells it too: setup.py does not import the package it builds.
NO_NATIVE_ENV = "GPUISO_NO_NATIVE"


def no_native() -> str | None:
    """Why the extensions are not built here, in a few words; None when they are."""
    if not sys.platform.startswith("linux"):
        return f"not Linux ({sys.platform})"
    if os.environ.get(NO_NATIVE_ENV, "") not in ("", "0"):
        return f"{NO_NATIVE_ENV} is set"
    return None


def toolchain_problem() -> str | None:
    """What is missing to compile the extensions, in one line; None when nothing is.

    The compiler is the one setuptools will call: $CC, else the one Python was built with.
    """
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    words = shlex.split(cc)
    if not words or shutil.which(words[0]) is None:
        return f"no C compiler found (CC={cc!r})"
    header = os.path.join(sysconfig.get_paths()["include"], "Python.h")
    if not os.path.exists(header):
        return f"the Python headers are missing (no {header})"
    return None


def _require_toolchain() -> None:
    problem = toolchain_problem()
    if problem is not None:
        # SystemExit's message is all setuptools prints: one line, not a traceback.
        raise SystemExit(f"error: pytest-gpuiso cannot be built: {problem}: {INSTALL_HINT}")


def _checked(command: type) -> type:
    """``command`` checking the toolchain first, so the error is the first thing it says.

    ``build`` (wheels) and ``editable_wheel`` (``pip install -e``) check before anything is
    copied; ``build_ext`` also checks, for ``setup.py build_ext -i``.
    """

    def run(self) -> None:
        _require_toolchain()
        command.run(self)

    return type(command.__name__, (command,), {"run": run})


EXTENSIONS = [
    Extension(
        "pytest_gpuiso._lease",
        sources=["native/gpuiso_lease.c"],
        extra_compile_args=[
            "-std=gnu11",
            "-Wall",
            "-Wextra",
            "-Wno-missing-field-initializers",
        ],
    ),
    Extension(
        "pytest_gpuiso._fork",
        sources=["native/gpuiso_fork.c"],
        extra_compile_args=["-std=gnu11", "-Wall", "-Wextra"],
    ),
    Extension(
        "pytest_gpuiso._shmtrace",
        sources=["native/gpuiso_shmtrace.c"],
        libraries=["dl"],
        extra_compile_args=["-std=gnu11", "-Wall", "-Wextra"],
    ),
]

skipped = no_native()
if skipped is None:
    setup(
        cmdclass={cmd.__name__: _checked(cmd) for cmd in (build, build_ext, editable_wheel)},
        ext_modules=EXTENSIONS,
    )
else:
    # Nothing to compile, so no toolchain to check: a pure-Python wheel.
    print(f"pytest-gpuiso: {skipped}: building without the C extensions", file=sys.stderr)
    setup()
