"""``python -m pytest_gpuiso status | reset [--force]``: inspect or clear the GPU lease table."""

from __future__ import annotations

import argparse
import os
import sys

from .leases import open_region, region_path, status_table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pytest_gpuiso", description=__doc__)
    parser.add_argument("--region", help="lease table file (default: %(default)s)", default=None)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("status", help="print the lease table: device, slot, holder pid, test, since")
    reset = sub.add_parser("reset", help="clear a lease table that nobody holds")
    reset.add_argument(
        "--force",
        action="store_true",
        help="clear it even while live holders exist, or delete a corrupted table",
    )
    opts = parser.parse_args(argv)
    path = opts.region or region_path()

    from ._lease import RegionError

    if opts.command == "status":
        if not os.path.exists(path):
            print(f"lease table {path}\nno lease table yet (created by the first GPU lease)")
            return 0
        try:
            print(status_table(open_region(path).snapshot(), path))
        except RegionError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        return 0

    if not os.path.exists(path):
        print(f"nothing to reset: {path} does not exist")
        return 0
    try:
        region = open_region(path)
    except RegionError as exc:
        if not opts.force:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        os.unlink(path)
        print(f"deleted the unreadable lease table {path}")
        return 0
    live = [h for h in region.snapshot()["holders"] if h["alive"]]
    if live and not opts.force:
        held = "; ".join(f"GPU {h['device']} by pid {h['pid']} ({h['label']})" for h in live)
        print(
            f"error: refusing to reset {path}: live holders: {held} (use --force)", file=sys.stderr
        )
        return 1
    region.clear()
    print(f"cleared {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
