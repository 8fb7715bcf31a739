"""What the kernel charges a forked test's process, measured side by side in one run.

A forked process pays for every page it writes that it shares with its parent
(copy-on-write: Python's reference counts make most reads writes), for every new page
(zero-fill), and for the fork and exit of its parent's page tables. On bare metal a
fault is well under a microsecond; under nested paging (some CI VMs) it can be several,
and then it, not anything of ours, dominates a forked test's cost (docs/performance.md,
"Why a fork costs this much"). Prints, for this machine:

* µs a page: a copy-on-write write in a fork, a zero-fill write, the same prefaulted by
  ``MADV_POPULATE_WRITE`` (Linux 5.14+; the page's cost without the trap), and a write
  to a page already private (the loop's own cost);
* ms for ``fork()`` + ``_exit`` + ``waitpid`` of this process (``--import torch`` first
  makes it the size of a template that imported torch), with its anonymous memory;
* the ratio of a copy-on-write fault to a rewrite, and the fork's cost a MiB.

Options: --pages N (default 3000), --repeat R (best of R, default 5), --import MODULE.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import mmap
import os
import sys
import time

PAGE = mmap.PAGESIZE
MADV_POPULATE_WRITE = 23


def _touch(buf: mmap.mmap, pages: int, value: int) -> int:
    start = time.perf_counter_ns()
    for i in range(pages):
        buf[i * PAGE] = value
    return time.perf_counter_ns() - start


def _in_fork(work) -> int:
    """Run ``work()`` (returns ns) in a forked child; its result."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(write, str(work()).encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        return int(os.read(read, 64) or b"-1")
    finally:
        os.close(read)
        os.waitpid(pid, 0)


def _populate(buf: mmap.mmap, pages: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    start = time.perf_counter_ns()
    done = libc.madvise(
        ctypes.c_void_p(address), ctypes.c_size_t(pages * PAGE), MADV_POPULATE_WRITE
    )
    spent = time.perf_counter_ns() - start
    return spent if done == 0 else -1


def _fork_exit() -> int:
    start = time.perf_counter_ns()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return time.perf_counter_ns() - start


def _anonymous_mib() -> float:
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Anonymous:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=3000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--import", dest="module", metavar="MODULE", help="import it first")
    opts = parser.parse_args()
    if opts.pages < 1 or opts.repeat < 1:
        sys.exit("page_faults.py: --pages and --repeat must be at least 1")
    if not hasattr(os, "fork"):
        sys.exit("page_faults.py: needs fork() (Linux)")
    if opts.module:
        try:
            importlib.import_module(opts.module)
        except ImportError as exc:
            sys.exit(f"page_faults.py: cannot import {opts.module}: {exc}")
    n = opts.pages
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    shared = mmap.mmap(-1, n * PAGE, flags=flags)
    _touch(shared, n, 1)  # present here: a fork's writes are copy-on-write faults

    def best(work) -> float:
        return min(work() for _ in range(opts.repeat)) / n / 1000  # µs a page

    def fresh(populate: bool) -> int:
        buf = mmap.mmap(-1, n * PAGE, flags=flags)
        try:
            spent = _populate(buf, n) if populate else _touch(buf, n, 1)
            return spent if spent >= 0 else 10**12
        finally:
            buf.close()

    cow = best(lambda: _in_fork(lambda: _touch(shared, n, 2)))
    zero = best(lambda: fresh(False))
    populate = best(lambda: fresh(True))
    rewrite = best(lambda: _touch(shared, n, 3))
    forks = sorted(_fork_exit() for _ in range(max(5, opts.repeat * 4)))
    fork_ms = forks[len(forks) // 2] / 1e6
    anon = _anonymous_mib()
    print(f"machine: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, {os.uname().release}")
    print(
        f"{n} pages of {PAGE} bytes, best of {opts.repeat}"
        + (f"; imported {opts.module}" if opts.module else "")
    )
    print(f"  copy-on-write write in a fork   {cow:7.2f} us a page")
    print(f"  zero-fill write                 {zero:7.2f} us a page")
    if populate < 1e5:
        print(f"  MADV_POPULATE_WRITE (no trap)   {populate:7.2f} us a page")
    else:
        print("  MADV_POPULATE_WRITE (no trap)   not supported here")
    print(f"  write to a private page         {rewrite:7.2f} us a page")
    print(f"  fork + _exit + waitpid          {fork_ms:7.2f} ms (median; {anon:.0f} MiB anonymous)")
    print(
        f"ratios: copy-on-write / rewrite {cow / max(rewrite, 1e-9):.1f}x; "
        f"fork {fork_ms / max(anon, 1e-9) * 1000:.0f} us a MiB of anonymous memory"
    )


if __name__ == "__main__":
    main()
