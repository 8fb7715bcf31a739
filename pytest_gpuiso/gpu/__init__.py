"""The GPUs, as pytest's process sees them: through NVML (or ROCm's SMI), never CUDA.

Runs in pytest's process (``gpu_probe`` also as its own, short-lived process). Owns the
lease table (``leases``: who holds which GPU, memory and port, shared by every session of
the user), GPU health and quarantine (``health``, ``gpu_probe``, ``xids``: NVIDIA's Xid
catalog), NVML (``nvml``) and ROCm (``rocm``), pinned xdist workers (``pinning``,
``workers``) and ``MASTER_PORT`` leases (``ports``). Never imports ``parent`` or ``child``.

Also here: ``devices`` (the GPUs a session may lease and their memory, found without a
CUDA context), ``pool`` (one pytest process's GPUs together: its devices, lease table,
NVML reader and pins) and ``identity`` (which GPU each device name is: its UUID, its lease-table
row).
"""
