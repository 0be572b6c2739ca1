"""A job that holds M MiB of resident, non-zero, page-distinct memory and then idles.

    python3 hold_memory.py M

Fills an anonymous mapping of M MiB with pseudo-random bytes (a 16 MiB random
block copied at a rotating offset) and stamps every 4 KiB page with its index,
so every page is resident, non-zero and unlike every other.  A second pass
reads a byte of every page back (the first touch of fresh memory is slow on
some VMs; the dump should find it all warm).  Then it prints ``ready`` and
sleeps, printing a line every few seconds, until it is killed.

Used by bench/checkpoint.py for both raw criu and revenant, so both dump the
same thing.
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
import time

MiB = 1 << 20
PAGE = mmap.PAGESIZE


def fill(mib: int) -> tuple[mmap.mmap, float, int]:
    """M MiB resident, non-zero, page-distinct: (the mapping, seconds it took, a check value)."""
    t0 = time.monotonic()
    size = mib * MiB
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    block = os.urandom(16 * MiB)
    view = memoryview(buf)
    step = 1 * MiB
    for i, off in enumerate(range(0, size, step)):
        start = (i * 4099) % (len(block) - step)  # rotating, page-unaligned offset
        view[off:off + step] = block[start:start + step]
    stamp = struct.Struct("<QQ")
    for n, off in enumerate(range(0, size, PAGE)):
        stamp.pack_into(buf, off, n + 1, 0x5245564E414E54 ^ n)
    filled = time.monotonic() - t0
    # Read one byte of each page back: everything must be resident now.
    total = 0
    for off in range(0, size, PAGE):
        total += buf[off + 16]
    return buf, filled, total


def main() -> None:
    mib = int(sys.argv[1])
    interval = float(sys.argv[2]) if len(sys.argv) > 2 else 5.0
    buf, filled, total = fill(mib)
    print(f"ready {mib} MiB pid {os.getpid()} fill {filled:.2f} s check {total & 0xffff}", flush=True)
    n = 0
    while True:
        time.sleep(interval)
        n += 1
        print(f"alive {n} {time.time():.3f}", flush=True)


if __name__ == "__main__":
    main()
