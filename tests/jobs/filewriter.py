"""A job that writes its own files in its working directory, the ways real jobs do, and checks
at every step that they are where it left them (so a restore onto the wrong file state shows):

* ``metrics.csv``, opened "w": row i each step;
* ``train.log``, a logging.FileHandler (append mode): "step i" each step;
* ``state.bin``, opened "r+": the last step number at offset 0, rewritten in place;
* ``steps.db``, SQLite: one row per step, committed;
* ``ckpt.json``, its own checkpoint every CKPT steps: written to a temporary file, then renamed;
* optionally ``big.bin`` (BIG_MIB, opened "r+"): its first 8 bytes rewritten each step.

Usage: filewriter.py STEPS INTERVAL [CKPT] [BIG_MIB] [BIG_FROM] (big.bin is opened at step BIG_FROM).  Prints "step i" to stdout each step; on
finding a file not as it left it, prints "INCONSISTENT ..." and exits 3.
"""

import json
import logging
import os
import sqlite3
import sys
import time

steps = int(sys.argv[1])
interval = float(sys.argv[2])
ckpt_every = int(sys.argv[3]) if len(sys.argv) > 3 else 5
big_mib = int(sys.argv[4]) if len(sys.argv) > 4 else 0
big_from = int(sys.argv[5]) if len(sys.argv) > 5 else 0


def fail(what: str) -> None:
    print(f"INCONSISTENT {what}", flush=True)
    sys.exit(3)


metrics = open("metrics.csv", "w")
metrics.write("step,loss\n")
logger = logging.getLogger("train")
handler = logging.FileHandler("train.log")  # mode "a"
handler.setFormatter(logging.Formatter("%(message)s"))
logger.addHandler(handler)
logger.setLevel(logging.INFO)
with open("state.bin", "wb") as f:
    f.write(b"%08d" % -1 + b"\n")
state = open("state.bin", "r+b", buffering=0)
db = sqlite3.connect("steps.db", isolation_level=None)
db.execute("CREATE TABLE steps (n INTEGER PRIMARY KEY, loss REAL)")
big = None

for i in range(steps):
    if big_mib and i == big_from:
        with open("big.bin", "wb") as f:
            f.truncate(big_mib * 1024 * 1024)
        big = open("big.bin", "r+b", buffering=0)
    last = int(os.pread(state.fileno(), 8, 0))
    (rows_last,) = db.execute("SELECT coalesce(max(n), -1) FROM steps").fetchone()
    if last != i - 1 or rows_last != i - 1:
        fail(f"at step {i}: state.bin says {last}, steps.db says {rows_last}")
    if big is not None and i > big_from and int(os.pread(big.fileno(), 8, 0)) != i - 1:
        fail(f"at step {i}: big.bin says {os.pread(big.fileno(), 8, 0)!r}")
    loss = 1.0 / (i + 1)
    metrics.write(f"{i},{loss:.6f}\n")
    metrics.flush()
    logger.info("step %d", i)
    db.execute("INSERT INTO steps VALUES (?, ?)", (i, loss))
    os.pwrite(state.fileno(), b"%08d" % i, 0)
    if big is not None:
        os.pwrite(big.fileno(), b"%08d" % i, 0)
    if i % ckpt_every == ckpt_every - 1:
        with open("ckpt.json.tmp", "w") as f:
            json.dump({"step": i}, f)
        os.rename("ckpt.json.tmp", "ckpt.json")
    print(f"step {i}", flush=True)
    time.sleep(interval)
