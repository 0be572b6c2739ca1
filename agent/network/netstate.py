"""A running job's internet sockets, asked of the sockets themselves: what it listens on and the
TCP connections it holds (``revenant check``).
An epoch's are read from criu's images after the dump instead (agent/network/criuimages.py), so that
the job is not kept frozen for them.

Each socket is asked through a copy of the job's descriptor (agent/processes/jobprocs.py job_sockets): a
few system calls each, where /proc/net/tcp and tcp6 walk the host's whole connection hash table
(about 5 ms each on a machine with 24 GiB, whatever the job holds)."""

from __future__ import annotations

import socket

from revenant.agent.processes.jobprocs import job_sockets

# Enough for an operator to read: each list is cut there.
MAX_LISTED = 64
# The kernel's TCP states (include/net/tcp_states.h): the first byte of TCP_INFO.
_ESTABLISHED, _LISTEN = 1, 10
_INET = (socket.AF_INET, socket.AF_INET6)


def address(family: int, ip: str, port: int) -> str:
    """``127.0.0.1:8080``; IPv6 as ``[::1]:8080`` (agent/network/criuimages.py names an epoch's the same)."""
    return f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"


def _described(sk: socket.socket) -> tuple[str, str]:
    """("tcp 0.0.0.0:6379" for a socket listening or bound to receive, else ""; "local -> peer"
    for an established TCP connection, else ""); raises OSError."""
    family = sk.family
    local = sk.getsockname()
    try:
        remote = sk.getpeername()
    except OSError:
        remote = None
    if sk.type == socket.SOCK_STREAM:
        state = sk.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
        if state == _LISTEN:
            return f"tcp {address(family, *local[:2])}", ""
        if remote is not None and state == _ESTABLISHED:
            return "", f"{address(family, *local[:2])} -> {address(family, *remote[:2])}"
        return "", ""
    if sk.type == socket.SOCK_DGRAM and remote is None and local[1]:
        return f"udp {address(family, *local[:2])}", ""
    return "", ""


def sockets(root: int) -> tuple[list[str], list[str]]:
    """(listening, connections): ``"tcp 0.0.0.0:6379"``, ``"udp [::1]:10000"`` for each socket the
    job listens or is bound on, and ``"127.0.0.1:41234 -> 127.0.0.1:5432"`` for each established
    TCP connection, each list sorted and at most MAX_LISTED long."""
    listening, connections = set(), set()
    for sk in job_sockets(root):
        if sk.family not in _INET:
            continue
        try:
            listens, connection = _described(sk)
        except OSError:
            continue
        listening.update([listens] if listens else [])
        connections.update([connection] if connection else [])
    return sorted(listening)[:MAX_LISTED], sorted(connections)[:MAX_LISTED]
