"""A job run from a project directory, as users run them: it reads its dataset and keeps its own
state in a file it rewrites (opened, written, closed) each step, beside other jobs' in the same
directory, and checks at every step that both are as it left them.

Usage: projectjob.py NAME STEPS INTERVAL [DATASET].  Each step i: the state file ``state-NAME.json``
must hold step i-1 (a restore onto a later state shows at once); a 1 MiB chunk of DATASET (if
given) must begin with its own number (see :func:`chunk`); then the state is rewritten with i and
"step i" printed.  On finding anything not as it left it, prints "INCONSISTENT ..." and exits 3.
"""

import json
import os
import struct
import sys
import time

CHUNK = 1 << 20


def chunk(i: int, base: bytes) -> bytes:
    """The dataset's chunk ``i``: its number, then bytes of its own (real content, never sparse)."""
    return struct.pack("<Q", i) + base[8:]


def main() -> None:
    name, steps, interval = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    dataset = sys.argv[4] if len(sys.argv) > 4 else ""
    state = f"state-{name}.json"
    chunks = os.path.getsize(dataset) // CHUNK if dataset else 0
    data = open(dataset, "rb") if dataset else None
    for i in range(steps):
        if i:
            with open(state) as f:
                was = json.load(f)
            if was["step"] != i - 1:
                print(f"INCONSISTENT {state} holds step {was['step']} before step {i}", flush=True)
                sys.exit(3)
        if data is not None:
            n = (i * 7919) % chunks
            head = os.pread(data.fileno(), 8, n * CHUNK)
            if struct.unpack("<Q", head)[0] != n:
                print(f"INCONSISTENT {dataset} chunk {n} begins with {head!r}", flush=True)
                sys.exit(3)
        with open(state, "w") as f:
            json.dump({"step": i, "pad": "x" * 2000}, f)
        print(f"step {i}", flush=True)
        time.sleep(interval)


if __name__ == "__main__":
    main()
