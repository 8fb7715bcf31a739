"""Which GPU each of a session's device names is: its UUID, the lease table's row.

A session may call one GPU ``0`` (``CUDA_VISIBLE_DEVICES=0``), another its UUID (NVML
discovery, where a GPU is in MIG mode) or a prefix of it: each must lease the one row
of that GPU. With NVML, an index is NVML's when the numbering is the PCI bus order
(NVML's own, or ``CUDA_DEVICE_ORDER=PCI_BUS_ID``) or every GPU is one model (CUDA's
default order, the fastest first, is then the PCI order); otherwise, and for every name
where NVML cannot be loaded (a container with the CUDA driver only), CUDA itself is asked,
in a fresh process (``python -I identity.py``: ``cuDeviceGetUuid_v2``, no context), never
in pytest's. Without NVML, CUDA also says each GPU's memory (``cuDeviceTotalMem``).

CUDA is given ``ASK_TIMEOUT`` seconds to answer. A name it cannot place then (no answer in
time, or an answer cut short) is never keyed by a guess, which could give one GPU to two
sessions: ``SpecError`` refuses the session in one line saying how to name the GPUs
instead. Where CUDA cannot be initialised at all (no driver, a stub, no device) no test
can use a GPU through it either: the names key themselves (NVML's reading where it has
one), as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Protocol

# Seconds CUDA gets to say which GPU each name is: cuInit takes < 1 s on a healthy
# machine, but tens of seconds on one of many GPUs without persistence mode.
ASK_TIMEOUT = 120.0
KILL_WAIT = 5.0  # seconds a killed helper gets to end before it is left behind
# The helper's exit status: CUDA cannot be initialised (no driver, a stub library: no test
# can use a GPU through it); it shows no GPU (the first name is none); it was initialised
# but could not say (one line why).
NO_CUDA, NONE_SHOWN, FAILED = 2, 3, 1
NO_DEVICE = 100  # CUDA_ERROR_NO_DEVICE: what cuInit answers when the names show no GPU


class Named(Protocol):
    names: tuple[str, ...]
    source: str
    via: str

    @property
    def in_pci_order(self) -> bool: ...


class IdentitySource(Protocol):
    def available(self) -> bool: ...

    def identity(self, device: str) -> str | None: ...

    def uuids(self) -> list[str]: ...

    def models(self) -> set[str]: ...


@dataclass(frozen=True)
class Identity:
    """One name's row in the lease table, and its memory where only CUDA could say it."""

    key: str  # the GPU's UUID (a MIG instance's own), or the name where no GPU answers to it
    total: int = 0  # bytes, from CUDA (asked only without NVML); 0: not known here


def identities(devices: Named, nvml: IdentitySource) -> list[Identity]:
    """Each name's identity; ``SpecError`` when CUDA must be asked and cannot say."""
    from . import rocm

    names = list(devices.names)
    if devices.via != rocm.CUDA or not names:
        return [Identity(name) for name in names]
    if not nvml.available():  # CUDA alone can say: every name is asked
        asked = ask_cuda(names, devices.source)
        return [Identity(*asked[name]) if name in asked else Identity(name) for name in names]
    indices = [name for name in names if name.isdigit()]
    keys: dict[str, str] = {}
    if indices and not devices.in_pci_order and len(nvml.models()) > 1:
        by_hex = {_hex(uuid): uuid for uuid in nvml.uuids()}
        for name, (uuid, _total) in ask_cuda(indices, devices.source).items():
            keys[name] = by_hex.get(_hex(uuid), uuid)
    return [Identity(keys.get(name) or nvml.identity(name) or name) for name in names]


def ask_cuda(names: list[str], source: str, pci_order: bool = False) -> dict[str, tuple[str, int]]:
    """CUDA's (UUID, bytes) of each name it shows a GPU for, each name read as a test's
    process reads it (``pci_order``: an index in the PCI bus order, NVML's); {} where CUDA
    cannot be initialised. ``SpecError`` when it does not answer within ``ASK_TIMEOUT``
    or fails after its initialisation."""
    found: dict[str, tuple[str, int]] = {}
    deadline = time.monotonic() + ASK_TIMEOUT
    rest = list(names)
    while rest:  # CUDA's list ends at a name that is no GPU (or one named twice): ask on
        said = _ask(rest, source, deadline, pci_order)
        if said is None:
            return found
        found.update(zip(rest, said, strict=False))
        rest = rest[len(said) :] if said else rest[1:]
    return found


def _ask(
    names: list[str], source: str, deadline: float, pci_order: bool
) -> list[tuple[str, int]] | None:
    """One helper's answer for ``names``: (UUID, bytes) of each GPU CUDA shows, in order;
    None when CUDA cannot be initialised."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(names)}
    if pci_order:
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    try:  # -I: the standard library only, none of the user's or our start-up costs
        proc = subprocess.Popen(
            [sys.executable, "-I", os.path.abspath(__file__)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
    except OSError as exc:  # out of processes: CUDA was not asked, so it cannot say
        why = f"no process to ask CUDA ({exc.strerror or exc})"
        raise _cannot_tell(names, source, why) from None
    try:
        said, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 0.0))
    except subprocess.TimeoutExpired:
        proc.kill()  # a helper stuck in the driver (uninterruptible) is left behind
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=KILL_WAIT)
        raise _cannot_tell(names, source, f"CUDA did not answer within {ASK_TIMEOUT:g} s") from None
    lines = said.splitlines()
    if proc.returncode == NO_CUDA:
        return None
    if proc.returncode == NONE_SHOWN:
        return []
    if proc.returncode != 0:
        why = lines[-1] if lines else f"exit status {proc.returncode}"
        raise _cannot_tell(names, source, f"CUDA could not say ({why})")
    found = []
    for name, line in zip(names, lines, strict=False):
        digits, _, total = line.partition(" ")
        found.append((_uuid_text(digits, name), int(total or 0)))
    return found


def _cannot_tell(names: list[str], source: str, why: str) -> Exception:
    from ..values import SpecError

    return SpecError(
        f"cannot tell which GPU {source} names {','.join(names)}: {why}; not leased by a "
        "guess, which could give one GPU to two sessions: name the GPUs by UUID "
        "(nvidia-smi -L), or with NVML set CUDA_DEVICE_ORDER=PCI_BUS_ID"
    )


def _uuid_text(digits: str, name: str) -> str:
    """CUDA's 32 hex digits as NVML writes the UUID: ``GPU-8f3e1a2b-...`` (``MIG-`` for a
    MIG instance, named so)."""
    kind = "MIG-" if name.startswith("MIG-") else "GPU-"
    parts = (digits[:8], digits[8:12], digits[12:16], digits[16:20], digits[20:32])
    return kind + "-".join(parts)


def _hex(uuid: str) -> str:
    return uuid.split("-", 1)[-1].replace("-", "").lower()


def main() -> int:
    """Print each GPU CUDA shows, in its order: its UUID (32 hex digits) and its memory in
    bytes. Exit ``NO_CUDA`` when CUDA cannot be initialised (no driver, a stub),
    ``NONE_SHOWN`` when it shows no GPU, ``FAILED`` with one line when it cannot say."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        init, count_of, device_of = cuda.cuInit, cuda.cuDeviceGetCount, cuda.cuDeviceGet
    except (OSError, AttributeError):  # no driver, or a library that is not one
        return NO_CUDA
    count, device = ctypes.c_int(), ctypes.c_int()
    code = init(0)
    if code == NO_DEVICE:
        return NONE_SHOWN
    if code != 0 or count_of(ctypes.byref(count)) != 0:
        return NO_CUDA
    if count.value == 0:
        return NONE_SHOWN
    uuid_of = getattr(cuda, "cuDeviceGetUuid_v2", None) or getattr(cuda, "cuDeviceGetUuid", None)
    total_of = getattr(cuda, "cuDeviceTotalMem_v2", None)
    if uuid_of is None:
        print("the CUDA driver has no cuDeviceGetUuid", flush=True)
        return FAILED
    for ordinal in range(count.value):
        uuid, total = (ctypes.c_ubyte * 16)(), ctypes.c_size_t()
        if device_of(ctypes.byref(device), ordinal) != 0:
            print(f"cuDeviceGet({ordinal}) failed", flush=True)
            return FAILED
        code = uuid_of(ctypes.byref(uuid), device)
        if code != 0:
            print(f"cuDeviceGetUuid({ordinal}): CUDA error {code}", flush=True)
            return FAILED
        if total_of is None or total_of(ctypes.byref(total), device) != 0:
            total.value = 0
        print(bytes(uuid).hex(), total.value, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
