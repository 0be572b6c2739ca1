"""A job whose files are all closed between its steps, as real jobs keep them, and which checks at
every step that they are as it left them (a restore onto a later file state shows at once):

* ``sqlite``: ``steps.db`` opened, one row inserted and committed, closed, each step; the rows
  must be exactly 0..i-1 before step i inserts i (a resurrected row also breaks its primary key);
* ``ckpt``: ``model.ckpt`` (4 MiB) rewritten in place every 3 steps, as training scripts save a
  checkpoint into an existing file: opened "r+b", written, closed; before each step its header
  must name the step it was last saved at, and its body that step's bytes;
* ``git``: a repository in the working directory, one commit per step (a file written, every
  third step one renamed with ``git mv``); ``HEAD`` must count exactly i commits before step i.

Usage: closedfiles.py MODE STEPS INTERVAL.  Prints "step i" each step; on finding a file not as
it left it, prints "INCONSISTENT ..." and exits 3.
"""

import os
import sqlite3
import struct
import subprocess
import sys
import time

mode, steps, interval = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
CKPT = 4 * 1024 * 1024
GIT = ["git", "-c", "user.name=job", "-c", "user.email=job@example.org", "-c", "commit.gpgsign=false"]


def fail(what: str) -> None:
    print(f"INCONSISTENT {what}", flush=True)
    sys.exit(3)


def body(step: int) -> bytes:
    return (struct.pack("<Q", step) * (CKPT // 8))[: CKPT - 8]


def sqlite_step(i: int) -> None:
    db = sqlite3.connect("steps.db")
    try:
        db.execute("CREATE TABLE IF NOT EXISTS steps (n INTEGER PRIMARY KEY)")
        rows = [n for (n,) in db.execute("SELECT n FROM steps ORDER BY n")]
        if rows != list(range(i)):
            fail(f"steps.db holds {len(rows)} rows before step {i} (last {rows[-3:]})")
        db.execute("INSERT INTO steps VALUES (?)", (i,))
        db.commit()
    finally:
        db.close()


saved = -1


def ckpt_step(i: int) -> None:
    global saved
    if saved >= 0:
        with open("model.ckpt", "rb") as f:
            head = f.read(8)
            if struct.unpack("<Q", head)[0] != saved or f.read() != body(saved):
                fail(f"model.ckpt is not the one saved at step {saved} (its header says {struct.unpack('<Q', head)[0]})")
    if i % 3 == 0:
        if not os.path.exists("model.ckpt"):
            open("model.ckpt", "wb").close()
        with open("model.ckpt", "r+b") as f:  # in place: the inode stays
            f.write(struct.pack("<Q", i) + body(i))
        saved = i


def git_step(i: int) -> None:
    if i == 0:
        subprocess.run(GIT + ["init", "-q", "."], check=True)
    else:
        count = subprocess.run(GIT + ["rev-list", "--count", "HEAD"], check=True, capture_output=True, text=True)
        if int(count.stdout) != i:
            fail(f"HEAD counts {count.stdout.strip()} commits before step {i}")
    with open(f"f{i % 7}.txt", "a") as f:
        f.write(f"{i}\n")
    if i % 3 == 2:
        subprocess.run(GIT + ["add", "-A"], check=True)
        subprocess.run(GIT + ["mv", f"f{i % 7}.txt", f"g{i}.txt"], check=True)
    subprocess.run(GIT + ["add", "-A"], check=True)
    subprocess.run(GIT + ["commit", "-q", "-m", f"step {i}"], check=True)


step = {"sqlite": sqlite_step, "ckpt": ckpt_step, "git": git_step}[mode]
for i in range(steps):
    step(i)
    print(f"step {i}", flush=True)
    time.sleep(interval)
