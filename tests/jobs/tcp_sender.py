"""A TCP client: connects to 127.0.0.1:PORT and sends "<n>\n" for n = 1, 2, ... every 20 ms,
each line also to stdout; on any error it reconnects (every 100 ms) and goes on with the same n.
A well-written client, as a network blip would find it.  Usage: tcp_sender.py PORT"""

import socket
import sys
import time

port = int(sys.argv[1])
n, sock = 0, None
while True:
    try:
        if sock is None:
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            print("connected", flush=True)
        sock.sendall(b"%d\n" % (n + 1))
        n += 1
        print(n, flush=True)
        time.sleep(0.02)
    except OSError as exc:
        print(f"reconnecting after {exc.__class__.__name__}", flush=True)
        if sock is not None:
            sock.close()
        sock = None
        time.sleep(0.1)
