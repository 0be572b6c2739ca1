"""A job for the partition tests (tests/netcluster): it takes numbered steps and leaves a record
of each where a checker can see it.

usage: stepper.py STEPS INTERVAL COLLECTOR_HOST:PORT LISTEN_PORT

Each step ``n`` writes ``"<n> <digest> <address>"`` to its output, where the digest chains every
earlier step (a restore from the wrong memory shows) and the address is its node's (the source
address of a datagram to the collector): what a copy writes is deterministic but for the
address.  It also sends ``"<job> <n> <address> <pid> <time>"`` to the collector over UDP (an
unconnected socket bound to no address: it moves with the job), so a copy that runs where it
should not is seen even when its output is fenced off.  It answers on LISTEN_PORT (TCP, every
address) with its latest line, so a client reaches it at whichever node it runs on.
"""

import hashlib
import os
import select
import socket
import sys
import time

steps, interval = int(sys.argv[1]), float(sys.argv[2])
host, _, port = sys.argv[3].rpartition(":")
collector = (host, int(port))
listen_port = int(sys.argv[4])
job = os.environ.get("REVENANT_JOB_ID", "?")

udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("0.0.0.0", listen_port))
server.listen(16)
server.setblocking(False)


def address() -> str:
    """This node's address: the source of a route to the collector (a socket made and closed
    each time, so none stays bound to one node's address)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(collector)
        return probe.getsockname()[0]
    except OSError:
        return "unreachable"
    finally:
        probe.close()


def answer(line: str, until: float) -> None:
    """Serve clients with ``line`` until ``until`` (each: one line, then closed)."""
    while True:
        left = until - time.monotonic()
        if left <= 0:
            return
        ready, _, _ = select.select([server], [], [], left)
        if ready:
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            try:
                conn.sendall(line.encode() + b"\n")
            except OSError:
                pass
            conn.close()


h = hashlib.sha256()
line = ""
for n in range(steps):
    h.update(str(n).encode())
    where = address()
    line = f"{n} {h.hexdigest()[:16]} {where}"
    print(line, flush=True)
    try:
        at = time.time()  # next to the send: a dump between the two is restored with both
        udp.sendto(f"{job} {n} {where} {os.getpid()} {at:.3f}".encode(), collector)
    except OSError:
        pass  # cut off from the collector: the output still has it
    answer(line, time.monotonic() + interval)
