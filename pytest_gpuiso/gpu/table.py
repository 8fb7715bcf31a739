"""The lease table's commands: ``python -m pytest_gpuiso status`` and ``reset`` (with
``--device``: re-probe a quarantined GPU and lift it). Each returns the exit status and
says a problem in one ``error: ...`` line on stderr (``__main__.EXIT_STATUS``)."""

from __future__ import annotations

import argparse
import os
import stat
import sys
from typing import TYPE_CHECKING

from .leases import CHOOSE_PATH, foreign_owner, open_region, region_path, status_table

if TYPE_CHECKING:
    from .nvml import NvmlReader


def nvml_indices() -> dict[str, str]:
    """Each GPU's UUID -> its NVML index, as the table keys GPUs and users number them."""
    from .nvml import NvmlReader

    nvml = NvmlReader()
    try:
        found = {str(i): nvml.identity(str(i)) for i in range(nvml.count())}
    finally:
        nvml.close()
    return {uuid: index for index, uuid in found.items() if uuid}


def _error(message: str, status: int = 2) -> int:
    print(f"error: {message}", file=sys.stderr)
    return status


def status(opts: argparse.Namespace) -> int:
    """``status``: the lease table's holders, waiters and quarantined GPUs."""
    from .._lease import RegionError

    path = opts.region or region_path()
    if not os.path.lexists(path):
        print(f"lease table {path}\nno lease table yet (created by the first GPU lease)")
        return 0
    try:
        snapshot = open_region(path).snapshot()
        print(status_table(snapshot, path, nvml_indices()))
    except RegionError as exc:
        return _error(str(exc))
    return 0


def reset(opts: argparse.Namespace) -> int:
    """``reset``: clear a table nobody holds (``--force``: whatever holds it), or re-probe
    and lift one quarantined GPU (``--device``)."""
    from .._lease import RegionError

    path = opts.region or region_path()
    if not os.path.lexists(path):
        print(f"nothing to reset: {path} does not exist")
        return 0
    owner = foreign_owner(path)
    if owner is not None:  # never deleted or changed here, even by root: not ours
        return _error(
            f"{path} belongs to {owner}, not to uid {os.geteuid()}: not reset; "
            f"{CHOOSE_PATH} (or --region PATH here)"
        )
    try:
        region = open_region(path)
    except RegionError as exc:
        if not opts.force or opts.device is not None:
            return _error(str(exc))
        return _delete(path, f"it is unusable ({exc})")
    if opts.device is not None:
        return _lift(region, path, opts.device, opts.force)
    try:  # what the clear lifts is named (a stuck lock under --force: deleted, unnamed)
        snapshot = region.snapshot(timeout=FORCE_LOCK_WAIT) if opts.force else region.snapshot()
        live = [h for h in snapshot["holders"] if h["alive"]]
    except RegionError as exc:
        if not opts.force:
            return _error(str(exc))
        return _delete(path, f"its lock was held for {FORCE_LOCK_WAIT:g} s ({exc})")
    if live and not opts.force:  # a refusal: 1, like a finding
        held = "; ".join(f"GPU {h['device']} by pid {h['pid']} ({h['label']})" for h in live)
        return _error(f"refusing to reset {path}: live holders: {held} (use --force)", 1)
    try:  # never waits on a lock a stopped or wedged process holds: deletes instead
        region.clear(timeout=FORCE_LOCK_WAIT) if opts.force else region.clear()
    except RegionError as exc:
        return _delete(path, f"its lock was held for {FORCE_LOCK_WAIT:g} s ({exc})")
    lifted = "; ".join(f"GPU {q['device']} ({q['why']})" for q in snapshot["quarantined"])
    print(f"cleared {path}" + (f"; quarantine lifted without a probe: {lifted}" if lifted else ""))
    return 0


FORCE_LOCK_WAIT = 3.0  # seconds reset --force waits for the table's lock before deleting it


def _lift(region: object, path: str, device: str, force: bool) -> int:
    """Probe a quarantined GPU again (NVML, then the CUDA driver in a fresh process) and lift
    its quarantine when it passes, or at once with ``force``. A quarantine the driver part
    decided is lifted by it alone where NVML cannot be loaded (``health.judged_by_driver``)."""
    from .._lease import RegionError
    from ..values import SpecError
    from . import health
    from .leases import visible_env
    from .nvml import NvmlReader

    try:
        quarantined = {q["device"]: q for q in region.snapshot()["quarantined"]}
    except RegionError as exc:
        return _error(str(exc))
    nvml = NvmlReader()
    try:  # the table keys a GPU by its UUID where it is known: "0" is NVML's GPU 0
        try:
            row = device if device in quarantined else _row(device, nvml)
        except SpecError as exc:
            return _error(str(exc))
        if row not in quarantined:
            which = ", ".join(sorted(quarantined)) or "none"
            print(f"GPU {device} is not quarantined in {path} (quarantined: {which})")
            return 0
        if not force:
            env = visible_env((row,))
            if row.isdigit() and "CUDA_DEVICE_ORDER" not in os.environ:
                env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # an index as NVML numbers them
            driver_cause = health.judged_by_driver(quarantined[row]["why"])
            problem, untold = health.examine(row, nvml, env, driver_cause=driver_cause)
            if problem or untold:  # a refusal: 1, like a finding
                why = f"still fails its probe: {problem}" if problem else ""
                why = why or f"could not be assessed ({untold})"
                return _error(f"GPU {device} {why}; left quarantined (--force lifts it anyway)", 1)
    finally:
        nvml.close()
    try:
        region.lift(row)
    except RegionError as exc:
        return _error(str(exc))
    how = "lifted without a probe (--force)" if force else "it passed its probe"
    named = device if row == device else f"{device} ({row})"
    print(f"GPU {named}: quarantine lifted ({how}; it was: {quarantined[row]['why']})")
    return 0


def _row(device: str, nvml: NvmlReader) -> str:
    """The table's row of ``device`` as ``reset --device`` names it (an index in NVML's
    numbering, the PCI bus order; a UUID or a prefix of one): its UUID from NVML, else from
    the CUDA driver (``identity.ask_cuda``), else the name itself."""
    from .identity import ask_cuda

    if nvml.available():
        return nvml.identity(device) or device
    found = ask_cuda([device], "reset --device", pci_order=True)
    return found[device][0] if device in found else device


def _is_lease_table(path: str) -> bool:
    """Whether ``path`` is a regular file that starts with the lease table's magic (read
    without following a link or blocking on a FIFO)."""
    from .._lease import MAGIC

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        head = os.pread(fd, 8, 0) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    except OSError:
        head = b""
    finally:
        os.close(fd)
    return len(head) == 8 and int.from_bytes(head, sys.byteorder) == MAGIC


def _delete(path: str, why: str) -> int:
    """Delete our own table file that cannot be cleared; the next GPU lease creates one.
    Only a lease table (its magic) is ever deleted: any other file is left alone."""
    if not _is_lease_table(path):
        return _error(f"{path} is not a pytest-gpuiso lease table: left alone")
    try:
        os.unlink(path)
    except OSError as exc:
        return _error(f"cannot delete the lease table {path}: {exc.strerror}")
    print(f"deleted the lease table {path}: {why}")
    return 0
