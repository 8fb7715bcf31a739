"""One test's plan, resolved once: its spec, its GPUs, its job, its start environment.

The plan is made the first time it is needed (prewarming the test, or its run) and
kept on the item until its run takes it (``PLAN``): the marker is parsed, the
temporary directory made and the job built once per test, whoever asks first.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from .. import _compat
from ..gpu.devices import Devices
from ..settings import IsolationSpec, Settings, spec_for_item
from ..values import SpecError
from ..wire.jobs import ItemJob
from . import replay
from .prewarm import HIDDEN_GPUS

if TYPE_CHECKING:
    from .worker import Worker


@dataclass(frozen=True)
class Plan:
    """One test's isolation, resolved once (kept on the item until its run takes it):
    its spec, the GPUs it leases, and the job its process runs; or why it runs none."""

    spec: IsolationSpec | None
    error: str | None = None  # a bad marker: the test's setup error
    gpus: int = 0
    # others may use its GPUs beside it (slots, memory leases): what is seen on them
    # then cannot be pinned on it
    shared: bool = False
    # a distributed test's ranks share its ``gpus`` GPUs, each with its gpu_memory slice
    # of them (too few GPUs here for each rank's own): ``spec.gpu_memory`` x ranks leased
    packed: bool = False
    missing: str | None = None  # what it needs that there is not: it is skipped
    job: ItemJob | None = None
    warm_env: dict[str, str] = field(default_factory=dict)  # its process's, ahead of its turn

    @property
    def runs(self) -> bool:
        """It runs in a process of its own."""
        return self.job is not None


PLAN = pytest.StashKey[Plan]()


def plan_for(item: pytest.Item, worker: Worker) -> Plan:
    """The test's plan, made once: by its prewarming, or by its run."""
    plan = item.stash.get(PLAN, None)
    if plan is None:
        plan = item.stash[PLAN] = _plan(item, worker)
    return plan


def _plan(item: pytest.Item, worker: Worker) -> Plan:
    settings, gpus = worker.settings, worker.gpus
    try:
        spec = spec_for_item(item, settings)
    except SpecError as exc:
        return Plan(None, error=str(exc))
    n = spec.gpus if spec.gpus is not None else gpus.default_gpus(settings.gpus)
    missing = gpus.devices.shortfall(n * spec.ranks, spec.gpu_memory)  # each rank's n
    packed = missing is not None and _packs(gpus.devices, n, spec)
    if missing is not None and not packed:
        if spec.ranks > 1 and spec.gpu_memory is not None and n > 0:
            missing += (
                f"; its {spec.ranks} ranks' gpu_memory={spec.gpu_memory.text} together fit "
                f"no GPU either"
            )
        return Plan(spec, gpus=n, missing=missing)
    env = gpus.env(None) if n == 0 or gpus.leases is None else dict(HIDDEN_GPUS)
    job = item_job(item, settings, worker.options)
    shared = settings.slots > 1 or spec.gpu_memory is not None
    return Plan(spec, gpus=n, shared=shared, packed=packed, job=job, warm_env=env)


def _packs(devices: Devices, n: int, spec: IsolationSpec) -> bool:
    """Whether a distributed test whose ranks cannot have ``n`` GPUs each here can share
    ``n`` by memory slices: its ``gpu_memory`` times its ranks fits them (NCCL needs a GPU
    a rank: its tests lease whole GPUs, which are never shared)."""
    memory = spec.gpu_memory
    together = memory.times(spec.ranks) if memory is not None and spec.ranks > 1 else None
    return together is not None and devices.shortfall(n, together) is None


def item_job(
    item: pytest.Item, settings: Settings, options: tuple[tuple[str, Any], ...]
) -> ItemJob:
    config = item.config
    parent = _compat.basetemp(config) or Path(tempfile.gettempdir())
    xml = replay.junit_xml(config)
    return ItemJob(
        nodeid=item.nodeid,
        collect_arg=collect_arg(item),
        args=tuple(config.invocation_params.args),
        invocation_dir=str(config.invocation_params.dir),
        basetemp=tempfile.mkdtemp(prefix="isolated-", dir=parent),
        junit_family=getattr(xml, "family", None),
        torch_check=settings.torch_check,
        options=options,
        location=item.location,
        initial_paths=_compat.initial_paths(item.session),
    )


def collect_arg(item: pytest.Item) -> str:
    """Narrow the child's collection to the test function when its name allows it.

    Parameter ids may hold ``::``, ``[`` or spaces, so the ``[...]`` part is never
    passed; the child picks the exact node id among what it collected.
    """
    path = str(item.path)
    _, sep, rest = item.nodeid.partition("::")
    names = rest.split("[", 1)[0]
    if sep and names and all(part.isidentifier() for part in names.split("::")):
        return f"{path}::{names}"
    return path
