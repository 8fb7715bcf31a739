"""One process's GPUs together: what a test leases by default, the environment its
process sees them by, and pins given back, where there is no lease table (no GPUs)."""

from __future__ import annotations

import pytest

from pytest_gpuiso.gpu.devices import Devices
from pytest_gpuiso.gpu.pool import GpuPool


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
