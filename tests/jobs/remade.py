"""A job holding what criu makes again by path at a restore: a unix socket bound in ``dir``
(answers "pong" to each connection), a named FIFO there (held open), and a file there that it
deleted while holding it; plus an abstract socket.  Prints a counter and what its deleted file
holds, every 20 ms.  Usage: remade.py DIR (``own-tmp``: /tmp, without naming it in the job's
arguments, which would keep the host's /tmp for it: agent/running/launcher.py)"""

import os
import select
import socket
import sys
import time

d = "/tmp" if sys.argv[1] == "own-tmp" else sys.argv[1]
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock_path = os.path.join(d, "sock")
if os.path.lexists(sock_path):
    os.unlink(sock_path)
listener.bind(sock_path)
listener.listen(4)
abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
abstract.bind(f"\0revenant-remade-{os.getpid()}-{time.time_ns()}")
fifo_path = os.path.join(d, "fifo")
if not os.path.exists(fifo_path):
    os.mkfifo(fifo_path, 0o600)
fifo = os.open(fifo_path, os.O_RDWR)
gone = open(os.path.join(d, "gone"), "w+")
gone.write("kept after unlink\n")
gone.flush()
os.unlink(gone.name)
n = 0
while True:
    n += 1
    gone.seek(0)
    print(n, gone.read().strip(), flush=True)
    ready, _, _ = select.select([listener], [], [], 0.02)
    if ready:
        conn, _ = listener.accept()
        conn.sendall(b"pong\n")
        conn.close()
