"""A deterministic job: line i every INTERVAL seconds, each line carrying a hash
chained through every earlier line, so a restore from the wrong memory state
shows up in the output, not just a gap or a repeat."""

import hashlib
import sys
import time

count = int(sys.argv[1]) if len(sys.argv) > 1 else 100
interval = float(sys.argv[2]) if len(sys.argv) > 2 else 0.05
ballast_mib = int(sys.argv[3]) if len(sys.argv) > 3 else 0
# Memory the checkpoint has to carry (touched, so it is really resident).
ballast = bytearray(ballast_mib * 1024 * 1024)
for off in range(0, len(ballast), 4096):
    ballast[off] = 1
h = hashlib.sha256()
for i in range(count):
    h.update(str(i).encode())
    print(f"line {i} {h.hexdigest()[:16]}", flush=True)
    time.sleep(interval)
