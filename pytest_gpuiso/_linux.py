"""The few Linux process controls the standard library lacks (prctl through ctypes)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36

_libc = None


def _prctl(option: int, arg: int) -> bool:
    global _libc
    if not sys.platform.startswith("linux"):
        return False
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return _libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0) == 0


def set_child_subreaper() -> bool:
    """Make orphaned descendants re-parent to this process instead of init."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent(expected_parent: int, sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` when our parent dies; exit now if it already has.

    The re-check closes the race where the parent died before the prctl call.
    """
    _prctl(PR_SET_PDEATHSIG, int(sig))
    if os.getppid() != expected_parent:
        os._exit(70)
