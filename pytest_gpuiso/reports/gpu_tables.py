"""The Markdown sections about GPUs: which were quarantined after which test (GPU health),
and which tests' memory leases are far from their peak (right-size your leases)."""

from __future__ import annotations

from ..values import size_text
from .mdtext import cell as _cell
from .mdtext import code_cell as _code_cell
from .record import Record, is_number

MARKDOWN_ROWS = 200  # rows of a table; the rest are counted


def quarantines(records: list[Record]) -> list[tuple[str, str, str, str]]:
    """(test, GPU, what failed, why it was probed) for each GPU a test's run left unfit
    and that was quarantined after it (``health``)."""
    found = []
    for r in records:
        checked = r.get("gpu_health")
        if isinstance(checked, dict) and isinstance(checked.get("quarantined"), dict):
            for device, problem in sorted(checked["quarantined"].items()):
                found.append((r["nodeid"], str(device), str(problem), str(checked.get("probed"))))
    return found


def unassessed(records: list[Record]) -> list[tuple[str, str, str]]:
    """(test, GPU, why) for each GPU probed after a test that could not be assessed (no
    NVML, no CUDA driver): neither healthy nor quarantined."""
    found = []
    for r in records:
        checked = r.get("gpu_health")
        if isinstance(checked, dict) and isinstance(checked.get("unassessed"), dict):
            for device, why in sorted(checked["unassessed"].items()):
                found.append((r["nodeid"], str(device), str(why)))
    return found


def health(records: list[Record]) -> list[str]:
    """The "GPU health" part: each GPU quarantined after a test, what failed, why and
    what to do (NVIDIA's Xid catalog's action is in what failed); each that could not be
    assessed, and why."""
    found, untold = quarantines(records), unassessed(records)
    if not found and not untold:
        return []
    lines = ["", "### GPU health", ""]
    if found:
        lines += ["Quarantined for every session of the user until `python -m pytest_gpuiso"]
        lines += ["reset --device N` re-probes and lifts it.", ""]
        lines += ["| GPU | after test | probed because | what failed |", "|---|---|---|---|"]
    for nodeid, device, problem, why in found[:MARKDOWN_ROWS]:
        lines.append(
            f"| {_cell(device)} | {_code_cell(nodeid)} | {_cell(why)} | {_cell(problem)} |"
        )
    if untold:
        lines += ["", "Could not be assessed (neither healthy nor quarantined):", ""]
        lines += ["| GPU | after test | why |", "|---|---|---|"]
    for nodeid, device, why in untold[:MARKDOWN_ROWS]:
        lines.append(f"| {_cell(device)} | {_code_cell(nodeid)} | {_cell(why)} |")
    return lines


LEASE_LOW = 0.25  # a peak below this share of the lease: the lease could shrink


def right_size(records: list[Record], where: str) -> list[str]:
    """The "right-size your leases" table: tests whose GPU memory peak (NVML) was far below
    their lease (others could have run beside them) or above it (not enforced: CUDA
    used outside torch's allocator), with a gpu_memory= that fits the peak."""
    peaks: dict[str, tuple[int, int]] = {}
    for r in records:
        lease, peak = r.get("gpu_memory"), r.get("gpu_memory_peak")
        if is_number(lease) and is_number(peak) and lease > 0:
            peaks[r["nodeid"]] = (lease, max(peak, peaks.get(r["nodeid"], (0, 0))[1]))
    rows = [
        (n, lease, peak) for n, (lease, peak) in peaks.items() if not LEASE_LOW <= peak / lease <= 1
    ]
    if not rows:
        return []
    lines = ["", "### Right-size your leases", ""]
    lines += ["GPU memory peak (NVML, sampled) far below or above the test's lease.", ""]
    lines += ["| test | lease | peak | try |", "|---|---|---|---|"]
    for nodeid, lease, peak in sorted(rows, key=lambda row: row[2] - row[1])[:MARKDOWN_ROWS]:
        fit = -(-int(peak * 1.25) // (1 << 28)) / 4  # 25% headroom, in quarters of a GiB
        try_ = f'`gpu_memory="{max(fit, 0.25):g}GiB"`'
        cells = f"{size_text(lease, '.2f')} | {size_text(peak, '.2f')}"
        lines.append(f"| {_code_cell(nodeid)} | {cells} | {try_} |")
    if len(rows) > MARKDOWN_ROWS:
        lines += ["", f"{len(rows) - MARKDOWN_ROWS} more in {where}."]
    return lines
