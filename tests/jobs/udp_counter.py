"""The seed's counter (NVIDIA's cuda-checkpoint example, without the GPU): every UDP packet to
127.0.0.1:PORT increments a counter that starts at 100, and the value goes back to the sender
as "%d\n" and to stdout.  Usage: udp_counter.py PORT"""

import socket
import sys

sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.bind(("127.0.0.1", int(sys.argv[1])))
counter = 100
while True:
    _, peer = sock.recvfrom(16)
    counter += 1
    sock.sendto(b"%d\n" % counter, peer)
    print(counter, flush=True)
