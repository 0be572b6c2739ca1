"""Memory pressure for real: allocate MIB mebibytes, touch every page (so it is resident, not
merely promised), print "ready", and hold it until killed.  SIGUSR1 gives back half of it and
prints "released" (a node that is better, not yet well)."""

import signal
import sys
import time

CHUNK = 64 * 1024 * 1024
PAGE = 4096

mib = int(sys.argv[1])
chunks = []
for _ in range(max(1, mib * 1024 * 1024 // CHUNK)):
    chunk = bytearray(CHUNK)  # large: its own mapping, returned to the system when dropped
    chunk[::PAGE] = b"\x01" * (CHUNK // PAGE)
    chunks.append(chunk)
print("ready", flush=True)


def release(signum, frame):
    del chunks[len(chunks) // 2:]
    print("released", flush=True)


signal.signal(signal.SIGUSR1, release)
while True:
    time.sleep(3600)
