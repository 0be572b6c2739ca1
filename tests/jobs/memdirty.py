"""A job whose memory is a deterministic function of its step: for incremental checkpoints.

Usage: memdirty.py SIZE_MIB DIRTY_FRACTION [STEPS [INTERVAL_S [CHECK_EVERY]]]

It holds SIZE_MIB of 4 KiB pages.  Each page starts with its index and the step that last
wrote it, then 4080 bytes of a fill derived from both.  Step s rewrites the
ceil(pages * DIRTY_FRACTION) pages from (s * k) mod pages on (wrapping), so each step dirties
a known fraction of the memory.  Before each step it checks every page against the schedule:
a page from the wrong epoch, a torn page or a corrupt one prints a BAD line and exits 3.
Output, one line per step: "step N ok".  STEPS 0 (the default): forever.  CHECK_EVERY (1): check
only every so many steps (a check of 1 GiB takes about a second).
"""

from __future__ import annotations

import math
import struct
import sys
import time

PAGE = 4096
HEAD = struct.Struct("<QQ")  # page index, step that last wrote it
FILLS = [bytes([b]) * (PAGE - HEAD.size) for b in range(256)]


def fill_of(i: int, step: int) -> int:
    return (i * 31 + step * 7 + 1) & 0xFF


def last_writer(i: int, step: int, k: int, pages: int) -> int:
    """The latest step <= ``step`` that wrote page ``i`` (0: the initial fill).  Step s writes
    the positions s*k .. s*k+k-1, each taken modulo ``pages``."""
    if step == 0:
        return 0
    top = (step + 1) * k - 1
    p = top - ((top - i) % pages)
    return p // k if p >= k else 0


def write(buf: bytearray, i: int, step: int) -> None:
    off = i * PAGE
    HEAD.pack_into(buf, off, i, step)
    buf[off + HEAD.size:off + PAGE] = FILLS[fill_of(i, step)]


def check(buf: bytearray, step: int, k: int, pages: int) -> str:
    view = memoryview(buf)
    for i in range(pages):
        off = i * PAGE
        idx, wrote = HEAD.unpack_from(buf, off)
        want = last_writer(i, step, k, pages)
        if idx != i or wrote != want:
            return f"page {i}: header ({idx}, {wrote}), expected ({i}, {want})"
        if view[off + HEAD.size:off + PAGE] != FILLS[fill_of(i, wrote)]:
            return f"page {i}: content does not match step {wrote}"
    return ""


def main() -> int:
    size_mib = int(sys.argv[1])
    fraction = float(sys.argv[2])
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    interval = float(sys.argv[4]) if len(sys.argv) > 4 else 0.2
    every = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    pages = size_mib * 1024 * 1024 // PAGE
    k = max(1, min(pages, math.ceil(pages * fraction)))
    buf = bytearray(pages * PAGE)
    for i in range(pages):
        write(buf, i, 0)
    step = 0
    while steps == 0 or step < steps:
        bad = check(buf, step, k, pages) if step % every == 0 else ""
        if bad:
            print(f"BAD at step {step}: {bad}", flush=True)
            return 3
        step += 1
        start = (step * k) % pages
        for j in range(k):
            write(buf, (start + j) % pages, step)
        print(f"step {step} ok", flush=True)
        time.sleep(interval)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
