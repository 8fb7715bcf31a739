"""One process's GPUs together: what a test leases by default, the environment its
process sees them by (a distributed test's rank: only its share of the group's lease),
and pins given back, where there is no lease table (no GPUs)."""

from __future__ import annotations

import pytest

from pytest_gpuiso.gpu.devices import Devices
from pytest_gpuiso.gpu.leases import Lease, Leases
from pytest_gpuiso.gpu.pool import GpuPool
from pytest_gpuiso.wire.environment import LEASE_ID_ENV, LEASED_ENV, MEMORY_ENV


@pytest.mark.parametrize(
    ("names", "gpus", "default"),
    [((), None, 0), (("0", "1"), None, 1), (("0",), 2, 2), ((), 0, 0), ((), 3, 3)],
)
def test_a_test_leases_the_option_s_count_else_one_gpu_where_there_are_gpus(names, gpus, default):
    pool = GpuPool(devices=Devices(names, "test"))
    assert pool.default_gpus(gpus) == default


def test_without_a_lease_table_a_test_s_process_inherits_its_environment_untouched():
    pool = GpuPool()
    assert pool.leases is None
    assert pool.env(None) == {}


def test_pins_given_back_without_a_table_leave_none_held():
    pool = GpuPool()
    pool.release_pins()
    assert (pool.pins, pool.pin) == ([], None)


def test_a_ranks_process_sees_only_its_share_of_the_groups_lease(lease_region, monkeypatch):
    """A distributed test's group holds one lease; each rank's go shows only its own GPUs
    (by CUDA_VISIBLE_DEVICES and what a nested lease would reuse), with the group's lease
    id and memory; without a memory lease the variable is set empty, never inherited."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv(MEMORY_ENV, "123")  # pytest's own: never a test's
    pool = GpuPool(devices=Devices(("0", "1", "2", "3"), "test"))
    pool.leases = Leases(pool.devices, 1, path=str(lease_region))
    group = Lease(7, ("1", "3"), 0.0, 2**30)
    rank1 = pool.go_env(group, ("3",))
    assert (rank1["CUDA_VISIBLE_DEVICES"], rank1[LEASED_ENV]) == ("3", "3")
    assert (rank1[LEASE_ID_ENV], rank1[MEMORY_ENV]) == ("7", str(2**30))
    whole = pool.go_env(Lease(8, ("0", "2"), 0.0))
    assert (whole["CUDA_VISIBLE_DEVICES"], whole[MEMORY_ENV]) == ("0,2", "")
    assert GpuPool().go_env(None) == {MEMORY_ENV: ""}  # no table: only that
