"""Every ``PYTEST_GPUISO_*`` environment variable that crosses from one process to another.

Each name is written here once; the modules that set or read it import it from here.
"""

from __future__ import annotations

# Set by pytest's process (``parent.runner``) in a test's process: the GPUs its test
# holds, the lease they are held under, and the variable they are named in when it is
# not CUDA_VISIBLE_DEVICES (ROCm's). Read by the test's plugin (``child.relay``) and by
# a nested session's ``gpu.leases``, which then leases nothing of its own.
LEASED_ENV = "PYTEST_GPUISO_LEASED"
LEASE_ID_ENV = "PYTEST_GPUISO_LEASE_ID"
VIA_ENV = "PYTEST_GPUISO_LEASED_VIA"

# Set by pytest's process in a test's process: the bytes of its GPU memory lease on each
# GPU. Read by ``child.memory_cap`` (torch's allocator) and by a nested ``gpu.leases``.
MEMORY_ENV = "PYTEST_GPUISO_GPU_MEMORY"

# Set by the user or a test suite: another path for the lease table (tests, or a table
# shared across users). Read by ``gpu.leases`` (and named in the native table's errors).
REGION_ENV = "PYTEST_GPUISO_LEASE_REGION"

# Set by ``parent.launcher`` in every process it starts (and so in all they start): the
# session that owns them. Read by ``proc.dead_sessions`` in the next session, which ends
# what a dead session left running.
OWNER_ENV = "PYTEST_GPUISO_OWNER"

# Set by pytest's process (``parent.runner``) in each rank's process of a distributed
# test (``ranks=``): a file of the test's own, not yet made, for torch.distributed's
# ``init_method="file://..."`` (beside RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT).
# Read by the test.
RENDEZVOUS_ENV = "PYTEST_GPUISO_RENDEZVOUS"

# Set by ``parent.call`` in a ``run_isolated`` call's process: the call's mark. Read by
# ``leaks.process``, whose sweep then takes only that call's processes.
MARK_ENV = "PYTEST_GPUISO_CALL"

# Set by pytest's process and the fork server's template in a test's process: the file
# the /dev/shm shim (native/gpuiso_shmtrace.c, LD_PRELOAD) logs created entries to. Read
# by the shim; ``leaks.shm_log`` reads the file.
LOG_ENV = "PYTEST_GPUISO_SHM_LOG"

# Set by pytest's process (``leaks.shm``'s probe) in a test's process at its go: the log
# (LOG_ENV's) that its /dev/shm check reads after the test. Read by ``child.tracker``,
# which then hands the check the segments the test left to multiprocessing's resource
# tracker (without it, they stay the tracker's).
CHECKED_ENV = "PYTEST_GPUISO_SHM_CHECKED"

# Set by a test suite (not "" or "0"): the fork server forks each test's process twice
# instead of as its template's sibling. Read by ``forkserver.fork``.
FORK_TWICE_ENV = "PYTEST_GPUISO_FORK_TWICE"

# Set by a test suite: how long pytest waits for the fork server's template (seconds).
# Read by ``settings.read_settings`` (``values.parse_template_wait``).
TEMPLATE_WAIT_ENV = "PYTEST_GPUISO_TEMPLATE_WAIT"

# What each test's process is given anew with its go (its GPUs, its port, its lease, its
# rank): a module that reads one at import, imported where tests' processes are forked
# from, would hold that process's value in every test (``per_test``).
PER_TEST = frozenset(
    {
        "CUDA_VISIBLE_DEVICES",
        "HIP_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
        "MASTER_ADDR",
        "MASTER_PORT",
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
    }
)


def per_test(name: str) -> bool:
    """Whether ``name`` is a variable each test's process is given anew (``PER_TEST``, or
    one of ours)."""
    return name in PER_TEST or name.startswith("PYTEST_GPUISO_")
