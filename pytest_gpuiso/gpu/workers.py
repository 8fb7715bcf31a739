"""pytest-xdist's workers sized by GPUs: ``-n auto`` starts one worker per GPU slot.

xdist sizes ``-n auto`` (and ``-n logical``) by CPUs, through its
``pytest_xdist_auto_num_workers`` hook, in ``pytest_cmdline_main``: before any
test is collected, so before markers are known. Where every test is isolated
(``--gpu-isolate``), or each worker pins its GPUs (``--gpu-isolate-pin-workers``),
and GPUs are found (``--gpu-isolate-devices``,
``CUDA_VISIBLE_DEVICES`` or NVML: no CUDA context), the right number is what the
lease table can run at once: GPUs x tests per GPU (``--gpu-isolate-slots``, or how
many ``--gpu-isolate-gpu-memory`` leases fit), divided by the GPUs each test
leases. It may exceed the CPUs: the workers mostly wait on their tests' processes.
``PYTEST_XDIST_AUTO_NUM_WORKERS`` (xdist's own override) still wins.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from ..settings import Settings, read_settings
from ..values import WHOLE, SpecError
from .devices import Devices, discover

XDIST_ENV = "PYTEST_XDIST_AUTO_NUM_WORKERS"


@dataclass(frozen=True)
class AutoWorkers:
    """``-n auto`` sized by GPUs: how many workers and why (the header says it)."""

    workers: int
    devices: Devices
    per_gpu: int
    gpus_each: int

    def describe(self) -> str:
        gpus = len(self.devices.names)
        why = f"{gpus} GPU{'s' if gpus != 1 else ''} x {self.per_gpu} test"
        why += f"{'s' if self.per_gpu != 1 else ''} each"
        if self.gpus_each > 1:
            why += f" / {self.gpus_each} GPUs a test"
        return (
            f"gpu-isolate: -n auto: {self.workers} worker{'s' if self.workers != 1 else ''}, "
            f"one per GPU slot ({why}; GPUs from {self.devices.source})"
        )


AUTO = pytest.StashKey[AutoWorkers]()


def auto_workers(config: pytest.Config, environ: dict[str, str]) -> int | None:
    """The worker count for ``-n auto``, or None to leave it to xdist (CPUs)."""
    if environ.get(XDIST_ENV):
        return None
    settings = read_settings(config)  # a bad value: pytest's usage error
    if (settings.mode != "all" and not settings.pin_workers) or settings.gpus == 0:
        return None
    try:
        devices = discover(settings.devices, settings.devices_source, dict(settings.device_sizes))
    except SpecError as exc:
        raise pytest.UsageError(f"gpu-isolate: {exc}") from None
    if not devices.names:
        return None
    workers = gpu_slots(settings, devices)
    config.stash[AUTO] = AutoWorkers(
        workers, devices, tests_per_gpu(settings, devices), settings.gpus or 1
    )
    return workers


def gpu_slots(settings: Settings, devices: Devices) -> int:
    """How many tests (or pinned workers) of ``--gpu-isolate-gpus`` GPUs each the devices
    hold at once: GPUs x tests per GPU / GPUs a test (at least 1)."""
    return max(1, len(devices.names) * tests_per_gpu(settings, devices) // (settings.gpus or 1))


def tests_per_gpu(settings: Settings, devices: Devices) -> int:
    """How many default leases fit on the smallest GPU: --gpu-isolate-gpu-memory's, else
    1/slots of it."""
    memory = settings.gpu_memory
    if memory is None:
        return settings.slots
    if memory.share:
        return max(1, WHOLE // memory.share)
    sizes = devices.sizes()
    if not all(sizes):
        return settings.slots  # a GPU of unknown size: as without a memory lease
    return max(1, min(sizes) // memory.size)
