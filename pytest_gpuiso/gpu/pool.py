"""The GPUs one pytest process isolates tests with: found once, given back at its end.

``GpuPool`` holds what the process may lease (``devices``), the lease table it leases
from (``leases``: shared by every session of the user; none where there are no GPUs),
its NVML reader, and pinned xdist workers' GPUs (``pins``: the leases this process
took; ``pin``: the one its own tests run under). It is found by ``parent.worker.prepare``
before the first isolated test (at configure where workers are pinned) and is part of
the session's ``Worker``; xdist's controller, which runs no test, has one for its pins.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..wire.environment import MEMORY_ENV
from .devices import Devices
from .nvml import NvmlReader

if TYPE_CHECKING:
    from .leases import Lease, Leases


@dataclass
class GpuPool:
    """The GPUs of one pytest process (empty until ``parent.worker.prepare`` found them)."""

    devices: Devices = Devices((), "none")
    leases: Leases | None = None  # None: no GPUs, nothing to lease
    nvml: NvmlReader = field(default_factory=NvmlReader)
    pin: Lease | None = None  # the GPUs this process has for life (--gpu-isolate-pin-workers)
    pins: list[Lease] = field(default_factory=list)  # pinning leases this process took

    def default_gpus(self, gpus: int | None) -> int:
        """What a test leases when its marker does not say: ``gpus`` (--gpu-isolate-gpus)
        when given, else 1 where there are GPUs to lease and 0 where none."""
        if gpus is not None:
            return gpus
        return 1 if self.devices.names else 0

    def env(self, lease: Lease | None) -> dict[str, str]:
        """The environment a test's process sees its GPUs by: ``lease``'s, every GPU
        hidden where ``lease`` is None; nothing where there is no lease table."""
        return self.leases.child_env(lease) if self.leases is not None else {}

    def go_env(self, lease: Lease | None, share: tuple[str, ...] | None = None) -> dict[str, str]:
        """What a test's process is given of its GPUs with its go: ``env(lease)``, where
        ``share`` (a distributed test's rank's GPUs, of the group's ``lease``) shows only
        those, and ``MEMORY_ENV`` always ("" without a lease of memory: never one
        inherited from pytest's own environment)."""
        env = self.env(lease)
        if share is not None and self.leases is not None:
            env.update(self.leases.visible(share))
        env.setdefault(MEMORY_ENV, "")
        return env

    def release_pins(self) -> None:
        """Give back the pinning leases this process took (at the session's end)."""
        if self.leases is not None:
            for lease in self.pins:
                self.leases.release(lease)
        self.pins, self.pin = [], None
