"""Build the native parts; all metadata is in pyproject.toml.

* ``pytest_gpuiso._lease`` (native/gpuiso_lease.c): the GPU lease table, a Python extension.
* ``pytest_gpuiso._fork`` (native/gpuiso_fork.c): ``fork_sibling()``, one fork whose child is
  the caller's sibling, for the fork server.
* ``pytest_gpuiso._shmtrace`` (native/gpuiso_shmtrace.c): a plain shared library that
  isolated tests run with in LD_PRELOAD, logging the /dev/shm entries they create.
  setuptools builds it like an extension (same compiler, same install location);
  Python never imports it.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
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
)
