"""Build the one C extension (native/gpuiso_lease.c); all metadata is in pyproject.toml."""

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
        )
    ]
)
