"""Whether isolation can work here: Linux, and the package's C extensions installed.

setup.py builds the extensions (``_fork``, ``_lease``, ``_shmtrace``: native/) on Linux
only, and not even there when ``GPUISO_NO_NATIVE`` is set (not "" or "0") at build time:
such a wheel is pure Python, installs anywhere, and its plugin still registers its
markers, options and ini keys, with isolation off. ``missing()`` says why, for the header.
"""

from __future__ import annotations

import sys
from importlib.util import find_spec

# Read by setup.py at build time (which spells it again: it cannot import the package).
NO_NATIVE_ENV = "GPUISO_NO_NATIVE"
EXTENSIONS = ("pytest_gpuiso._fork", "pytest_gpuiso._lease", "pytest_gpuiso._shmtrace")

IN_PROCESS = "every test runs in-process"
NOT_LINUX = "isolation needs Linux (this is {platform}); " + IN_PROCESS
NOT_BUILT = f"built without its C extensions ({NO_NATIVE_ENV}); " + IN_PROCESS
SOME_MISSING = (
    "its C extensions are incomplete (no {names}): reinstall pytest-gpuiso; " + IN_PROCESS
)


def missing() -> str | None:
    """None when isolation can work here, else why not in one line for the header.

    The extensions are looked up (``find_spec``), not imported: ``_shmtrace`` is an
    LD_PRELOAD library that Python never imports, and the others load when first used.
    """
    if not sys.platform.startswith("linux"):
        return NOT_LINUX.format(platform=sys.platform)
    absent = [name for name in EXTENSIONS if find_spec(name) is None]
    if not absent:
        return None
    if len(absent) == len(EXTENSIONS):  # on Linux, only GPUISO_NO_NATIVE builds none
        return NOT_BUILT
    return SOME_MISSING.format(names=", ".join(name.rpartition(".")[2] for name in absent))
