"""The GPUs a session may lease, and each one's memory, found without a CUDA context.

From ``--gpu-isolate-devices`` when given, else the user's ``CUDA_VISIBLE_DEVICES`` (or
ROCm's variables), else NVML (nvidia-ml-py), else AMD's amdsmi, else none. Their memory
comes from NVML (without it, from the CUDA driver: ``identity``) or amdsmi, or is declared
(``--gpu-isolate-devices=0:80GiB``); a list the lease table cannot hold, or whose GPUs
cannot be told apart, is a ``SpecError`` naming its source.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from ..values import CUDA_ID, GpuMemory, SpecError, size_text
from . import rocm
from .identity import identities
from .nvml import NvmlReader


@dataclass(frozen=True)
class Devices:
    names: tuple[str, ...]
    source: str  # "--gpu-isolate-devices", "CUDA_VISIBLE_DEVICES", "NVML", ...
    pci_order: bool = False  # names are NVML indices: children need CUDA_DEVICE_ORDER=PCI_BUS_ID
    capacities: tuple[int, ...] = ()  # bytes per device (0: unknown); () : all unknown
    via: str = rocm.CUDA  # the variable the names are for: CUDA's, HIP's or ROCr's (AMD)
    # Each device's identity, its row in the lease table: the UUID (MIG UUID) where it can
    # be known, so that every session leases one GPU under one row whatever it calls it
    # ("0", "GPU-8f3e...", a prefix); () : the names themselves.
    keys: tuple[str, ...] = ()

    def key(self, name: str) -> str:
        return self.keys[self.names.index(name)] if self.keys else name

    def name_of(self, key: str) -> str | None:
        """This session's name of the table row ``key``; None: not one of its devices."""
        rows = self.rows()
        return self.names[rows.index(key)] if key in rows else None

    @property
    def in_pci_order(self) -> bool:
        """Whether an index names the GPU NVML numbers so (the PCI bus order): NVML's own
        names, or CUDA_DEVICE_ORDER=PCI_BUS_ID; else CUDA numbers the fastest first."""
        return self.pci_order or os.environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID"

    def reset_name(self, name: str) -> str:
        """How ``reset --device`` names the device (NVML's numbering): ``name``, unless
        it is an index CUDA may number otherwise (its default order): then its UUID."""
        return self.key(name) if self.keys and name.isdigit() and not self.in_pci_order else name

    def rows(self) -> list[str]:
        """The devices as the lease table keys them."""
        return list(self.keys or self.names)

    def capacity(self, name: str) -> int:
        return self.capacities[self.names.index(name)] if self.capacities else 0

    def sizes(self) -> list[int]:
        return list(self.capacities) if self.capacities else [0] * len(self.names)

    def describe(self) -> str:
        """``0,1``, or with their memory where known: ``0 (80 GiB), 1 (80 GiB)``."""
        if not any(self.sizes()):
            return ",".join(self.names)
        pairs = zip(self.names, self.sizes(), strict=True)
        return ", ".join(f"{name} ({size_text(size)})" if size else name for name, size in pairs)

    def shortfall(self, n: int, memory: GpuMemory | None = None) -> str | None:
        """None when ``n`` GPUs (with ``memory`` on each) can be leased here; else what the
        test needs and what there is: "N GPUs, <what there is> available"."""
        have = len(self.names)
        if n > have:
            found = f"{have} ({', '.join(self.names)})" if have else "none"
            return f"{n} GPU{'s' if n != 1 else ''}, {found} available"
        if n == 0 or memory is None or not memory.size:
            return None
        sizes = self.sizes()
        if sum(size >= memory.size for size in sizes if size) >= n:
            return None  # enough GPUs of known size fit it (the others are never chosen)
        if not all(sizes):  # bytes on a device of unknown size: say how to declare it
            name = self.names[sizes.index(0)]
            return (
                f"gpu_memory={memory.text} on {n} GPU{'s' if n != 1 else ''}, but the memory of "
                f"GPU {name} is unknown (no NVML): declare it with --gpu-isolate-devices="
                f"{name}:80GiB"
            )
        largest = sorted(sizes, reverse=True)[n - 1]
        return (
            f"gpu_memory={memory.text} ({size_text(memory.size)}) on {n} GPU"
            f"{'s' if n != 1 else ''}, the largest {'is' if n == 1 else 'are'} "
            f"{size_text(largest)}"
        )


def discover(
    setting: list[str] | None,
    what: str,
    declared: dict[str, int] | None = None,
    nvml: NvmlReader | None = None,
) -> Devices:
    """The devices to lease, with their memory (``declared`` sizes win over NVML's, read
    through ``nvml``: the session's reader); ``SpecError`` naming the source when the table
    cannot hold them."""
    if nvml is None:  # none of the session's: one for this call only
        nvml = NvmlReader()
        try:
            return discover(setting, what, declared, nvml)
        finally:
            nvml.close()
    declared = declared or {}
    if setting is not None:
        devices = Devices(tuple(setting), what)
        return _sized(_keyed(_checked(devices), nvml), declared, nvml)
    variable = "CUDA_VISIBLE_DEVICES"
    visible = os.environ.get(variable)
    amd = rocm.from_environment() if visible is None else None
    if amd is not None:
        variable, visible = amd
    if visible is not None:
        names = []
        for part in visible.split(","):  # CUDA (and HIP) stop at the first invalid entry
            part = part.strip()
            if not CUDA_ID.match(part):
                break
            names.append(part)
        devices = Devices(tuple(names), variable, via=variable)
        if amd is not None:
            return _sized_amd(_checked(devices, visible), declared)
        return _sized(_keyed(_checked(devices, visible), nvml), declared, nvml)
    names = tuple(nvml.devices())
    if not names:
        amd_gpus = _sized_amd(Devices((), "amdsmi", via=rocm.HIP), declared, found=True)
        if amd_gpus.names:
            return _checked(amd_gpus)
    devices = Devices(names, "NVML", pci_order=all(name.isdigit() for name in names))
    return _sized(_keyed(_checked(devices), nvml), declared, nvml)


def _sized_amd(devices: Devices, declared: dict[str, int], found: bool = False) -> Devices:
    """AMD ``devices`` with each one's memory, declared or from amdsmi; ``found``: the
    devices are amdsmi's own GPUs (none listed yet)."""
    smi = rocm.AmdSmi()
    try:
        names = tuple(smi.names()) if found else devices.names
        sizes = tuple(declared.get(name) or smi.total(name) for name in names)
    finally:
        smi.close()
    return Devices(names, devices.source, devices.pci_order, sizes if names else (), devices.via)


def _sized(devices: Devices, declared: dict[str, int], nvml: NvmlReader) -> Devices:
    """``devices`` with each one's memory: declared, else NVML's total, else CUDA's where
    it was asked (``_keyed``, without NVML); 0: unknown."""
    if not devices.names:
        return devices
    sizes = tuple(
        declared.get(name) or nvml.total(name) or devices.capacity(name) for name in devices.names
    )
    return replace(devices, capacities=sizes)


def _keyed(devices: Devices, nvml: NvmlReader) -> Devices:
    """``devices`` with each one's identity (``Devices.keys``: ``identity.identities``,
    from NVML or the CUDA driver), and ``nvml`` told to read an index CUDA numbers
    otherwise as the GPU CUDA will show (its memory, its processes); without NVML, the
    memory CUDA says each has. ``SpecError`` when two names are one GPU, or CUDA must
    say which GPU a name is and cannot."""
    if not devices.names:
        return devices
    found = identities(devices, nvml)
    keys = [identity.key for identity in found]
    for i, key in enumerate(keys):
        if keys.index(key) != i:
            first = devices.names[keys.index(key)]
            raise SpecError(
                f"invalid device list {devices.source}: {first} and {devices.names[i]} are "
                f"the same GPU ({key})"
            )
    for name, key in zip(devices.names, keys, strict=True):
        if key != name and nvml.available():  # NVML reads a UUID's prefix, or CUDA's
            nvml.alias(name, key)  # index, as that GPU
    totals = tuple(identity.total for identity in found)
    sizes = totals if any(totals) else devices.capacities
    return replace(devices, keys=tuple(keys), capacities=sizes)


def _checked(devices: Devices, value: str | None = None) -> Devices:
    from .._lease import MAX_DEVICES

    names = devices.names
    where = devices.source if value is None else f"{devices.source}={value}"
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise SpecError(f"invalid device list {where}: device {twice[0]} is listed twice")
    if len(names) > MAX_DEVICES:
        raise SpecError(
            f"{len(names)} devices from {devices.source}: the lease table holds at most "
            f"{MAX_DEVICES}"
        )
    long = [name for name in names if len(name.encode()) >= 64]
    if long:
        raise SpecError(f"invalid device name {long[0]!r} from {devices.source}: over 63 bytes")
    return devices
