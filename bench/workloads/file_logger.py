"""A job that holds M MiB of memory and keeps N files open, writing a line to each every 50 ms.

    python3 file_logger.py M N FILE_MIB DIR

Half the files are opened in append mode (a ``logging.FileHandler``), half with
``"w"`` (a metrics CSV), each first filled to FILE_MIB MiB, all in DIR.  With N
= 0 it is the same job with no files of its own: the baseline.  Memory as in
hold_memory.py.  Used by bench/file_freeze.py.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hold_memory import fill  # noqa: E402


def main() -> None:
    mib, nfiles, file_mib, directory = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    buf, filled, check = fill(mib)
    files = []
    chunk = b"x" * 1023 + b"\n"
    for i in range(nfiles):
        f = open(os.path.join(directory, f"log-{i}.{'log' if i % 2 else 'csv'}"), "a" if i % 2 else "w")
        for _ in range(file_mib * 1024):
            f.buffer.write(chunk)
        f.flush()
        files.append(f)
    print(f"ready {mib} MiB, {nfiles} files, fill {filled:.2f} s check {check & 0xffff}", flush=True)
    n = 0
    while True:
        n += 1
        for f in files:
            f.write(f"{n},{time.time():.3f}\n")
            f.flush()
        if n % 100 == 0:
            print(f"alive {n}", flush=True)
        time.sleep(0.05)


if __name__ == "__main__":
    main()
