"""A job holding N established TCP connections to 127.0.0.1:PORT: on each it sends "<n>\n" for
n = 1, 2, ... every 50 ms (all N in turn), and prints "ready" once all are open.
Usage: hold_connections.py N PORT"""

import socket
import sys
import time

n_conns, port = int(sys.argv[1]), int(sys.argv[2])
conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(n_conns)]
print("ready", flush=True)
n = 0
while True:
    n += 1
    for c in conns:
        c.sendall(b"%d\n" % n)
    time.sleep(0.05)
