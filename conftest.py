"""The project's own tests (tests/): pytester, and how many xdist workers ``-n auto`` starts."""

from __future__ import annotations

import os

pytest_plugins = ["pytester"]


def pytest_xdist_auto_num_workers(config) -> int:
    """Two workers a core: most of the suite's time is spent waiting on the pytest runs it
    starts (their processes, sleeps and time-outs), not computing."""
    return 2 * len(os.sched_getaffinity(0))
