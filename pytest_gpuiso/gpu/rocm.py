"""AMD GPUs (ROCm): where they come from, what a test's process sees, their memory.

Devices are found, after ``--gpu-isolate-devices`` and ``CUDA_VISIBLE_DEVICES``,
from ``HIP_VISIBLE_DEVICES`` (the HIP runtime's numbering, under whatever
``ROCR_VISIBLE_DEVICES`` the user set, which is then left as it is), from
``ROCR_VISIBLE_DEVICES`` (the ROCr runtime's: indices or UUIDs), and, where NVML
finds no GPU, from amdsmi when it is installed. A test's process then sees its
lease the way PyTorch's ROCm build reads it: ``HIP_VISIBLE_DEVICES`` and the same
in ``CUDA_VISIBLE_DEVICES`` (HIP honours both); leased by ROCr name, the names go
in ``ROCR_VISIBLE_DEVICES`` and HIP's numbers, ``0..n-1``, in the other two.

Memory comes from amdsmi, matched by index to its GPUs (a UUID, or a HIP index under
a ``ROCR_VISIBLE_DEVICES`` of the user's, cannot be matched: declare it,
``--gpu-isolate-devices=0:192GiB``). Not validated on AMD hardware: the plumbing is
tested with the environment and a stand-in amdsmi.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from typing import Any

CUDA, HIP, ROCR = "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"


def from_environment(environ: Mapping[str, str] = os.environ) -> tuple[str, str] | None:
    """(the variable, its value) that names the AMD GPUs to lease, if one is set."""
    for name in (HIP, ROCR):
        if environ.get(name) is not None:
            return name, environ[name]
    return None


def visible(devices: tuple[str, ...] | list[str], via: str) -> dict[str, str]:
    """The variables that make a process see exactly ``devices``, named through ``via``."""
    names = ",".join(devices)
    if via == CUDA:
        return {CUDA: names}
    if via == HIP:
        return {HIP: names, CUDA: names}
    numbers = ",".join(str(i) for i in range(len(devices)))
    hidden = {HIP: numbers, CUDA: numbers}
    return {ROCR: names, **hidden} if devices else hidden  # ROCR="" may mean "all"


class AmdSmi:
    """GPUs and their memory through amdsmi, when it is installed and finds a driver."""

    def __init__(self) -> None:
        self.handles: list[Any] = []
        self._smi: Any = None
        try:
            import amdsmi

            amdsmi.amdsmi_init()
            self._smi = amdsmi
            self.handles = list(amdsmi.amdsmi_get_processor_handles())
        except Exception:  # ImportError, no driver: no AMD GPUs
            self.close()

    def names(self) -> list[str]:
        return [str(i) for i in range(len(self.handles))]

    def total(self, name: str) -> int:
        """Bytes of VRAM of the GPU with that index; 0 when it cannot be told."""
        if not name.isdigit() or int(name) >= len(self.handles):
            return 0
        smi = self._smi
        try:
            vram = smi.AmdSmiMemoryType.VRAM
            return int(smi.amdsmi_get_gpu_memory_total(self.handles[int(name)], vram))
        except Exception:
            return 0

    def close(self) -> None:
        if self._smi is not None:
            with contextlib.suppress(Exception):
                self._smi.amdsmi_shut_down()
        self._smi, self.handles = None, []
